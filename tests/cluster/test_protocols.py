"""The pure protocol modules on their own (no database, no network, no clock):
re-queue announcements, the ACK collector and its GC take-over, the
replicator (resume after a restart, the leaving hand-over), federation's
pacing, and the in-memory network's routing."""

from __future__ import annotations

import random

from pgq.cluster.acks import AckCollector, take_over
from pgq.cluster.federation import Federation, export_count
from pgq.cluster.messages import JobCopy
from pgq.cluster.mock_transport import Network, NetworkFaults
from pgq.cluster.replication import GRACE, Replicator
from pgq.cluster.requeue import Requeues


def copy(job_id: str = "J", repl: int = 3, nodes: tuple[str, ...] = ()) -> JobCopy:
    return JobCopy(job_id, "q", b"x", 1, repl, 5.0, 0.0, 2e9, 0, 0, nodes)


# ------------------------------------------------------------ requeue

def test_a_timer_is_announced_once_per_due_time_to_the_other_holders():
    r = Requeues("me")
    assert r.announce([("J", ["me", "a", "b"], 10.0)]) == {"a": ["J"], "b": ["J"]}
    assert r.announce([("J", ["me", "a", "b"], 10.0)]) == {}  # the same due time: once
    assert r.announce([("J", ["me", "a", "b"], 12.0)]) == {"a": ["J"], "b": ["J"]}  # postponed


def test_announcements_are_forgotten_when_their_job_is_no_longer_due_soon():
    r = Requeues("me")
    r.announce([("J", ["me", "a"], 10.0), ("K", ["me", "a"], 10.0)])
    assert r.announce([("K", ["me", "a"], 10.0)]) == {}
    assert r._announced == {"K": 10.0}  # J left the window: nothing of it is kept
    assert r.announce([("J", ["me", "a"], 10.0)]) == {"a": ["J"]}  # back again: announced again


def test_fired_timers_tell_every_other_holder_with_the_counter_to_bump():
    r = Requeues("me")
    notices = r.fired([("J", ["me", "a", "b"], True), ("K", ["a"], False)])
    assert notices == {("a", "additional_deliveries"): ["J"], ("b", "additional_deliveries"): ["J"],
                       ("a", ""): ["K"]}


def test_a_willqueue_is_answered_with_queued_jobs_and_acks():
    queued, acked = Requeues("me").on_willqueue(
        iter([("J", "queued", None), ("K", "active", None), ("L", "acked", ["a", "me"])]))
    assert queued == ("J",) and acked == (("L", ("a", "me")),)


# ------------------------------------------------------------ acks

def test_an_ack_is_collected_once_every_holder_confirmed():
    acks = AckCollector("me")
    acks.add("J", {"a", "b"}, now=0.0)
    assert acks.sends(0.0, {"a", "b"}) == {"a": [("J", ("a", "b", "me"))], "b": [("J", ("a", "b", "me"))]}
    assert acks.sends(0.5, {"a", "b"}) == {}  # backing off: the next try after 1 s
    assert acks.got_ack("a", "J", True) is None
    assert acks.sends(1.0, {"a", "b"}) == {"b": [("J", ("a", "b", "me"))]}  # only the silent one
    outcome = acks.got_ack("b", "J", True)
    assert outcome is not None and outcome.deljob_to == ("a", "b") and acks.pending == {}


def test_acks_are_sent_when_due_whatever_else_waits_and_each_once():
    """sends() takes the due collections off a schedule (it walked every
    pending ACK ten times a second, and ACKs wait for a dead holder until
    their TTL): widened, brought forward by a holder back, or ended, a
    collection is still sent once when due, and never after it ended."""
    acks = AckCollector("me")
    for i in range(1000):  # waiting on a dead holder, backed off
        acks.add(f"old{i}", {"dead"}, now=0.0)
    assert len(acks.sends(0.0, {"a"})) == 0  # unreachable: nothing to send, each backs off
    acks.add("J", {"a"}, now=5.0)
    acks.add("J", {"a", "b"}, now=5.0)  # widened at once: still one send
    acks.add("K", {"a"}, now=5.0)
    assert acks.got_ack("a", "K", True) is not None  # ended before it was due
    assert acks.sends(5.0, {"a", "b"}) == {"a": [("J", ("a", "b", "me"))], "b": [("J", ("a", "b", "me"))]}
    assert acks.sends(5.5, {"a", "b", "dead"}) == {}  # J backs off 1 s, the old ones 2 s
    acks.peer_back("dead", now=5.5)  # the dead holder is back: its ACKs go now
    sent = acks.sends(5.5, {"a", "b", "dead"})
    assert sorted(sent) == ["dead"] and len(sent["dead"]) == 1000
    assert acks.sends(5.5, {"a", "b", "dead"}) == {}


def test_a_dummy_ack_ends_as_soon_as_a_holder_takes_it_over():
    acks = AckCollector("me")
    acks.add("J", None, 0.0, everyone={"a", "b"})
    assert acks.got_ack("a", "J", False) is None
    outcome = acks.got_ack("b", "J", True)
    assert outcome is not None and outcome.deljob_to == () and acks.pending == {}


def test_a_holder_drives_the_gc_for_holders_the_sender_did_not_know():
    # we hold J with holders a, b and c; the acking node 'a' knew only a and me
    decided = take_over("me", [("J", True, ["a", "b", "c", "me"])], {"J": {"a", "me"}}, {"J": {"a"}})
    assert decided.drive == {"J": {"a", "b", "c", "me"}} and decided.finished == []
    # a dummy ack (no holder named) reaching the only holder: complete
    decided = take_over("me", [("K", True, ["me"])], {"K": set()}, {"K": {"a"}})
    assert decided.drive == {} and decided.finished == ["K"]
    # not known here: nothing to do
    assert take_over("me", [("L", False, None)], {"L": set()}, {"L": {"a"}}).drive == {}


def test_the_senders_deljob_does_not_end_a_gc_taken_over():
    acks = AckCollector("me")
    acks.add("J", {"a", "b", "c"}, 0.0)  # taken over: 'a' acked knowing only itself and me
    assert acks.on_deljob("a", "J") is True  # b and c still to tell: keep the tombstone
    assert sorted(acks.sends(0.0, {"a", "b", "c"})) == ["b", "c"]
    acks.got_ack("b", "J", True)
    outcome = acks.got_ack("c", "J", False)
    assert outcome is not None and outcome.deljob_to == ("a", "b", "c")
    # a plain holder told to delete: nothing pending here, forget it
    assert acks.on_deljob("a", "K") is False
    acks.add("L", {"a"}, 0.0)  # only the sender left to confirm: done
    assert acks.on_deljob("a", "L") is False and acks.pending == {}


# ------------------------------------------------------------ replication

def test_replication_widens_and_reaches_its_copies():
    r = Replicator("me", random.Random(1))
    r.add(copy(), 2, sync=True, now=0.0, ttl_left=60)
    first = r.sends(0.0, ["a", "b", "c"])
    assert sum(len(v) for v in first.values()) == 2 and all(c.nodes for v in first.values() for c in v)
    targets = sorted(first)
    assert r.confirmed(targets[0], ["J"]) == []
    done = r.confirmed(targets[1], ["J"])
    assert [d.copy.id for d in done] == ["J"] and r.pending == {}


def test_a_job_that_ended_has_its_late_copies_deleted_unless_it_is_replicated_again():
    r = Replicator("me", random.Random(1))
    r.add(copy(), 2, sync=True, now=0.0, ttl_left=60)
    slow, quick = sorted(r.sends(0.0, ["a", "b"]))
    r.confirmed(quick, ["J"])
    r.forget("J", ended=True)  # acked while the REPLJOB to `slow` was on its way
    assert r.late_copies(slow, ["J"], 1.0) == ["J"] and r.late_copies(quick, ["J"], 1.0) == []
    assert r.late_copies(slow, ["J"], 61.0) == []  # past the job's TTL: forgotten
    # Withdrawn, then stored again under its ID (a retried add): the copies
    # of the new replication are no late copies (found by a review).
    r.add(copy(), 2, sync=True, now=100.0, ttl_left=60)
    r.sends(100.0, ["a", "b"])
    r.forget("J", ended=True)
    r.add(copy(), 2, sync=True, now=101.0, ttl_left=60)
    r.sends(101.0, ["a", "b"])
    assert r.late_copies("a", ["J"], 101.5) == [] and r.late_copies("b", ["J"], 101.5) == []


def test_resume_counts_the_copies_the_database_knows_and_names_them_in_new_ones():
    r = Replicator("me", random.Random(2))
    r.resume(copy(nodes=("me", "a")), "queued", ["me", "a"], None, 60, leaving=False, now=0.0)
    entry = r.pending["J"]
    assert entry.confirmed == {"a"} and entry.sent == {"a"} and entry.needed == 2
    sends = r.sends(0.0, ["a", "b"])
    assert list(sends) == ["b"] and set(sends["b"][0].nodes) == {"me", "a", "b"}
    # already fully replicated (an event drained after a restart): nothing kept
    r.resume(copy("K", nodes=("me", "a", "b")), "queued", ["me", "a", "b"], None, 60, False, 0.0)
    assert "K" not in r.pending


def test_a_leaving_origin_replicates_externally_and_hands_the_job_to_one_holder():
    r = Replicator("me", random.Random(3))
    r.resume(copy(repl=2), "wait-repl", [], None, 60, leaving=True, now=0.0)
    entry = r.pending["J"]
    assert entry.external and entry.needed == 2
    r.sends(0.0, ["a", "b"])
    r.confirmed("b", ["J"])
    done = r.confirmed("a", ["J"])
    assert done[0].heir() == "a" and "me" not in done[0].holders("me")


def test_a_defaulted_replicate_settles_after_the_grace_with_its_minimum():
    r = Replicator("me", random.Random(4))
    r.add(copy(), 2, sync=True, now=0.0, ttl_left=60, minimum=1)
    target = next(iter(r.sends(0.0, ["a", "b"])))
    r.confirmed(target, ["J"])
    assert r.settled(GRACE / 2) == []
    settled = r.settled(GRACE)
    assert [s.copy.id for s in settled] == ["J"] and "J" in r.pending  # async from now on


def test_re_sends_to_a_silent_target_back_off_and_a_step_looks_at_due_jobs_only():
    """A peer that refuses copies silently (its queue paused for input, no
    other node to widen to) had every pending job's body re-sent each
    second, and every step walked every pending job: 100,000 of them took
    2.5 s of CPU a second (found by a read-only review)."""
    r = Replicator("me", random.Random(5))
    r.add(copy(), 2, sync=False, now=0.0, ttl_left=600)
    assert sorted(r.sends(0.0, ["a", "b"])) == ["a", "b"]
    r.confirmed("a", ["J"])  # b stays silent
    resent, now = [], 0.0
    while now < 40.0:
        now = round(now + 0.025, 3)
        if "b" in r.sends(now, ["a", "b"]):
            resent.append(now)
    assert resent == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]  # was every second
    assert len(r._due) == 1  # one place in the heap, not one per step


def test_a_peer_that_comes_back_is_widened_to_at_once_and_re_sends_never_overflow():
    # Widening waited for the job's next re-send (up to a minute), and
    # 2.0 ** 1024 (17 h of re-sends) raised, dropping the job from the heap.
    r = Replicator("me", random.Random(7))
    r.add(copy(), 2, sync=True, now=0.0, ttl_left=86400 * 2)
    assert list(r.sends(0.0, ["a"])) == ["a"]  # b is down
    r.confirmed("a", ["J"])
    now = 0.0
    for _ in range(30):  # the re-sends back off to a minute apart
        now += 10.0
        r.sends(now, ["a"])
    assert "b" in r.sends(now + 0.025, ["a", "b"])  # b is back: widened to at once
    r.pending["J"].sent.discard("b")
    for _ in range(2000):  # 33 h with a silent target: no overflow, still pending
        now += 60.0
        r.sends(now, ["a"])
    assert "J" in r.pending and any(job_id == "J" for _, job_id in r._due)


def test_a_peer_back_gets_at_once_the_copy_it_never_confirmed():
    # Its REPLJOB lost while it was away: it was sent again only at the next
    # re-send of the back-off, up to a minute later.
    r = Replicator("me", random.Random(9))
    r.add(copy(), 2, sync=True, now=0.0, ttl_left=600)
    assert sorted(r.sends(0.0, ["a", "b"])) == ["a", "b"]
    r.confirmed("a", ["J"])
    now = 0.0
    while now < 33.0:  # b away from 2 s to 33 s
        now = round(now + 0.025, 3)
        r.sends(now, ["a", "b"] if now < 2.0 else ["a"])
    assert "b" in r.sends(now + 0.025, ["a", "b"])


def test_a_flapping_peer_re_heaps_only_jobs_that_may_widen_to_it():
    r = Replicator("me", random.Random(8))
    for i in range(2000):
        r.add(copy(f"J{i}"), 2, sync=False, now=0.0, ttl_left=600)
    r.sends(0.0, ["a", "b"])  # sent to both; b stays silent
    r.confirmed("a", [f"J{i}" for i in range(2000)])
    now = 0.0
    for _ in range(100):  # b suspect, then alive again, every second
        now += 0.5
        r.sends(now, ["a"])
        now += 0.5
        r.sends(now, ["a", "b"])
    assert len(r._due) <= 2 * len(r.pending) + 1024  # it grew by every job at every flap


def test_jobs_that_got_their_copies_leave_no_trace_behind():
    r = Replicator("me", random.Random(6))
    for i in range(5000):
        r.add(copy(f"J{i}"), 1, sync=True, now=0.0, ttl_left=86400)
    r.sends(0.0, ["a"])
    assert len(r.confirmed("a", [f"J{i}" for i in range(5000)])) == 5000
    assert r.expired(1.0) == [] and r.pending == {}
    assert len(r._expiry) <= 1024  # their expiries, a day out, were kept until then


# ------------------------------------------------------------ federation

def test_federation_backs_off_and_exports_at_most_half():
    f = Federation()
    assert f.needs("q", 0.0, ["a", "b"]) == [(["a", "b"], 1)]  # discovery broadcast
    assert f.needs("q", 1.0, ["a", "b"]) == []  # backing off
    f.imported("q", "a", 10, 1.5)
    asked = f.needs("q", 1.6, ["a", "b"])
    assert (["a"], 5) in asked or any(t == ["a"] for t, _ in asked)
    assert export_count(10, 100) == 10 and export_count(10, 6) == 3 and export_count(10, 0) == 0



def test_back_offs_keep_working_after_a_thousand_rounds():
    # 2 ** 1024 overflows a float: a queue empty for 8.5 hours (broadcasts
    # every 30 s) and an ACK collection waiting 51 hours on a dead holder
    # (a round a minute at most) raised OverflowError, which stopped the
    # node's federation loop and every later SETACK for good.
    f = Federation()
    for i in range(1100):
        f.needs("q", i * 31.0, ["a"])
    assert f.needs("q", 1100 * 31.0, ["a"]) == [(["a"], 1)]  # still broadcasting, every 30 s
    acks = AckCollector("me")
    acks.add("J", {"dead"}, now=0.0)
    for i in range(1100):
        acks.sends(i * 61.0, set())
    assert acks.sends(1100 * 61.0, {"dead"}) == {"dead": [("J", ("dead", "me"))]}


def test_federation_forgets_queues_no_one_waits_on():
    f = Federation()
    for i in range(1000):  # one reply queue per request
        f.needs(f"reply-{i}", 0.0, ["a"])
    f.imported("reply-7", "a", 1, 0.0)
    f.prune({"reply-1"}, 1.0)
    assert sorted(f.queues) == ["reply-1", "reply-7"]  # still waited on; importing
    f.prune(set(), 1.0 + 60)
    assert f.queues == {}

# ------------------------------------------------------------ network

def test_the_network_cuts_partitions_and_replays_its_fate_from_its_seed():
    def fates(seed: int) -> list[list[tuple[float, str]]]:
        net = Network(random.Random(seed), NetworkFaults(drop=0.3, duplicate=0.3, slow=0.3))
        net.register("a", "10.0.0.1", 1)
        net.register("b", "10.0.0.2", 1)
        return [net.route("a", "10.0.0.2", 1) for _ in range(50)]

    assert fates(5) == fates(5) and fates(5) != fates(6)
    outcomes = fates(5)
    assert any(o == [] for o in outcomes) and any(len(o) == 2 for o in outcomes)
    net = Network(random.Random(0))
    net.register("a", "10.0.0.1", 1)
    net.register("b", "10.0.0.2", 1)
    net.partition({"a"}, {"b"})
    assert net.route("a", "10.0.0.2", 1) == [] and not net.can_talk("b", "a")
    net.heal()
    assert [d for _, d in net.route("a", "10.0.0.2", 1)] == ["b"]
    assert net.route("a", "10.0.0.9", 1) == []  # nobody there
