"""``pgq serve``: pgq for programs in any language, on a database: the HTTP
API (``--http``, :mod:`pgq.httpapi`) and Disque's client protocol
(``--resp``, :mod:`pgq.resp`), one process, one client (their requests
share its group commit)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import click

from .common import node_dsn, target_options


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _address(option: str, text: str) -> tuple[str, int]:
    from ..metrics import parse_listen

    try:
        return parse_listen(text)
    except ValueError:
        raise click.UsageError(f"{option} wants HOST:PORT, not {text!r}") from None


@click.command("serve")
@click.option("--http", "http_listen", metavar="HOST:PORT",
              help="Address of the HTTP API (JSON; its OpenAPI document at /openapi.json).")
@click.option("--resp", "resp_listen", metavar="HOST:PORT",
              help="Address of Disque's client protocol (RESP2; Disque's port is 7711).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="File holding the secret: the HTTP bearer token and the RESP AUTH password "
                   "(default: $PGQ_HTTP_TOKEN).")
@target_options
def serve(http_listen: str | None, resp_listen: str | None, token_file: str | None,
          dsn: str | None, data: str | None) -> None:
    """Serve pgq to programs in any language: an HTTP API (add, lease, ack,
    nack, working, status, wait, stats, health, metrics) and/or Disque's
    protocol (ADDJOB, GETJOB, ACKJOB, ...)."""
    import anyio

    from ..aio import AsyncClient

    if not http_listen and not resp_listen:
        raise click.UsageError("say what to serve: --http HOST:PORT and/or --resp HOST:PORT")
    token = Path(token_file).read_text().strip() if token_file else os.environ.get("PGQ_HTTP_TOKEN")
    listens = [(o, t) for o, t in (("--http", http_listen), ("--resp", resp_listen)) if t]
    for option, text in listens:
        host, _port = _address(option, text)
        if not token and not _loopback(host):
            raise click.UsageError(f"listening on {host} (beyond loopback) needs a secret: "
                                   "--token-file FILE or PGQ_HTTP_TOKEN")
    client = AsyncClient(node_dsn(data, dsn) if data else dsn)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            if http_listen:
                tasks.start_soon(_http, client, *_address("--http", http_listen), token)
                click.echo(f"pgq HTTP API on http://{http_listen} (OpenAPI: /openapi.json)", err=True)
            if resp_listen:
                from ..resp import serve as serve_resp

                host, port = _address("--resp", resp_listen)
                tasks.start_soon(serve_resp, client, host, port, token)
                click.echo(f"pgq RESP (Disque's protocol) on {resp_listen}", err=True)

    try:
        anyio.run(main)
    except KeyboardInterrupt:
        pass


async def _http(client: Any, host: str, port: int, token: str | None) -> None:
    import uvicorn

    from ..httpapi import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(client, token), host=host, port=port,
                                           log_level="warning"))
    await server.serve()
