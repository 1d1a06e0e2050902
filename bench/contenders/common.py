"""Helpers shared by contender processes (no pgq import: peers use them too)."""

from __future__ import annotations

import json
import statistics
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

BODY = b"0123456789abcdef"  # 16-byte bodies, as the workloads specify


def stamped() -> bytes:
    """A 16-byte body carrying the time it was made (for latency)."""
    return struct.pack("!d", time.time()) + b"pgqbench"


def age_of(body: bytes) -> float:
    return time.time() - struct.unpack("!d", bytes(body[:8]))[0]


def percentiles(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50": None, "p99": None}
    ordered = sorted(samples)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}


def main(workloads: dict[str, Callable[..., dict[str, Any]]]) -> None:
    params = json.loads(sys.argv[1])
    workload = params.pop("workload")
    if workload not in workloads:
        print(json.dumps({"error": f"workload {workload} not supported"}))
        sys.exit(0)
    result = workloads[workload](**params)
    print(json.dumps(result))
