"""``docs/reference.md``, rendered from the code: every CLI command with its
options, the public API's classes and methods with their signatures, and
every ``PGQ_*`` environment variable.

Run ``python -m pgq.reference > docs/reference.md``. The test suite renders
it again and compares, so the page cannot drift from the code; it also
checks that every ``PGQ_*`` name the code reads is in :data:`ENVIRONMENT`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import click

__all__ = ["ENVIRONMENT", "render"]

# Every variable pgq reads, with what it does; one place (the reference
# page and `--help` texts come from here or name the same variable).
ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("PGQ_DSN", "Database of the CLI commands (as `--dsn`); unset: the embedded server."),
    ("PGQ_HOME", "Directory of the embedded PostgreSQL server (default: the user data directory)."),
    ("PGQ_PG_BINDIR", "Where PostgreSQL's server binaries are (default: found on the system)."),
    ("PGQ_SERVER_USER", "Unprivileged user the embedded server runs as when pgq runs as root "
                        "(default `postgres`)."),
    ("PGQ_EMBEDDED_LISTEN", "Listen address of the embedded server (default loopback), e.g. `*`."),
    ("PGQ_EMBEDDED_PORT", "A fixed port for the embedded server (default: a free one)."),
    ("PGQ_EMBEDDED_PASSWORD", "Password of the embedded server's role (default: a random one); "
                              "a changed one takes effect at the next start."),
    ("PGQ_EMBEDDED_HBA", "An extra `pg_hba.conf` source for the embedded server, e.g. `samenet`."),
    ("PGQ_LOG_FORMAT", "`json`: node, worker and serve logs are one JSON object per line "
                       "(as `--json`); default `text`."),
    ("PGQ_LOG_LEVEL", "Log level of nodes, workers and `serve` (as `pgq worker --log-level`)."),
    ("PGQ_EVENT_LOOP", "`asyncio`: `pgq serve`, `pgq dashboard` and a node's fronts run on "
                       "asyncio's own event loop; default uvloop where it is installed."),
    ("PGQ_HTTP_BODY_TIMEOUT", "Seconds a request body may take to arrive at the HTTP API "
                              "(408 past it); default 120."),
    ("PGQ_RESP_MAX_CLIENTS", "Connections the RESP port serves at once (Disque's maxclients; "
                             "past it: `-ERR max number of clients reached`); default 10000, "
                             "lowered with a warning to fit the open-files limit (`ulimit -n`) "
                             "less 64 where that cannot be raised."),
    ("PGQ_METRICS", "HOST:PORT of the Prometheus endpoint of a node or worker (as `--metrics`)."),
    ("PGQ_ADVERTISE_DSN", "The DSN a node advertises for other nodes' clients to write copies "
                          "into (as `pgq node start --advertise-dsn`; `none`: no direct copies)."),
    ("PGQ_CLUSTER_SECRET", "The cluster secret itself, when no `--secret-file` is given "
                           "(else `DIR/cluster.secret`, made on a first start)."),
    ("PGQ_HTTP_TOKEN", "The secret of `--http`/`--resp` on `pgq serve` and `pgq node start` "
                       "(HTTP bearer token, RESP AUTH password) "
                       "when no `--token-file` is given."),
    ("PGQ_DASHBOARD", "HOST:PORT of the web dashboard of `pgq node start` and `pgq serve` "
                      "(as `--dashboard`)."),
    ("PGQ_DASHBOARD_TOKEN_FILE", "File holding the token that unlocks the dashboard's actions "
                                 "(`pgq dashboard --token-file`, `--dashboard-token-file`)."),
    ("PGQ_SPARK_MASTER", "Spark master of `pgq spark` (default `local[*]`)."),
    ("PGQ_JDBC_JAR", "PostgreSQL JDBC driver jar for Spark (default: Debian's "
                     "`/usr/share/java/postgresql.jar`)."),
    ("PGQ_TEST_ADMIN_DSN", "`pgq.testing`: a role that may create databases, to test on your "
                           "own server instead of an embedded one."),
    ("PGQ_TEST_DOCKER", "pgq's own test suite: `1` runs it on a PostgreSQL container "
                        "(testcontainers) instead of a local server."),
    ("PGQ_SCREENSHOTS", "pgq's own dashboard tests: where their screenshots go (default "
                        "`test-results/screenshots`; `docs/screenshots` refreshes the README's)."),
    ("PGQ_CHAOS_SEED", "pgq's own chaos test (`make chaos`): the seed of its fault schedule."),
)


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Command]]:
    for name in sorted(group.commands):
        command = group.commands[name]
        path = (*prefix, name)
        if isinstance(command, click.Group):
            yield from _commands(command, path)
        else:
            yield " ".join(path), command


def _option_line(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        return f"* `{param.human_readable_name}`{'' if param.required else ' (optional)'}"
    assert isinstance(param, click.Option)
    names = ", ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
    extra = []
    if param.envvar:
        extra.append(f"env `{param.envvar}`")
    if param.show_default and param.default not in (None, False, ()):
        extra.append(f"default `{param.default}`")
    suffix = f" ({', '.join(extra)})" if extra else ""
    return f"* {names}: {(param.help or '').strip()}{suffix}"


def _cli_section() -> list[str]:
    from .cli import main

    lines = ["## Command line", "",
             "Exit codes: 0 done, 1 a pgq error (`error: ...` on stderr), 2 bad usage, "
             "3 nothing found, 130 interrupted. Every command takes `--help` and `--json`.", ""]
    for path, command in _commands(main):
        lines += [f"### `pgq {path}`", "", inspect.cleandoc(command.help or ""), ""]
        params = [p for p in command.params if p.name != "help"]
        lines += [_option_line(p) for p in params] + [""]
    return lines


def _signature(function: Any) -> str:
    """``(a: int, *, b: str = 'x') -> T`` with annotations as written (they
    are strings here: ``from __future__ import annotations``), no ``self``."""
    signature = inspect.signature(function)
    parts: list[str] = []
    star = False
    for param in signature.parameters.values():
        if param.name == "self":
            continue
        stars = "*" if param.kind == param.VAR_POSITIONAL else "**" if param.kind == param.VAR_KEYWORD else ""
        text = stars + param.name
        if param.kind == param.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or param.kind in (param.KEYWORD_ONLY, param.VAR_POSITIONAL)
        if param.annotation is not param.empty:
            text += f": {param.annotation}"
        if param.default is not param.empty:
            text += f" = {param.default!r}"
        parts.append(text)
    returns = signature.return_annotation
    return f"({', '.join(parts)})" + ("" if returns is signature.empty else f" -> {returns}")


def _api_section() -> list[str]:
    import pgq

    lines = ["## Python API", ""]
    for name in ("Client", "AsyncClient", "Worker", "Tasks", "Job"):
        cls = getattr(pgq, name)
        doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
        lines += [f"### `pgq.{name}`", "", doc, ""]
        for method_name, method in inspect.getmembers(cls, inspect.isfunction):
            if method_name.startswith("_") or method_name.endswith("_command"):
                continue
            first = inspect.cleandoc(method.__doc__ or "").split("\n\n")[0].replace("\n", " ")
            lines.append(f"* `{method_name}{_signature(method)}`" + (f": {first}" if first else ""))
        lines.append("")
    lines += ["### Functions and errors", ""]
    for name in ("migrate", "stop_embedded"):
        function: Any = getattr(pgq, name)
        first = inspect.cleandoc(function.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        lines.append(f"* `pgq.{name}{_signature(function)}`: {first}")
    from . import errors

    for name in errors.__all__:
        first = inspect.cleandoc(getattr(errors, name).__doc__ or "").split("\n\n")[0].replace("\n", " ")
        lines.append(f"* `pgq.errors.{name}`: {first}")
    return lines + [""]


def _environment_section() -> list[str]:
    lines = ["## Environment variables", "", "| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in ENVIRONMENT]
    return lines + [""]


def render() -> str:
    """The whole page (Markdown)."""
    head = ["# pgq reference", "",
            "Rendered from the code by `python -m pgq.reference` (the test suite checks it is "
            "current). The user guide is [guide.md](guide.md).", ""]
    return "\n".join(head + _cli_section() + _api_section() + _environment_section()).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
