"""The history of a chaos run: what each client and the nemesis did, when.

An operation is recorded when it is invoked and again when it completes:
``ok`` (it happened), ``fail`` (it certainly did not) or ``info`` (unknown:
an error after the request may have reached a node). Times are seconds since
the run started, from one monotonic clock. The history is written as JSON
lines, one operation per line, and read back the same way.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Op", "History", "read_history"]

TYPES = ("invoke", "ok", "fail", "info")


@dataclass(frozen=True, slots=True)
class Op:
    time: float
    process: str  # "producer-1", "consumer-2", "nemesis"
    type: str  # one of TYPES
    f: str  # "add", "dequeue", "ack", "fault", "phase"
    value: Any = None
    node: str | None = None
    error: str | None = None


class History:
    """Thread-safe, append-only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._ops: list[Op] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._clock() - self._start

    def record(self, process: str, type: str, f: str, value: Any = None,
               node: str | None = None, error: str | None = None) -> Op:
        assert type in TYPES, type
        with self._lock:
            op = Op(round(self.now(), 4), process, type, f, value, node, error)
            self._ops.append(op)
        return op

    @property
    def ops(self) -> list[Op]:
        with self._lock:
            return list(self._ops)

    def write(self, path: Path) -> None:
        with path.open("w") as out:
            for op in self.ops:
                out.write(json.dumps(asdict(op), separators=(",", ":")) + "\n")


def read_history(path: Path) -> list[Op]:
    return [Op(**json.loads(line)) for line in path.read_text().splitlines() if line]
