"""The chaos test: the checker and the schedule on their own, then one
short seeded run against a real 3-node cluster (``make chaos`` runs a long
one). Partitions need root and nftables, clock faults libfaketime: where
missing, those kinds are left out of the run and the test says so."""

from __future__ import annotations

import os

import pytest

from .checker import check
from .history import Op
from .nemesis import KILLS, KINDS, schedule

pytestmark = pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1",
                                reason="the chaos run starts one embedded server per node")


def ops(*rows: tuple) -> list[Op]:
    return [Op(*row) for row in rows]


def test_an_acknowledged_add_never_received_is_lost():
    verdict = check(ops((0.1, "p", "invoke", "add", "a"), (0.2, "p", "ok", "add", "a"),
                        (0.3, "p", "invoke", "add", "b"), (0.4, "p", "ok", "add", "b"),
                        (0.5, "c", "ok", "dequeue", ["a"])))
    assert verdict.lost == ["b"] and not verdict.valid
    assert verdict.add_latency["max"] == pytest.approx(0.1)


def test_a_value_nobody_added_is_unexpected_and_duplicates_are_only_counted():
    verdict = check(ops((0.1, "p", "invoke", "add", "a"), (0.2, "p", "ok", "add", "a"),
                        (0.3, "c", "ok", "dequeue", ["a", "zz"]), (0.4, "c", "ok", "dequeue", ["a"])))
    assert verdict.unexpected == ["zz"] and not verdict.valid
    assert verdict.duplicated == 1


def test_an_add_of_unknown_outcome_may_or_may_not_arrive():
    verdict = check(ops((0.1, "p", "invoke", "add", "a"), (0.2, "p", "info", "add", "a", None, "NoReplError: x"),
                        (0.3, "p", "invoke", "add", "b"), (0.4, "p", "info", "add", "b", None, "NoReplError: y"),
                        (0.5, "p", "invoke", "add", "c"),  # never completed
                        (0.6, "c", "ok", "dequeue", ["a", "c"])))
    assert verdict.valid and verdict.indeterminate == 3 and verdict.recovered == 2
    assert verdict.errors == {"NoReplError": 2}


def test_availability_counts_adds_invoked_during_faults():
    one = {"kind": "pause", "targets": ["n1"]}
    two = {"kind": "pause", "targets": ["n1", "n2"]}
    verdict = check(ops(
        (0.0, "nemesis", "info", "phase", "faults"),
        (0.5, "p", "invoke", "add", "before"), (0.6, "p", "ok", "add", "before"),
        (1.0, "nemesis", "invoke", "fault", one),
        (1.1, "p", "invoke", "add", "a"), (1.2, "p", "ok", "add", "a"),
        (1.3, "p", "invoke", "add", "b"), (4.0, "p", "info", "add", "b", None, "Timeout: t"),
        (4.5, "nemesis", "ok", "fault", one),
        (5.0, "nemesis", "invoke", "fault", two),
        (5.1, "p", "invoke", "add", "c"), (5.2, "p", "ok", "add", "c"),
        (6.0, "nemesis", "ok", "fault", two),
        (7.0, "nemesis", "info", "phase", "heal"),
        (7.5, "c", "ok", "dequeue", ["before", "a", "b", "c"])))
    assert (verdict.adds_in_faults, verdict.adds_in_faults_ok) == (3, 2)
    assert (verdict.adds_in_one_node_faults, verdict.adds_in_one_node_faults_ok) == (2, 1)
    assert verdict.availability_one_node == 0.5
    # seconds 0..6 of the fault phase: adds succeeded in 0, 1 and 5
    assert (verdict.seconds_without_add, verdict.fault_phase_seconds) == (4, 7)


def test_a_schedule_is_its_seed_and_covers_every_kind_first():
    nodes = ["n1", "n2", "n3", "n4", "n5"]
    first = schedule(42, nodes, KINDS, count=30)
    assert first == schedule(42, nodes, KINDS, count=30)
    assert first != schedule(43, nodes, KINDS, count=30)
    assert sorted(f.kind for f in first[:len(KINDS)]) == sorted(KINDS)
    assert all(len(f.targets) == 1 for f in first[:len(KINDS)])
    assert first[len(KINDS)].kind in KILLS and first[len(KINDS)].targets == tuple(nodes)
    for fault in first[len(KINDS) + 1:]:
        assert 1 <= len(fault.targets) <= 2  # one node, or a minority of five
        assert set(fault.targets) <= set(nodes)
        assert (fault.skew != 0) == (fault.kind == "clock")


def test_unknown_fault_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown fault kinds"):
        schedule(1, ["n1", "n2", "n3"], ["kill-node", "flood"], count=3)


def test_a_short_seeded_run_loses_nothing(tmp_path):
    """Every fault kind this machine allows, once each on one node, then
    every node killed at once, then random faults; heal, drain, check.
    Bounded at about two minutes here (cluster start, 75 s of faults, the
    drain)."""
    from .run import Options, available_kinds, run

    seed = int(os.environ.get("PGQ_CHAOS_SEED", "20261125"))
    kinds, skipped = available_kinds(KINDS)
    outcome = run(Options(seed=seed, nodes=3, seconds=75, durations=(2.0, 4.0), rests=(1.5, 3.0),
                          out=tmp_path / "chaos"))
    print(outcome.line(), "skipped:", skipped)
    assert outcome.verdict.valid, (f"seed {seed}: lost {outcome.verdict.lost[:20]}, "
                                   f"unexpected {outcome.verdict.unexpected[:20]}")
    assert outcome.held_after_drain == 0, f"seed {seed}: jobs still held after the drain"
    applied = {fault["kind"] for fault in outcome.faults}
    assert applied == set(kinds), f"seed {seed}: faults applied {applied}, wanted {set(kinds)}"
    assert any(len(fault["targets"]) == 3 for fault in outcome.faults), "no all-nodes kill"
    assert outcome.verdict.acknowledged > 1000  # the workload ran through the faults
    if skipped:
        pytest.skip(f"ran without {', '.join(skipped)}: {'; '.join(skipped.values())}")
