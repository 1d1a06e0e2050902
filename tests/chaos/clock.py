"""Clock skew per node, with libfaketime.

Every node process of a run with clock faults starts under libfaketime
(``LD_PRELOAD``) reading its offset from a file of its own, re-read once a
second; the node's PostgreSQL, started by it (or by the nemesis through the
same launcher), inherits it. Writing ``+30`` to the file moves that node's
wall clock 30 s ahead; monotonic time is left alone
(``FAKETIME_DONT_FAKE_MONOTONIC``), as with a real clock that is stepped.

libfaketime 0.9.10 (Debian 12) breaks ``clock_nanosleep`` on the monotonic
clock with an absolute deadline when monotonic time is not faked (its issue
#426), which is what Python 3.11's ``time.sleep`` calls: node processes
therefore start through ``skewed.py``, which replaces ``time.sleep``.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

__all__ = ["Clocks", "library", "unavailable"]

SKEWED = Path(__file__).with_name("skewed.py")


def library() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")
                   + glob.glob("/usr/lib/faketime/libfaketimeMT.so.1")
                   + glob.glob("/usr/local/lib/faketime/libfaketimeMT.so.1"))
    return found[0] if found else None


def unavailable() -> str | None:
    if library() is None:
        return "libfaketime is not installed (Debian: apt-get install faketime)"
    return None


class Clocks:
    def __init__(self, root: Path) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError(unavailable())
        self.lib = lib
        self.root = root

    def file(self, node: str) -> Path:
        return self.root / f"{node}.faketime"

    def env(self, node: str) -> dict[str, str]:
        self.skew(node, 0.0)
        return {"LD_PRELOAD": self.lib, "FAKETIME_TIMESTAMP_FILE": str(self.file(node)),
                "FAKETIME_CACHE_DURATION": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}

    @property
    def launcher(self) -> list[str]:
        return [sys.executable, str(SKEWED), "pgq.cli"]

    def skew(self, node: str, seconds: float) -> None:
        path = self.file(node)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(f"{seconds:+.1f}\n")
        temporary.chmod(0o644)  # the server runs as another user
        temporary.replace(path)  # atomic: a reader never sees half a line
