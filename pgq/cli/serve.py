"""``pgq serve --http HOST:PORT``: pgq's HTTP API (pgq.httpapi) on a database."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import click

from .common import node_dsn, target_options


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command("serve")
@click.option("--http", "http_listen", required=True, metavar="HOST:PORT",
              help="Address of the HTTP API (JSON; its OpenAPI document at /openapi.json).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="File holding the bearer token clients must send (default: $PGQ_HTTP_TOKEN).")
@target_options
def serve(http_listen: str, token_file: str | None, dsn: str | None, data: str | None) -> None:
    """Serve pgq's HTTP API: add, lease, ack, nack, working, status, wait,
    queue stats, health and metrics, for programs in any language."""
    import uvicorn

    from ..aio import AsyncClient
    from ..httpapi import create_app
    from ..metrics import parse_listen

    try:
        host, port = parse_listen(http_listen)
    except ValueError:
        raise click.UsageError(f"--http wants HOST:PORT, not {http_listen!r}") from None
    token = Path(token_file).read_text().strip() if token_file else os.environ.get("PGQ_HTTP_TOKEN")
    if not token and not _loopback(host):
        raise click.UsageError(f"listening on {host} (beyond loopback) needs a token: "
                               "--token-file FILE or PGQ_HTTP_TOKEN")
    client = AsyncClient(node_dsn(data, dsn) if data else dsn)
    click.echo(f"pgq HTTP API on http://{http_listen} (OpenAPI: /openapi.json)", err=True)
    uvicorn.run(create_app(client, token), host=host, port=port, log_level="warning")
