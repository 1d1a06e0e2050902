"""The peers' own virtualenv: pgqueuer and procrastinate, installed from PyPI
by the bench itself (never by hand), pinned so runs are comparable.

They live apart from pgq's environment so that their dependency pins can
never change pgq's (pgqueuer even installs a console script named `pgq`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PEERS = {"pgqueuer": "1.6.0", "procrastinate": "3.10.0"}
SUPPORT = ["psycopg[binary]>=3.2", "anyio>=4"]
VENV = Path(__file__).resolve().parent / ".venv-peers"


def python() -> Path:
    return VENV / "bin" / "python"


def installed() -> dict[str, str]:
    if not python().exists():
        return {}
    out = subprocess.run([str(python()), "-m", "pip", "list", "--format=freeze"],
                         capture_output=True, text=True, check=False).stdout
    return dict(line.split("==", 1) for line in out.splitlines() if "==" in line)


def ensure(log=print) -> Path:  # type: ignore[no-untyped-def]
    """Create or update the peers' virtualenv; return its interpreter."""
    have = installed()
    if all(have.get(name) == version for name, version in PEERS.items()):
        return python()
    log(f"installing the peers ({', '.join(f'{n}=={v}' for n, v in PEERS.items())}) into {VENV} ...")
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *(f"{n}=={v}" for n, v in PEERS.items()), *SUPPORT], check=True)
    return python()
