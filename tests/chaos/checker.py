"""The total-queue check of a chaos history, and add availability (pure).

Jepsen's total-queue property, for a queue with at-least-once delivery:

* **lost**: values whose add was acknowledged (``ok``) and that no consumer
  ever received. Must be none: pgq promises that an acknowledged add
  survives the failure of W-1 of its nodes, and no fault here destroys a
  disk.
* **unexpected**: values received that no producer ever tried to add. Must
  be none (a corrupted or invented job).
* **duplicated**: values received more than once. Allowed (at-least-once:
  a lost ack or an expired lease delivers a job again), counted.
* **recovered**: adds whose outcome was unknown (``info``: a timeout, a
  NOREPL whose copies may survive, a connection lost mid-call) that were
  received after all. Allowed either way.

Availability: of the adds invoked while a fault was active, the share that
succeeded; separately for faults that hit one node only (pgq's goal: at
least 0.99 with the default ``replicate``), and the whole seconds of the
fault phase in which no add succeeded at all.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .history import Op

__all__ = ["Verdict", "check"]


@dataclass
class Verdict:
    attempted: int
    acknowledged: int
    indeterminate: int
    received: int  # distinct values
    lost: list[str]
    unexpected: list[str]
    duplicated: int  # values received more than once
    recovered: int
    adds_in_faults: int
    adds_in_faults_ok: int
    adds_in_one_node_faults: int
    adds_in_one_node_faults_ok: int
    seconds_without_add: int
    fault_phase_seconds: int
    errors: dict[str, int] = field(default_factory=dict)  # add errors by type
    add_latency: dict[str, float] = field(default_factory=dict)  # p50/p99/max, s, of acknowledged adds

    @property
    def valid(self) -> bool:
        return not self.lost and not self.unexpected

    @property
    def availability(self) -> float | None:
        return _ratio(self.adds_in_faults_ok, self.adds_in_faults)

    @property
    def availability_one_node(self) -> float | None:
        return _ratio(self.adds_in_one_node_faults_ok, self.adds_in_one_node_faults)

    def line(self) -> str:
        def show(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        return (f"valid={self.valid} lost={len(self.lost)} unexpected={len(self.unexpected)} "
                f"duplicated={self.duplicated} attempted={self.attempted} "
                f"acknowledged={self.acknowledged} indeterminate={self.indeterminate} "
                f"recovered={self.recovered} availability={show(self.availability)} "
                f"availability_one_node={show(self.availability_one_node)} "
                f"seconds_without_add={self.seconds_without_add}/{self.fault_phase_seconds} "
                f"add_p50={self.add_latency.get('p50', 0) * 1000:.1f}ms "
                f"add_p99={self.add_latency.get('p99', 0) * 1000:.1f}ms "
                f"add_max={self.add_latency.get('max', 0):.2f}s")


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def check(ops: Sequence[Op]) -> Verdict:
    invoked: dict[str, float] = {}
    outcome: dict[str, Op] = {}
    received: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for op in ops:
        if op.f == "add" and op.type == "invoke":
            invoked[op.value] = op.time
        elif op.f == "add":
            outcome[op.value] = op
            if op.type != "ok":
                errors[(op.error or "?").split(":", 1)[0]] += 1
        elif op.f == "dequeue" and op.type == "ok":
            received.update(op.value)
    acknowledged = {v for v, op in outcome.items() if op.type == "ok"}
    indeterminate = {v for v, op in outcome.items() if op.type == "info"}
    indeterminate |= set(invoked) - set(outcome)  # still running when the run ended
    windows = _fault_windows(ops)
    in_faults = [v for v, t in invoked.items() if _window_of(windows, t) is not None]
    in_one = [v for v in in_faults if len(_window_of(windows, invoked[v])[2]) == 1]  # type: ignore[index]
    start, end = _fault_phase(ops)
    ok_seconds = {math.floor(op.time) for op in outcome.values()
                  if op.type == "ok" and start <= op.time < end}
    seconds = max(0, math.floor(end) - math.ceil(start))
    return Verdict(
        attempted=len(invoked),
        acknowledged=len(acknowledged),
        indeterminate=len(indeterminate),
        received=len(received),
        lost=sorted(acknowledged - set(received)),
        unexpected=sorted(set(received) - set(invoked)),
        duplicated=sum(1 for count in received.values() if count > 1),
        recovered=len(indeterminate & set(received)),
        adds_in_faults=len(in_faults),
        adds_in_faults_ok=sum(1 for v in in_faults if v in acknowledged),
        adds_in_one_node_faults=len(in_one),
        adds_in_one_node_faults_ok=sum(1 for v in in_one if v in acknowledged),
        seconds_without_add=sum(1 for s in range(math.ceil(start), math.floor(end))
                                if s not in ok_seconds),
        fault_phase_seconds=seconds,
        errors=dict(errors),
        add_latency=_percentiles([op.time - invoked[v] for v, op in outcome.items()
                                  if op.type == "ok" and v in invoked]),
    )


def _percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)
    return {"p50": ordered[len(ordered) // 2],
            "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], "max": ordered[-1]}


def _fault_windows(ops: Sequence[Op]) -> list[tuple[float, float, list[str]]]:
    """(start, healed, targets) of each fault: from its invoke to its ok."""
    windows = []
    started: tuple[float, list[str]] | None = None
    for op in ops:
        if op.f != "fault":
            continue
        if op.type == "invoke":
            started = (op.time, list(op.value["targets"]))
        elif started is not None:
            windows.append((started[0], op.time, started[1]))
            started = None
    if started is not None:
        windows.append((started[0], math.inf, started[1]))
    return windows


def _window_of(windows: list[tuple[float, float, list[str]]],
               t: float) -> tuple[float, float, list[str]] | None:
    for window in windows:
        if window[0] <= t < window[1]:
            return window
    return None


def _fault_phase(ops: Sequence[Op]) -> tuple[float, float]:
    """From the 'faults' phase mark to the 'heal' mark."""
    marks = {op.value: op.time for op in ops if op.f == "phase"}
    return marks.get("faults", 0.0), marks.get("heal", ops[-1].time if ops else 0.0)
