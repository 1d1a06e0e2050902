"""``pgq serve``: pgq for programs in any language, on a database: the HTTP
API (``--http``, :mod:`pgq.httpapi`) and Disque's client protocol
(``--resp``, :mod:`pgq.resp`), one process, one client (their requests
share its group commit)."""

from __future__ import annotations

import os
from typing import Any

import click

from .common import json_logs_option, listen_address, node_dsn, read_token, target_options


@click.command("serve")
@click.option("--http", "http_listen", metavar="HOST:PORT",
              help="Address of the HTTP API (JSON; its OpenAPI document at /openapi.json).")
@click.option("--resp", "resp_listen", metavar="HOST:PORT",
              help="Address of Disque's client protocol (RESP2; Disque's port is 7711).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="File holding the secret: the HTTP bearer token and the RESP AUTH password "
                   "(default: $PGQ_HTTP_TOKEN).")
@json_logs_option
@target_options
def serve(http_listen: str | None, resp_listen: str | None, token_file: str | None,
          dsn: str | None, data: str | None) -> None:
    """Serve pgq to programs in any language: an HTTP API (add, lease, ack,
    nack, working, status, wait, stats, health, metrics) and/or Disque's
    protocol (ADDJOB, GETJOB, ACKJOB, ...)."""
    import logging

    import anyio

    from ..aio import AsyncClient
    from ..cluster.process import setup_logging

    if not http_listen and not resp_listen:
        raise click.UsageError("say what to serve: --http HOST:PORT and/or --resp HOST:PORT")
    token = read_token(token_file) if token_file else os.environ.get("PGQ_HTTP_TOKEN")
    addresses = {option: listen_address(option, text, token)
                 for option, text in (("--http", http_listen), ("--resp", resp_listen)) if text}
    client = AsyncClient(node_dsn(data, dsn) if data else dsn)
    setup_logging("serve")
    log = logging.getLogger("pgq.serve")

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            if http_listen:
                tasks.start_soon(_http, client, *addresses["--http"], token)
                log.info("pgq HTTP API on http://%s (OpenAPI: /openapi.json)", http_listen)
            if resp_listen:
                from ..resp import serve as serve_resp

                tasks.start_soon(serve_resp, client, *addresses["--resp"], token)
                log.info("pgq RESP (Disque's protocol) on %s", resp_listen)

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
