"""The cluster's stories, proven in the simulation (pgq.cluster.scenario):
re-queue coordination, replication timeouts and late targets, copies a
client writes itself (direct copies), ACK garbage collection with holders
down, federation, and a node leaving.

Each story runs node cores on the suite's PostgreSQL server under a virtual
clock and waits for conditions in virtual time: no process, no socket, no
sleep, and the same run every time. The real-process tests keep the
wiring (tests/cluster/test_*.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from pgq.cluster import messages as m
from pgq.cluster import sql as node_sql
from pgq.cluster.mock_transport import NetworkFaults
from pgq.cluster.scenario import Scenario

from pgq import arguments, commands, contracts, protocol
from pgq import statements as client_sql
from pgq.errors import LeavingError, NoReplError, PausedError

pytestmark = pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1",
                                reason="the simulation needs the embedded server")


def cluster(sim_databases, nodes: int = 3, seed: int = 1, direct: bool = False) -> Scenario:
    return Scenario(sim_databases, nodes, seed, direct=direct)


def collected(s: Scenario, job: str):
    """The job and its ACKs collected: no copy and no tombstone anywhere but
    the one the node that made its ID keeps a minute for a client's retry
    (cluster.sql APPLY_DELJOB, RETRY_WINDOW), with no holders to collect from."""
    maker = next((name for name in s.names if s.node(name).node_id[:8] == job[2:10]), None)

    def done() -> bool:
        left = s.holders(job)
        if not left:
            return True
        if set(left) != {maker} or left[maker] != "acked":
            return False
        kept = s.sql(maker, "SELECT nodes IS NULL AND NOT dummy FROM pgq.acks WHERE id = %s", (job,))
        return bool(kept and kept[0][0])
    return done


def copies(s: Scenario, job: str) -> set[str]:
    """The nodes holding a copy of the job (not a tombstone)."""
    return {name for name, state in s.holders(job).items() if state != "acked"}


def params(**options):
    return arguments.job_params(**{"replicate": None, "delay": 0, "retry": None, "ttl": 600,
                                   "maxlen": None, "asynchronous": False, "timeout": None,
                                   **options})


def priority(s: Scenario, observer: str, target: str) -> int | None:
    """HELLO's priority of ``target`` as a client of ``observer`` reads it."""
    nodes = s.do(observer, commands.hello, "hello")["nodes"]
    return next((n["priority"] for n in nodes if n["id"] == s.node(target).node_id), None)


# ------------------------------------------------------------ re-queue

def test_an_unconsumed_job_stays_queued_on_one_node_only(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, retry=1)
    assert sorted(s.holders(job).values()) == ["active", "active", "queued"]
    # The other copies' timers fire after about retry seconds and announce
    # first (WILLQUEUE); the origin still has it queued, so they postpone.
    s.holds(lambda: s.queued_on(job) == ["n1"], 6.0, "one queued copy, on the origin")
    got = s.get("n1", withcounters=True)
    assert got[0].id == job and got[0].additional_deliveries == 0


def parked(s: Scenario, job: str, on: str) -> list[str]:
    """The nodes whose copy of the job is parked on node ``on`` (schema 0019)."""
    holder = s.node(on).node_id
    return sorted(name for name in s.names if name != on and s.sql(
        name, "SELECT 1 FROM pgq.jobs WHERE id = %s AND parked_on = %s AND state = 'active'",
        (job, holder)))


def parked_on_n1(s: Scenario, retry: float, **options) -> str:
    """A job added on n1 (three copies), once both other copies parked on n1
    (after their first WILLQUEUE, about one retry)."""
    job = s.add("n1", b"x", replicate=3, retry=retry, **options)
    s.until(lambda: parked(s, job, "n1") == ["n2", "n3"], retry + 3.0, "both copies parked on n1")
    return job


def requeued_elsewhere_after_n1_crashed(s: Scenario, job: str) -> None:
    """Crash n1 (its database keeps its queued copy, out of reach of
    consumers elsewhere): one other holder queues the job, a re-queue that
    counts an additional delivery."""
    s.crash("n1")
    queued = s.until(lambda: [n for n in s.queued_on(job) if n != "n1"], 5.0,
                     "another holder to queue the job")
    assert len(queued) == 1
    got = s.get(queued[0], withcounters=True)
    assert got[0].id == job and got[0].additional_deliveries == 1


def timer_in(s: Scenario, name: str, job: str) -> float:
    """Virtual seconds until the re-queue timer of node ``name``'s copy."""
    due = s.sql(name, "SELECT extract(epoch FROM cluster_requeue_at)::float8 FROM pgq.jobs "
                      "WHERE id = %s", (job,))[0][0]
    return due - s.node(name).clock.wall()


def test_a_holder_requeues_once_the_queueing_node_crashed(sim_databases):
    s = cluster(sim_databases)
    requeued_elsewhere_after_n1_crashed(s, s.add("n1", b"x", replicate=3, retry=1))


def test_copies_park_on_the_queueing_holder_and_its_watch_rewrites_none_of_them(sim_databases):
    """Disque's QUEUED postpones every other copy by one retry: with the
    holder's watch saying QUEUED at every retry, a row written on every
    holder for every queued job at every retry. A copy parked on the holder
    waits ten retries, and the watch leaves it alone for five."""
    s = cluster(sim_databases)
    job = parked_on_n1(s, retry=1)
    versions = {name: s.sql(name, "SELECT xmin::text FROM pgq.jobs WHERE id = %s", (job,))
                for name in ("n2", "n3")}
    # Three retries: n1's watch says QUEUED three times, and the copies stay
    # as they were (no row version), their timers still about ten retries out.
    s.holds(lambda: s.queued_on(job) == ["n1"], 3.0, "one queued copy, on n1")
    assert {name: s.sql(name, "SELECT xmin::text FROM pgq.jobs WHERE id = %s", (job,))
            for name in ("n2", "n3")} == versions
    due = [timer_in(s, name, job) for name in ("n2", "n3")]
    assert all(5 < d <= 10.5 for d in due), due


def test_copies_parked_on_a_holder_that_crashed_queue_the_job_a_retry_after_its_suspicion(
        sim_databases):
    """A parked copy waits ten retries; its holder turning suspect brings it
    back to one: the job is queued elsewhere about as soon as in Disque
    (suspicion in about 1.5 s, then the retry of 1 s and its announcement)."""
    s = cluster(sim_databases)
    requeued_elsewhere_after_n1_crashed(s, parked_on_n1(s, retry=1))


def test_a_parked_copy_fires_before_its_job_expires_when_its_holder_lost_it_unseen(
        sim_databases):
    """Ten retries of the default retry (a tenth of the TTL) is the whole
    TTL: a copy parked that long never fired (a timer past the expiry does
    not), and a job whose queued copy went away unseen (a DELJOB on that
    node alone, its database down under a running process) expired with
    two copies alive. A parked timer stays within half the TTL left."""
    s = cluster(sim_databases)
    job = parked_on_n1(s, retry=5, ttl=40)
    assert all(timer_in(s, name, job) < 20.6 for name in ("n2", "n3"))
    s.sql("n1", "DELETE FROM pgq.jobs WHERE id = %s", (job,))  # gone there, nobody told
    queued = s.until(lambda: [n for n in s.queued_on(job) if n != "n1"], 25.0,
                     "another holder to queue the job before it expires")
    assert len(queued) == 1 and s.get(queued[0])[0].id == job


def test_a_queued_from_a_holder_seen_dead_parks_nothing_for_long(sim_databases):
    """A QUEUED that waited in the inbox while its sender died parked the
    copy again after its UNPARK, and no later change of that member would
    bring it back."""
    s = cluster(sim_databases)
    job = parked_on_n1(s, retry=5)
    s.crash("n1")
    s.until(lambda: s.sees("n2", "n1") == "dead" and s.sees("n3", "n1") == "dead", 30.0,
            "n2 and n3 to see n1 dead")
    [winner] = s.until(lambda: [n for n in s.queued_on(job) if n != "n1"], 10.0,
                       "another holder to queue the job")
    other = "n3" if winner == "n2" else "n2"
    # n1's last QUEUED, applied late: the other copy parks on a node it sees dead
    core = s.node(other).core
    assert core is not None
    holders = ",".join(sorted(s.node(n).node_id for n in s.names))
    s.sim._node_step(s.node(other), core._on_queued(s.node("n1").node_id,
                                                    m.Queued((job,), "", (holders,))), "late")
    assert parked(s, job, "n1") == [other]
    # brought back at the next timers step (not parked at all: the winner's
    # watch parks it on the winner only at its next QUEUED, a retry later)
    s.until(lambda: s.sql(other, "SELECT parked_on IS NULL FROM pgq.jobs WHERE id = %s",
                          (job,))[0][0], 1.0, "the copy brought back at the next timers step")


def test_a_node_starting_brings_back_copies_parked_on_a_node_it_does_not_know_alive(
        sim_databases):
    s = cluster(sim_databases)
    job = parked_on_n1(s, retry=1)
    s.crash("n2")
    # As if the holder it is parked on had left the cluster, forgotten since.
    s.sql("n2", "UPDATE pgq.jobs SET parked_on = 'gone' WHERE id = %s", (job,))
    s.restart("n2")  # its start brings the copy back at once (before any step of it ran)
    assert s.sql("n2", "SELECT parked_on FROM pgq.jobs WHERE id = %s", (job,)) == [(None,)]
    assert timer_in(s, "n2", job) <= 1.5


def test_an_unacked_delivery_is_requeued_on_exactly_one_node(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n2", b"x", replicate=3, retry=1)
    assert s.get("n2")[0].id == job  # delivered, never acked
    s.until(lambda: s.queued_on(job), 5.0, "a re-queue after retry")
    s.holds(lambda: len(s.queued_on(job)) == 1, 4.0, "exactly one queued copy")


def test_two_holders_whose_timers_fire_together_agree_on_one(sim_databases):
    """The race Disque's WILLQUEUE exists for: both copies' timers fire in the
    same instant (their jitter made equal here); the tie-break by node ID
    leaves one queued copy."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, retry=1)
    s.get("n1")  # leased on n1: every copy's timer is armed
    for name in s.names:
        s.sql(name, "UPDATE pgq.jobs SET cluster_requeue_at = pgq.now() + interval '1 second', "
                    "requeue_at = NULL WHERE id = %s", (job,))
    s.until(lambda: s.queued_on(job), 4.0, "a re-queue")
    s.holds(lambda: len(s.queued_on(job)) == 1, 4.0, "one queued copy after the race")


@pytest.mark.parametrize("lower_first", [True, False])
def test_holders_whose_timers_are_closer_than_a_message_requeue_once(sim_databases, lower_first):
    """The queueing node crashed; the two other holders' timers come due
    30 ms apart while a message takes 200 ms: the later one cannot hear
    the first one's QUEUED in time. Their WILLQUEUEs, sent 0.5 s ahead,
    decide instead (the lower node id queues): one re-queue, counted once
    on every copy. Without it both queued the job and each copy counted
    two re-queues (the real-process test_requeue saw it under load)."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, retry=1)
    s.crash("n1")
    lower, higher = sorted(["n2", "n3"], key=lambda name: s.node(name).node_id)
    first, second = (lower, higher) if lower_first else (higher, lower)
    for name, after in ((first, 1.0), (second, 1.03)):
        s.sql(name, "UPDATE pgq.jobs SET cluster_requeue_at = to_timestamp(%s) WHERE id = %s",
              (s.node(name).clock.wall() + after, job))
    s.degrade(NetworkFaults(delay=(0.2, 0.2)))
    s.until(lambda: [n for n in s.queued_on(job) if n != "n1"], 3.0, "a re-queue")
    s.holds(lambda: [n for n in s.queued_on(job) if n != "n1"] == [lower], 2.0,
            "the lower node id alone re-queued the job")
    assert s.counters(job)[lower] == s.counters(job)[higher] == (0, 1)


def test_an_at_most_once_job_is_never_requeued(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", retry=0)
    assert s.get("n1")[0].id == job
    s.holds(lambda: s.holders(job) == {"n1": "active"}, 5.0, "the one copy stays delivered")
    assert s.get("n1") == []


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_delayed_job_is_served_by_one_node_once_its_delay_ends(sim_databases, asynchronous):
    """The origin's copy of a delayed job stays 'active' past its delay (a
    claim takes it then). It read as active to the other holders' timers,
    which queued the job too: two nodes served it, with no fault at all,
    and every copy counted an additional delivery (a read-only review
    found it in the simulation)."""
    s = cluster(sim_databases)
    job = s.do("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"x"], params(replicate=3, delay=2, retry=3, asynchronous=asynchronous)),
        "delayed add")[0]
    s.until(lambda: len(s.holders(job)) == 3, 5.0, "three copies")
    s.run_for(6.0)  # past the delay and the other copies' first timers (delay + retry)
    served = [name for name in s.names if [j.id for j in s.get(name)] == [job]]
    assert len(served) == 1, served
    assert set(s.counters(job).values()) <= {(0, 0)}


@pytest.mark.parametrize(("asynchronous", "direct"), [(False, False), (True, False), (False, True)],
                         ids=["sync", "async", "direct copies"])
def test_a_delayed_job_reaches_a_consumer_on_another_node(sim_databases, asynchronous, direct):
    """Once its delay ended, the origin's copy stayed 'active': only a GET
    on the origin could take it (no export, no counter), and the other
    holders, told it was queued there, parked on it for its whole TTL (a
    review of this stop's first fix found it). Its timer now queues it at
    the delay's end."""
    s = cluster(sim_databases, direct=direct)
    blocked = s.start("n2", lambda ses: commands.get_jobs(ses, ["q"], 1, 60.0, False, False),
                      "a blocked get on n2", listen=True)
    job = s.do("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"x"], params(replicate=3, delay=2, retry=3, asynchronous=asynchronous)),
        "delayed add on n1")[0]
    s.until(lambda: blocked.done, 10.0, "the job on n2")
    assert [j.id for j in blocked.value] == [job]
    assert set(s.counters(job).values()) <= {(0, 0)}


def test_a_delayed_job_replicated_after_its_delay_reaches_another_node(sim_databases):
    """An asynchronous delayed add whose origin crashed before it replicated
    had its holders recorded after its delay ended: no timer then, and the
    job was served only by a GET on the origin (a review of this stop's
    mends found it)."""
    s = cluster(sim_databases)
    blocked = s.start("n2", lambda ses: commands.get_jobs(ses, ["q"], 1, 120.0, False, False),
                      "a blocked get on n2", listen=True)
    add = s.start("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"x"], params(replicate=3, delay=1, retry=3, asynchronous=True)), "delayed add")

    def added_then_crashed() -> bool:
        if add.done:
            s.crash("n1")
        return add.done
    s.until(added_then_crashed, 10.0, "the add", every=0)
    s.run_for(3.0)  # the delay ends while n1 is down
    s.restart("n1")
    s.until(lambda: blocked.done, 30.0, "the job on n2")
    assert [j.id for j in blocked.value] == add.value


def test_a_delay_that_ended_while_its_origin_was_down_is_requeued_as_any_copy(sim_databases):
    """The origin crashed during the delay; another holder's timer queued the
    job and a consumer took it. Back, the origin's copy was claimable at
    once, and its delay timer (counting nothing) re-queued the job without
    counting that delivery. Now the copy waits for the WILLQUEUE round, and
    a re-queue counts."""
    s = cluster(sim_databases)
    job = s.do("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"x"], params(replicate=3, delay=3, retry=5)), "delayed add")[0]
    s.run_for(1.0)
    s.crash("n1")
    first = s.until(lambda: s.queued_on(job), 30.0, "a holder to queue the job")[0]
    assert [j.id for j in s.get(first)] == [job]  # a consumer holds it (a 5 s lease)
    s.run_for(0.5)
    s.restart("n1")
    assert s.get("n1") == []  # not at once
    # n1 missed the QUEUED that counted the first delivery; it re-queues the
    # job (its consumer may be gone) and counts that one at least
    s.until(lambda: "n1" in s.queued_on(job), 15.0, "n1 to re-queue the job")
    assert s.counters(job)["n1"][1] >= 1


def test_a_nacks_back_off_holds_on_every_holder(sim_databases):
    """A NACK with a back-off longer than ten retries: the other holders'
    copies parked for ten retries at most, then their timers found the
    nacking node's copy 'active' and queued the job long before the back-off
    ended (found by a read-only review)."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, retry=1)
    assert [j.id for j in s.get("n1")] == [job]
    began = s.now
    assert s.do("n1", lambda ses: commands.nack_jobs(ses, [job], delay=30.0), "nack, 30 s") == 1
    s.holds(lambda: s.queued_on(job) == [], 28.0, "no copy queued during the back-off")
    again = s.until(lambda: next((n for n in s.names if s.get(n)), None), 10.0, "delivered again")
    assert s.now - began >= 29.0 and again
    assert set(s.counters(job).values()) == {(1, 0)}


def test_working_keeps_every_copy_unqueued(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, retry=2)
    s.get("n1")
    for _ in range(4):  # 4 s > 2 * retry: without WORKING a copy would be queued
        assert s.working("n1", job) == 2
        s.holds(lambda: s.queued_on(job) == [], 1.0, "no copy queued while working")


def test_nacks_and_additional_deliveries_count_on_every_copy(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, retry=1)
    for _ in range(2):
        s.get("n1")
        assert s.nack("n1", job) == 1
    s.until(lambda: set(s.counters(job).values()) == {(2, 0)}, 2.0, "two nacks on every copy")
    s.get("n1")  # delivered, not acked: re-queued after retry, counted everywhere
    s.until(lambda: set(s.counters(job).values()) == {(2, 1)} and len(s.counters(job)) == 3,
            5.0, "the additional delivery on every copy")


def test_a_ttl_expires_every_copy(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, ttl=2)
    assert len(s.holders(job)) == 3
    s.run_for(2.2)
    for name in s.names:
        s.do(name, commands.sweep, "sweep")  # what a client's housekeeping runs
    assert s.holders(job) == {}
    assert s.do("n1", lambda ses: commands.show(ses, job), "show") is None


# ------------------------------------------------------------ replication

def test_w_copies_go_to_nodes_that_answer_when_two_died_undetected(sim_databases):
    s = cluster(sim_databases, nodes=5)
    s.crash("n4")
    s.crash("n5")  # still alive in everyone's view for a while
    assert s.sees("n1", "n4") == "alive"
    started = s.now
    jobs = [s.add("n1", b"%d" % i, replicate=3, timeout=5) for i in range(5)]
    assert s.now - started < 5
    for job in jobs:
        holders = s.holders(job)
        assert len(holders) == 3 and not {"n4", "n5"} & set(holders), holders


def test_a_replication_timeout_withdraws_the_job_and_its_partial_copies(sim_databases):
    s = cluster(sim_databases)
    s.crash("n2")
    s.crash("n3")
    with pytest.raises(NoReplError) as info:
        s.add("n1", b"x", replicate=3, timeout=0.5)
    job = info.value.removed[0]
    assert s.holders(job) == {}
    s.restart("n2")
    s.restart("n3")
    s.until(s.meshed, 10.0, "the nodes back")
    s.holds(lambda: s.holders(job) == {}, 2.0, "no copy of the withdrawn job anywhere")


def test_replication_completes_when_a_dead_target_comes_back(sim_databases):
    s = cluster(sim_databases, nodes=3)
    s.crash("n2")
    s.crash("n3")  # not yet suspected: the add waits for copies
    two = params(replicate=2, timeout=20)
    call = s.start("n1", lambda ses: commands.add_jobs(ses, "q", [b"x"], two), "add W=2")
    s.run_for(2.0)
    assert not call.done  # nobody can take a copy yet
    started = s.now
    s.restart("n2")
    s.until(lambda: call.done, 15.0, "the add to return once n2 is back")
    assert call.error is None and s.now - started < 15
    assert copies(s, call.value[0]) == {"n1", "n2"}


def test_a_keyed_add_answers_the_keys_job_only_once_it_has_its_copies(sim_databases):
    # A synchronous add with a key finds the key's job still waiting for
    # its copies (another add's): it must not answer that ID before the
    # copies exist, and when that job is withdrawn the key is free again.
    s = cluster(sim_databases, nodes=3)
    s.crash("n2")
    s.crash("n3")  # not yet suspected: adds wait for their copies
    keyed = params(replicate=2, timeout=20, key="order-1")
    first = s.start("n1", lambda ses: commands.add_jobs(ses, "q", [b"a"], keyed), "first keyed add")
    s.run_for(1.0)
    again = s.start("n1", lambda ses: commands.add_jobs(ses, "q", [b"b"], keyed), "same key")
    s.run_for(2.0)
    assert not first.done and not again.done  # the second waits for the first's copies
    s.restart("n2")
    s.until(lambda: first.done and again.done, 15.0, "both adds to return")
    assert first.error is None and again.error is None and again.value == first.value
    assert copies(s, first.value[0]) == {"n1", "n2"}

    s.crash("n2")  # undetected again: the next keyed add is withdrawn after its timeout
    doomed = s.start("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"c"], params(replicate=2, timeout=2, key="order-2")), "an add that fails")
    s.run_for(0.5)
    waiting = s.start("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"d"], params(replicate=2, timeout=30, key="order-2")), "same key, patient")
    s.until(lambda: doomed.done, 10.0, "the first add to give up")
    assert isinstance(doomed.error, NoReplError)
    s.restart("n2")
    s.until(lambda: waiting.done, 30.0, "the patient add to add its own job")
    assert waiting.error is None and waiting.value[0] not in doomed.error.removed
    assert copies(s, waiting.value[0]) == {"n1", "n2"}

    # An asynchronous add with the key waits for that replication too: it
    # answered the synchronous add's ID at once, and the job was withdrawn
    # when that add failed (the work lost; found by a read-only review).
    s.crash("n2")
    doomed = s.start("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"e"], params(replicate=2, timeout=2, key="order-3")), "another that fails")
    s.run_for(0.5)
    hasty = s.start("n1", lambda ses: commands.add_jobs(
        ses, "q", [b"f"], params(replicate=2, asynchronous=True, key="order-3")), "same key, async")
    s.until(lambda: doomed.done and hasty.done, 10.0, "both adds to return")
    assert isinstance(doomed.error, NoReplError) and hasty.error is None
    assert hasty.value[0] not in doomed.error.removed and "n1" in copies(s, hasty.value[0])


def batch(s: Scenario, which: str, calls: list[commands.AddCall]):
    """Start the group-commit batch of synchronous replicated adds."""
    return s.start(which, lambda ses: commands.add_replicated_batch(ses, calls), "a batch")


def test_a_replicated_batch_answers_each_call_once_its_jobs_have_their_copies(sim_databases):
    s = cluster(sim_databases, nodes=3)
    s.do("n1", lambda ses: commands.pause(ses, "closed", ["in"]), "pause closed")
    calls = [commands.AddCall("q", [b"a"], params()),
             commands.AddCall("q", [b"b", b"c"], params(replicate=2)),
             commands.AddCall("closed", [b"d"], params()),
             commands.AddCall("q", [b"e"], params(replicate=1)),  # kept here only: not this batch
             commands.AddCall("q", [b"f"], params(timeout=9)),  # another timeout: alone
             commands.AddCall("q", [b"g"], params(timeout=5))]  # the client's: batched
    call = batch(s, "n1", calls)
    s.until(lambda: call.done, 10.0, "the batch")
    first, second, paused, single, own, same = call.value
    assert isinstance(paused, PausedError)
    assert single is commands.REROUTE and own is commands.REROUTE and len(same) == 1
    assert [copies(s, job) for job in first] == [{"n1", "n2", "n3"}]
    assert [len(copies(s, job)) for job in second] == [2, 2]
    assert {s.holders(job)["n1"] for job in first + second} == {"queued"}
    assert {job.id for job in s.get("n1", count=10)} == set(first + second + same)  # on n1 once


def test_a_replicated_batch_that_misses_its_copies_withdraws_each_calls_jobs(sim_databases):
    s = cluster(sim_databases, nodes=3)
    s.crash("n3")  # not yet suspected: W=3 waits for it
    calls = [commands.AddCall("q", [b"a"], params(replicate=3)),
             commands.AddCall("q", [b"b", b"c"], params(replicate=2)),
             commands.AddCall("q", [b"d"], params(replicate=3))]
    call = batch(s, "n1", calls)
    s.until(lambda: call.done, 10.0, "the batch to give up after the replication timeout")
    first, second, third = call.value
    assert isinstance(first, NoReplError) and isinstance(third, NoReplError)
    assert len(first.removed) == 1 and first.added == ()
    assert len(second) == 2 and all(copies(s, job) == {"n1", "n2"} for job in second)
    s.restart("n3")
    s.until(s.meshed, 10.0, "n3 back")
    withdrawn = first.removed + third.removed
    s.holds(lambda: all(s.holders(job) == {} for job in withdrawn), 2.0,
            "no copy of a withdrawn job anywhere")


def test_a_batch_queues_asynchronous_replicated_adds_at_once_and_copies_them(sim_databases):
    s = cluster(sim_databases, nodes=3)
    calls = [commands.AddCall("q", [b"a", b"b"], params(asynchronous=True)),
             commands.AddCall("q", [b"c"], params(replicate=1)),
             commands.AddCall("q", [b"d"], params(replicate=3))]  # synchronous: not this batch
    copied, here, synchronous = s.do("n1", lambda ses: commands.add_batch(ses, calls), "a batch")
    assert synchronous is commands.REROUTE
    assert {s.holders(job)["n1"] for job in copied + here} == {"queued"}  # at once
    s.until(lambda: all(copies(s, job) == {"n1", "n2", "n3"} for job in copied), 5.0,
            "the copies made in the background")
    assert copies(s, here[0]) == {"n1"}
    assert {job.id for job in s.get("n1", count=10)} == set(copied + here)


def test_norepl_follows_what_the_node_sees(sim_databases):
    s = cluster(sim_databases, nodes=3)
    s.crash("n2")
    s.crash("n3")
    s.until(lambda: s.sees("n1", "n2") == "dead" and s.sees("n1", "n3") == "dead", 40.0,
            "n2 and n3 declared dead")
    s.run_for(1.1)  # the client's view of the cluster is cached for a second
    with pytest.raises(NoReplError):
        s.add("n1", b"x", replicate=2)
    job = s.add("n1", b"x")  # the default W follows the reachable nodes: 1
    assert s.holders(job) == {"n1": "queued"}


# ------------------------------------------------------------ direct copies

def messages_sent(s: Scenario, kind: str) -> int:
    return s.sim.sent[kind]


def test_a_direct_add_is_confirmed_by_w_databases_without_the_node_processes(sim_databases):
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "n1's clients to know both peers' databases (ADVERT)")
    job = s.add("n1", b"x", replicate=3)
    # Confirmed when add_jobs returned: every copy committed, no REPLJOB sent.
    assert s.holders(job) == {"n1": "queued", "n2": "active", "n3": "active"}
    assert messages_sent(s, "repljob") == 0
    assert s.sql("n1", "SELECT count(*) FROM pgq.outbox") == [(0,)]
    rows = s.sql("n2", "SELECT nodes_delivered, nodes_confirmed FROM pgq.jobs WHERE id = %s",
                 (job,))
    assert sorted(rows[0][0]) == sorted(n.node_id for n in s.sim.nodes)
    assert rows[0][1] == [s.node("n2").node_id]
    # The copies behave as any others: the origin keeps it queued, the ACK
    # reaches every holder.
    s.holds(lambda: s.queued_on(job) == ["n1"], 4.0, "one queued copy, on the origin")
    assert s.get("n1")[0].id == job and s.ack("n1", job) == 1
    s.until(collected(s, job), 3.0, "the job and its ACKs collected")


def test_a_direct_add_goes_through_the_node_when_a_peer_database_is_unreachable(sim_databases):
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    s.partition("n3")  # n1's clients cannot reach n3's database (nor n1 its bus)
    job = s.add("n1", b"x")  # default W=3, soft: 2 copies suffice after the grace
    assert copies(s, job) == {"n1", "n2"}
    assert s.node("n3").node_id in s.node("n1").cluster_view.failing  # left out a while
    assert messages_sent(s, "repljob") >= 1  # the node process made the copies
    s.heal()
    s.until(lambda: copies(s, job) == {"n1", "n2", "n3"}, 10.0, "the third copy, once healed")
    assert s.queued_on(job) == ["n1"]


def test_a_peer_refusing_a_direct_copy_keeps_none_of_it(sim_databases):
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    s.do("n2", lambda ses: commands.pause(ses, "q", ["in"]), "pause q on n2 only")
    job = s.add("n1", b"x")  # default W=3: both peers drawn; soft: 2 copies suffice
    # n2 refused its copy: the n3 copy written beside it was withdrawn, and
    # the node process copied the job where it was accepted.
    assert s.node("n2").node_id in s.node("n1").cluster_view.failing
    assert messages_sent(s, "repljob") >= 1
    assert copies(s, job) == {"n1", "n3"}
    s.holds(lambda: copies(s, job) == {"n1", "n3"}, 3.0, "no copy on the paused n2")


def test_a_direct_add_run_again_over_a_row_its_first_attempt_left_is_not_confirmed_without_copies(
        sim_databases):
    """A replicated add's first attempt went through the node process: its
    row committed, waiting for copies, and its connection broke. The client
    runs it again with the same IDs, and this time writes the copies itself:
    the insert takes nothing (the row exists), so no copy was written, and
    the add was confirmed with its one copy. A row that exists goes through
    the node process now, which knows whether it was replicated (found by a
    read-only review)."""
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    s.crash("n1")  # its node process makes no copy: the first attempt's row waits
    call = commands.AddCall("q", [b"x"], params(replicate=3, timeout=2))

    def first_attempt(session):  # through the node process, until it waits for copies
        attempt = commands.add_replicated_batch(dataclasses.replace(session, direct=False), [call])
        request = next(attempt)
        while not isinstance(request, protocol.Wait):
            request = attempt.send((yield request))
        attempt.close()  # the connection broke here

    s.do("n1", first_attempt, "the first attempt")
    [job] = next(iter(call.ids.values()))
    assert s.holders(job) == {"n1": "wait-repl"}
    # Run again, the batch leaves the call to its own way (as a client does
    # on REROUTE), which finds the row and waits on its state.
    assert s.do("n1", lambda session: commands.add_replicated_batch(session, [call]),
                "the batch run again") == [commands.REROUTE]

    try:
        outcome = s.do("n1", lambda session: commands.add_jobs(
            session, call.queue, call.bodies, call.params, call.ids), "the add run again")
    except NoReplError as exc:
        outcome = exc
    if isinstance(outcome, list):  # confirmed: then W databases hold it
        assert copies(s, job) == {"n1", "n2", "n3"}
    else:
        assert isinstance(outcome, NoReplError) and s.holders(job) == {}


def test_an_add_whose_direct_copies_were_withdrawn_goes_through_the_node_under_new_ids(
        sim_databases):
    """The withdrawal of a failed direct attempt may reach a slow peer late,
    after that peer's node process stored the node's copy of the same add:
    under the same ID it deleted a copy the add was confirmed with (found by
    a read-only review). The node's way stores the jobs under new IDs."""
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    s.partition("n3")  # the direct attempt fails there
    class Memo(dict):  # the call's IDs, and the first ones it was given
        def __setitem__(self, node, ids):
            super().__setitem__(node, ids)
            self.first = list(ids)

    call = commands.AddCall("q", [b"x"], params(), Memo())  # W=3, 2 suffice after the grace
    [outcome] = s.do("n1", lambda session: commands.add_replicated_batch(session, [call]),
                     "the add")
    [job] = outcome
    [first] = call.ids.first
    assert job != first and copies(s, first) == set()
    assert copies(s, job) == {"n1", "n2"} and next(iter(call.ids.values())) == [job]
    # A copy under the old ID that the withdrawal missed (its peer committed
    # it late) lists n1 among its holders: n1 keeps a tombstone of the
    # withdrawn ID, so the copy's WILLQUEUE is answered SETACK instead of
    # queuing the job a second time, under an ID no ACK of the new one reaches.
    wall = s.node("n2").clock.wall()
    s.sql("n2", "CREATE TEMP TABLE late AS SELECT * FROM pgq.jobs WHERE id = %s", (job,))
    s.sql("n2", "UPDATE late SET id = %s, cluster_requeue_at = to_timestamp(%s)", (first, wall + 1.0))
    s.sql("n2", "INSERT INTO pgq.jobs SELECT * FROM late")
    s.until(lambda: s.holders(first).get("n2") != "active", 5.0, "the late copy's timer")
    assert s.holders(first).get("n2") in (None, "acked")  # told SETACK, not queued


def test_replication_progress_keeps_a_holder_that_imported_the_job_meanwhile(sim_databases):
    """An asynchronous add is queued while it replicates, so another node
    may import it (NEEDJOBS: EXPORT_JOBS lists the importer as a holder).
    The progress of the replication overwrote the holders and dropped the
    importer: an ACK here never reached its copy (found by a read-only
    review). The holders only widen."""
    from pgq.cluster import sql as node_sql

    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=2, asynchronous=True)
    importer = "f" * 40
    s.sql("n1", "UPDATE pgq.jobs SET nodes_delivered = nodes_delivered || %s::text WHERE id = %s",
          (importer, job))
    origin, peer = s.node("n1").node_id, s.node("n2").node_id
    s.sql("n1", node_sql.REPLICATION_PROGRESS,
          {"ids": [job], "delivered": [f"{origin},{peer}"], "confirmed": [f"{origin},{peer}"]})
    [(holders,)] = s.sql("n1", "SELECT nodes_delivered FROM pgq.jobs WHERE id = %s", (job,))
    assert importer in holders and {origin, peer} <= set(holders)


def test_a_copy_committed_too_late_for_its_client_is_withdrawn(sim_databases):
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    s.crash("n1")  # its node process cannot make the copies either: the add fails
    s.sim.late_answers = 1.0  # every peer write commits, and answers too late
    with pytest.raises(NoReplError):
        s.add("n1", b"late", replicate=3)
    # Withdrawn from both peers although neither answered in time.
    assert [s.sql(n, "SELECT count(*) FROM pgq.jobs") for n in ("n1", "n2", "n3")] == [[(0,)]] * 3


def test_a_direct_add_arms_its_queued_copy_at_once(sim_databases):
    """The origin's queued copy keeps watch from the start (schema 0009): no
    TIMERS statement locks it later to arm it, which made claims skip it."""
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    job = s.add("n1", b"x", replicate=3, retry=5)
    armed = s.sql("n1", "SELECT extract(epoch FROM cluster_requeue_at - pgq.now()) "
                        "FROM pgq.jobs WHERE id = %s AND state = 'queued'", (job,))
    assert armed and 5.0 <= float(armed[0][0]) <= 5.5


def test_a_client_that_dies_after_its_copies_leaves_a_job_delivered_like_any_other(sim_databases):
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    s.sim.kill_direct_clients = 1
    call = s.start("n1", lambda ses: commands.add_jobs(ses, "q", [b"orphan"],
                                                       params(replicate=3, retry=1)), "an add")
    s.until(lambda: call.done, 5.0, "the client to die")
    assert call.error is not None  # never confirmed to its caller
    orphans = {job_id for (job_id,) in s.sql("n2", "SELECT id FROM pgq.jobs")}
    assert len(orphans) == 1 and s.sql("n1", "SELECT count(*) FROM pgq.jobs") == [(0,)]
    job = orphans.pop()
    assert copies(s, job) == {"n2", "n3"}
    # Its holders re-queue it after its retry, once (the origin, which
    # never committed it, answers nothing), and it is consumed like any job.
    s.until(lambda: len(s.queued_on(job)) == 1, 10.0, "the job re-queued by a holder")
    s.holds(lambda: len(s.queued_on(job)) == 1, 4.0, "one queued copy")
    where = s.queued_on(job)[0]
    assert [j.id for j in s.get(where)] == [job] and s.ack(where, job) == 1
    s.until(collected(s, job), 5.0, "the job and its ACKs collected")


# ------------------------------------------------------------ ACKs

def test_an_ack_reaches_every_holder_and_is_collected(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3)
    assert s.get("n1")[0].id == job and s.ack("n1", job) == 1
    s.until(collected(s, job), 3.0, "the job and its ACKs collected")


def test_an_async_job_acked_before_all_its_copies_is_collected_on_every_holder(sim_databases):
    """An asynchronous add is queued at once and copied in the background:
    acked while one target stays silent, its copies elsewhere must learn of
    the ACK. The origin named its holders only once every copy was
    confirmed, so this ACK deleted the job without a SETACK, and the
    confirmed copy's re-queue timer delivered it again."""
    s = cluster(sim_databases)
    s.crash("n3")  # a target that does not answer (not declared dead yet)
    job = s.add("n1", b"x", replicate=3, retry=1, asynchronous=True)
    s.until(lambda: "n2" in s.holders(job), 3.0, "n2's copy")
    assert s.get("n1")[0].id == job and s.ack("n1", job) == 1
    # retry=1: without a SETACK n2 queued its copy within about a second
    s.until(lambda: copies(s, job) == set(), 3.0, "n2's copy dropped")
    s.holds(lambda: not s.queued_on(job), 3.0, "the job never queued again")
    s.restart("n3")
    s.until(collected(s, job), 30.0, "the ACK collected once n3 is back")


def test_a_holder_that_missed_the_ack_is_told_when_it_announces_the_job(sim_databases):
    """A holder cut off while the job was acked queues its copy (its timer)
    and announces it (QUEUED) when it is back: the acking node answers with
    SETACK at once. It ignored the announcement, and the holder kept the
    job queued until the acker's SETACK retry, backed off to half a minute."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=2, retry=1)
    holder = next(n for n in s.holders(job) if n != "n1")
    s.partition(holder)
    assert s.get("n1")[0].id == job and s.ack("n1", job) == 1
    gc = s.node("n1").core.acks.pending  # the acker's SETACK retries back off: 1, 2, 4 s...

    def queued_and_next_retry_far() -> bool:
        return s.queued_on(job) == [holder] and gc[job].next_try - s.now >= 3.5

    # healed just after a retry failed (a partition shorter than a death)
    s.until(queued_and_next_retry_far, 10.0, "the holder to queue it, the acker to back off")
    s.heal()
    s.until(lambda: copies(s, job) == set(), 2.0, "the copy dropped on its announcement, "
            "before the acker's next retry")


def test_an_ack_collection_ends_with_its_tombstone(sim_databases):
    """A holder that never answers (down for good, or forgotten since) kept
    the acking node's collection in memory for the life of its process; it
    ends once the tombstone is gone (the sweep drops it at the job's TTL)."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3)
    s.crash("n3")
    assert s.ack("n1", job) == 1
    gc = s.node("n1").core.acks.pending
    s.until(lambda: s.holders(job).get("n2") != "active" and job in gc, 3.0, "n2 told, n3 awaited")
    s.sql("n1", "DELETE FROM pgq.acks WHERE id = %s", (job,))  # what the sweep does at the TTL
    s.until(lambda: job not in gc, 70.0, "the collection to end")


def test_an_ack_on_a_node_that_never_held_the_job(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=2)
    outsider = next(n for n in s.names if n not in s.holders(job))
    assert s.ack(outsider, job) == 0  # unknown there: a dummy ack, asked of everyone
    s.until(collected(s, job), 3.0, "the job acked everywhere")


def test_an_ack_kept_for_a_crashed_holder_reaches_it_when_it_returns(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3)
    s.crash("n1")
    assert s.ack("n2", job) == 1
    s.until(lambda: copies(s, job) == {"n1"}, 5.0, "the live copies gone")
    assert s.holders(job)["n1"] == "queued"  # the crashed origin still has it...
    s.run_for(5.0)
    assert copies(s, job) == {"n1"}  # ...and keeps it while it is down (the others
    assert s.holders(job)["n1"] == "queued"  # keep their tombstones for it)
    s.restart("n1")  # ...until it comes back: the ACK was kept for it
    s.until(collected(s, job), 15.0, "the origin to learn the ACK")


@pytest.mark.parametrize("declared_dead", [False, True])
def test_a_dummy_ack_with_every_holder_down_is_collected_when_they_return(sim_databases,
                                                                          declared_dead):
    """Failure detection must not decide a job's safety: a dummy ack made
    once the holders were declared dead asked only the live nodes,
    completed on their 'unknown', and the holders served the job on their
    return."""
    s = cluster(sim_databases, nodes=4)
    job = s.add("n1", b"x", replicate=2)
    holders = sorted(s.holders(job))
    acker = next(n for n in s.names if n not in holders)
    for name in holders:
        s.crash(name)
    if declared_dead:
        s.until(lambda: all(s.sees(acker, h) == "dead" for h in holders), 30.0,
                "the holders declared dead")
    assert s.ack(acker, job) == 0  # nobody alive knows it: a dummy ack
    s.run_for(3.0)
    for name in holders:
        s.restart(name)
    s.until(collected(s, job), 60.0, "no copy or ACK anywhere")


def test_an_acking_node_that_crashes_resumes_its_gc_from_its_database(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3)
    s.crash("n3")  # a holder that cannot confirm yet
    assert s.ack("n1", job) == 1
    s.until(lambda: s.holders(job).get("n2") == "acked", 3.0, "n2 to get the SETACK")
    s.crash("n1")  # the acker goes before n3 confirmed
    s.restart("n3")
    s.holds(lambda: copies(s, job) == {"n3"}, 5.0, "n3's copy waits for the acker")
    s.restart("n1")  # reloads the pending GC from its database
    s.until(collected(s, job), 20.0, "every trace gone once n1 is back")


def test_a_setack_applied_again_after_a_crash_still_names_the_holders_only_this_node_knew(
        sim_databases):
    """APPLY_SETACK deleted the copy, which named the holders, and committed;
    TRACK_ACK_GC wrote the ones this node must tell in a second statement. A
    crash between the two (the simulation crashes between steps only: here
    the first statement runs alone, as that crash leaves it) and the SETACK
    sent again found a tombstone naming none: those holders never heard of
    the ACK (found by a read-only review)."""
    from pgq.cluster import sql as cluster_sql

    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3)
    s.until(lambda: len(copies(s, job)) == 3, 3.0, "three copies")
    s.crash("n2")  # its core stays out of the way: the statements below are the crashed step's
    n1, n2, n3 = (s.node(n).node_id for n in ("n1", "n2", "n3"))
    setack = {"ids": [job], "nodes": [n1], "askers": [n1], "myself": n2}  # n1 knew of n3 no more
    first = s.sql("n2", cluster_sql.APPLY_SETACK, setack)
    assert n3 in first[0][2]
    again = s.sql("n2", cluster_sql.APPLY_SETACK, setack)  # sent again: the crash lost GOTACK
    assert again[0][1] and n3 in again[0][2], again


def test_an_ack_reaches_a_holder_that_imported_the_job(sim_databases):
    """A holder learnt of late (a federation import) is told of the ACK:
    by the announcements' holder lists, or by a holder that knows more
    holders than the acking node and takes the GC over for them."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=2, retry=30)
    other, importer = sorted(set(s.names) - {"n1"}, key=lambda n: n in s.holders(job))[::-1]
    assert set(s.holders(job)) == {"n1", other}
    got = s.get(importer, timeout=5)  # blocked there: imported from n1
    assert [j.id for j in got] == [job] and importer in s.holders(job)
    assert s.ack(other, job) == 1  # on the holder that did not export it
    s.until(collected(s, job), 10.0, "every copy and tombstone gone")


@pytest.mark.parametrize("how", ["fastack elsewhere", "ack here"])
def test_a_copy_that_lands_after_its_job_was_acked_is_deleted(sim_databases, how):
    """An ACK or FASTACK made the origin forget a replication whose REPLJOBs
    were still on their way: they landed later, the copies were stored
    (nothing there knew of the ACK) and, once the origin's tombstone was
    swept (60 s), queued the job again at their retry, with every node
    reachable (found by a read-only review). The origin now answers a late
    copy's GOTJOB, or its WILLQUEUE, with DELJOB."""
    s = cluster(sim_databases)
    s.degrade(NetworkFaults(slow=1.0, slow_delay=(3.0, 3.0)))  # the REPLJOBs take 3 s
    job = s.add("n1", b"x", replicate=3, retry=120, asynchronous=True)
    replicator = s.node("n1").core.replicator
    s.until(lambda: job in replicator.pending and len(replicator.pending[job].sent) == 2, 2.0,
            "the REPLJOBs sent")
    s.degrade(NetworkFaults())
    assert [j.id for j in s.get("n1")] == [job]
    if how == "ack here":
        assert s.ack("n1", job) == 1
    else:
        assert s.fast_ack("n2", job) == 0  # unknown on n2 yet: DELJOB to everyone
    s.run_for(5.0)  # the REPLJOBs land
    s.sql("n1", "DELETE FROM pgq.acks WHERE id = %s", (job,))  # as the sweep does after 60 s
    s.until(lambda: not copies(s, job), 10.0, "the late copies deleted")
    s.holds(lambda: not s.queued_on(job), 130.0, "the acknowledged job stays gone")


def test_wait_job_on_a_holder_returns_when_another_holder_acks(sim_databases):
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3)
    waiting = s.start("n2", lambda ses: commands.wait_job(ses, job, 30), "wait on n2")
    s.run_for(1.0)
    assert not waiting.done
    s.ack("n1", job)
    s.until(lambda: waiting.done, 3.0, "the wait to end with the ACK")
    assert waiting.value is True and waiting.error is None


def test_fast_acks_from_a_holder_and_from_a_stranger(sim_databases):
    s = cluster(sim_databases)
    one = s.add("n1", b"x", replicate=3)
    two = s.add("n1", b"y", replicate=2)
    assert s.fast_ack("n1", one) == 1
    s.until(collected(s, one), 3.0, "fast-acked copies gone")
    outsider = next(n for n in s.names if n not in s.holders(two))
    assert s.fast_ack(outsider, two) == 0
    s.until(collected(s, two), 3.0, "copies of an unknown ID gone")


# ------------------------------------------------------------ federation

@pytest.mark.parametrize("retry", [30.0, 0.0], ids=["at-least-once", "at-most-once"])
def test_a_blocked_consumer_gets_jobs_queued_on_other_nodes(sim_databases, retry):
    s = cluster(sim_databases)
    added = [s.add("n2" if i % 2 else "n3", b"%d" % i, replicate=1, retry=retry)
             for i in range(20)]
    consumed: list[str] = []
    while len(consumed) < len(added):
        jobs = s.get("n1", count=10, timeout=5)
        assert jobs, f"federation stalled at {len(consumed)} of {len(added)}"
        consumed += [j.id for j in jobs]
        s.ack("n1", *(j.id for j in jobs))
    assert sorted(consumed) == sorted(added)  # all of them, each once
    # moved (at-most-once) or acked on the importer, which told the origin
    s.until(lambda: all(collected(s, j)() for j in added), 5.0, "nothing left anywhere")



@pytest.mark.parametrize("retry", [30.0, 0.0], ids=["at-least-once", "at-most-once"])
def test_federation_hands_over_higher_priorities_first(sim_databases, retry):
    """NEEDJOBS exported the oldest queued jobs whatever their priority: a
    consumer on another node than the producers (Disque's usual layout)
    got an urgent job only after the backlog added before it (found by a
    read-only review)."""
    s = cluster(sim_databases)
    for i in range(5):
        s.add("n2", b"%d" % i, replicate=1, retry=retry)
    urgent = s.do("n2", lambda ses: commands.add_jobs(
        ses, "q", [b"u"], params(replicate=1, retry=retry, priority=9)), "an urgent add")[0]
    assert [j.id for j in s.get("n1", timeout=5)] == [urgent]


def test_a_keyed_at_most_once_job_handed_to_another_node_keeps_its_key_and_its_waiter(sim_databases):
    """NEEDJOBS moved an at-most-once job (deleted it here): its key was
    free again on the node it left, so the producer's retried add queued
    the work twice, and a WAITJOB there answered 'done' while the job was
    still being worked on elsewhere (found by a read-only review). A keyed
    one now stays here as a copy that the importer's ACK removes."""
    s = cluster(sim_databases)
    keyed = params(replicate=1, retry=0, key="once")
    job = s.do("n2", lambda ses: commands.add_jobs(ses, "q", [b"a"], keyed), "add")[0]
    waiting = s.start("n2", lambda ses: commands.wait_job(ses, job, 60), "wait on n2")
    assert [j.id for j in s.get("n1", timeout=5)] == [job]  # handed over, delivered, not acked
    s.run_for(1.0)
    assert not waiting.done
    again = s.do("n2", lambda ses: commands.add_jobs(ses, "q", [b"a"], keyed), "the add again")[0]
    assert again == job
    assert s.ack("n1", job) == 1
    s.until(lambda: waiting.done, 10.0, "the wait on n2 to end")
    assert waiting.value is True
    s.until(lambda: not copies(s, job), 10.0, "no copy left")
    fresh = s.do("n2", lambda ses: commands.add_jobs(ses, "q", [b"b"], keyed), "a new add")[0]
    assert fresh != job  # the key is free once the job is done with


def test_an_enqueue_from_a_peer_never_queues_a_delivered_at_most_once_job(sim_databases):
    """ENQUEUE (a leaving node's hand-over) lacked REQUEUE's guard: a stray
    or crafted one queued an at-most-once job delivered here, which was
    then delivered twice (found by a read-only review)."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=1, retry=0)
    assert [j.id for j in s.get("n1")] == [job]
    s.sql("n1", node_sql.APPLY_ENQUEUE, {"ids": [job]})
    assert s.queued_on(job) == [] and s.get("n1") == []


def test_a_queue_paused_for_output_is_not_exported(sim_databases):
    s = cluster(sim_databases, nodes=3)
    job = s.add("n2", b"x", replicate=1)
    s.do("n2", lambda ses: commands.pause(ses, "q", ["out"]), "pause out")
    assert s.get("n1", timeout=3) == []
    s.do("n2", lambda ses: commands.pause(ses, "q", ["none"]), "unpause")
    assert [j.id for j in s.get("n1", timeout=5)] == [job]


def test_a_node_whose_queue_is_paused_for_output_imports_nothing(sim_databases):
    """A consumer blocked on a queue paused for output here asked the other
    nodes for jobs (NEEDJOBS) that nobody here could take: an at-most-once
    job moved here out of reach, and an at-least-once one stayed parked
    (found by a read-only review)."""
    s = cluster(sim_databases)
    s.do("n2", lambda ses: commands.pause(ses, "q", ["out"]), "pause out on n2")
    blocked = s.start("n2", lambda ses: commands.get_jobs(ses, ["q"], 1, 30.0, False, False),
                      "a blocked get on n2", listen=True)
    added = [s.add("n1", b"%d" % i, replicate=1, retry=retry)
             for i, retry in enumerate((0.0, 0.0, 5.0, 5.0))]
    s.run_for(3.0)
    assert all(s.holders(job) == {"n1": "queued"} for job in added)
    assert sorted(j.id for j in s.get("n1", count=10)) == sorted(added)
    assert not blocked.done


def test_a_pause_broadcast_reaches_every_node(sim_databases):
    s = cluster(sim_databases)
    assert s.do("n1", lambda ses: commands.pause(ses, "q", ["in", "bcast"]), "pause") == "in"
    s.until(lambda: all(s.do(n, lambda ses: commands.pause(ses, "q", ["state"]), "state") == "in"
                        for n in s.names), 2.0, "every node paused", every=0.05)
    with pytest.raises(PausedError):
        s.add("n3", b"x")


def test_bcast_alone_pushes_the_pause_in_force_to_every_node(sim_databases):
    """PAUSE q bcast (or state bcast) broadcasts the queue's flags as they
    are, as Disque does; it returned them and sent nothing."""
    s = cluster(sim_databases)
    assert s.do("n1", lambda ses: commands.pause(ses, "q", ["out"]), "pause") == "out"
    assert s.do("n2", lambda ses: commands.pause(ses, "q", ["state"]), "state") == "none"
    assert s.do("n1", lambda ses: commands.pause(ses, "q", ["state", "bcast"]), "bcast") == "out"
    s.until(lambda: all(s.do(n, lambda ses: commands.pause(ses, "q", ["state"]), "state") == "out"
                        for n in s.names), 2.0, "every node paused for output", every=0.05)


# ------------------------------------------------------------ leaving

def test_a_leaving_node_drains_through_federation_and_takes_no_copy(sim_databases):
    s = cluster(sim_databases)
    held = [s.add("n3", b"%d" % i, replicate=1) for i in range(10)]
    s.leaving("n3")
    s.until(lambda: priority(s, "n1", "n3") == 100, 3.0, "the leaving flag to spread",
            every=0.1)
    s.run_for(1.1)  # the clients' view of the cluster is cached for a second
    with pytest.raises(LeavingError):
        s.get("n3", queue="nothing", timeout=1)  # it would block: refused
    assert s.get("n3", queue="nothing") == []
    new = s.add("n3", b"new", queue="other")  # kept elsewhere, on W other nodes
    s.until(lambda: "n3" not in s.holders(new), 3.0, "the leaving node to drop its hand-over")
    assert len(s.holders(new)) == 2
    with pytest.raises(NoReplError):
        s.add("n1", b"x", replicate=3)  # nobody gets new copies onto the leaving node
    got: list[str] = []
    while len(got) < len(held):
        jobs = s.get("n1", count=10, timeout=5)
        assert jobs, "federation stalled"
        got += [j.id for j in jobs]
        s.ack("n1", *(j.id for j in jobs))
    assert sorted(got) == sorted(held)
    s.ack("n2", new)
    myself = s.node("n3").node_id
    s.until(lambda: s.sql("n3", contracts.HELD_BY_NODE, {"myself": myself})[0][0] == 0, 10.0,
            "the leaving node to hold nothing")



def test_a_delayed_job_handed_over_by_a_leaving_node_keeps_its_delay(sim_databases):
    """A leaving node hands a new add to one of its copies' holders with
    ENQUEUE, which queued it at once: an add with DELAY 4 was delivered at
    once (found by a review of docs/cluster-protocol.md). And until the
    hand-over, the leaving node counts the add as held (the next test)."""
    s = cluster(sim_databases)
    s.leaving("n3")
    s.until(lambda: priority(s, "n1", "n3") == 100, 3.0, "the leaving flag to spread",
            every=0.1)
    s.run_for(1.1)  # the clients' view of the cluster is cached for a second
    params = arguments.job_params(replicate=None, delay=4, retry=None, ttl=600, maxlen=None,
                                  asynchronous=False, timeout=None)
    [job] = s.do("n3", lambda ses: commands.add_jobs(ses, "later", [b"x"], params), "a delayed add")
    s.until(lambda: "n3" not in s.holders(job), 3.0, "the leaving node to hand it over")
    assert s.queued_on(job) == [], s.holders(job)  # still delayed (its add was 4 s ago at most)
    heir, = [n for n in ("n1", "n2")
             if s.sql(n, "SELECT requeue_at IS NOT NULL FROM pgq.jobs WHERE id = %(id)s", {"id": job})[0][0]]
    other = "n2" if heir == "n1" else "n1"
    # A consumer on the other holder only (its own copy's timer is a retry,
    # 300 s, away): the heir's copy is queued at the delay's end and comes
    # over by federation. Left active with no timer (the first version of
    # the fix), it was served only by a GET on the heir.
    got = s.get(other, queue="later", timeout=10)
    assert [j.id for j in got] == [job]


def test_a_leaving_node_counts_an_add_waiting_for_its_copies_as_held(sim_databases):
    """A leaving node stores an add's row with no holder ('{}') until its
    copies are made elsewhere; HELD_BY_NODE did not count it, and `pgq
    cluster leave` said the node was safe to stop while an add it had
    answered lived only there (found by a review of the protocol's doc)."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=1)
    s.sql("n1", "UPDATE pgq.jobs SET state = 'wait-repl', nodes_delivered = '{}' WHERE id = %(id)s",
          {"id": job})  # as a leaving node stores an add until its hand-over
    myself = s.node("n1").node_id
    assert s.sql("n1", contracts.HELD_BY_NODE, {"myself": myself})[0][0] == 1
    # past its TTL (a client that crashed waiting for copies that never
    # came) it holds nothing: `leave` waited for it to be swept
    s.sql("n1", "UPDATE pgq.jobs SET expires_at = pgq.now() - interval '1 second' "
          "WHERE id = %(id)s", {"id": job})
    assert s.sql("n1", contracts.HELD_BY_NODE, {"myself": myself})[0][0] == 0


# ------------------------------------------------------------ membership

def test_a_node_forgotten_while_another_was_down_stays_forgotten(sim_databases):
    """A restart loaded every stored member as alive: a node that missed
    the FORGET (it was down) brought the forgotten node back into every
    view through its gossip, for good."""
    s = cluster(sim_databases, nodes=4)
    gone = s.node("n4").node_id
    s.crash("n4")
    s.until(lambda: s.sql("n3", "SELECT status FROM pgq.nodes WHERE id = %s", [gone])
            == [("dead",)], 40.0, "n3 to record n4 dead")
    s.crash("n3")  # down for maintenance: it misses the FORGET
    s.sql("n1", contracts.TELL_NODE, {"kind": contracts.OUTBOX_FORGET, "queue": None, "arg": gone})
    s.sim._ring(s.node("n1"))
    s.until(lambda: s.sees("n1", "n4") is None and s.sees("n2", "n4") is None, 5.0,
            "n1 and n2 to forget n4")
    s.run_for(61.0)  # past the ban: only what n3 says could bring n4 back
    s.restart("n3")
    s.until(lambda: s.sees("n1", "n3") == "alive", 15.0, "n3 back")
    s.holds(lambda: s.sees("n1", "n4") is None and s.sees("n2", "n4") is None, 20.0,
            "n4 stays forgotten")


def test_an_ack_collection_reloaded_after_a_restart_does_not_wait_for_a_forgotten_holder(sim_databases):
    """FORGET dropped the node from the collections in memory only: the
    tombstone still named it, a restart of the acker's process reloaded it
    as a holder that no one would ever ask, and the collection waited until
    the job's TTL (found by a read-only review)."""
    s = cluster(sim_databases, nodes=4)
    job = s.add("n1", b"x", replicate=3, retry=30)
    others = sorted(set(copies(s, job)) - {"n1"})
    gone, back = others
    s.crash(gone)
    s.crash(back)
    assert s.ack("n1", job) == 1
    s.sql("n1", contracts.TELL_NODE, {"kind": contracts.OUTBOX_FORGET, "queue": None,
                                      "arg": s.node(gone).node_id})
    s.sim._ring(s.node("n1"))
    s.until(lambda: s.sees("n1", gone) is None, 5.0, f"n1 to forget {gone}")
    s.run_for(1.0)  # n1 saves its members (every 0.25 s)
    s.crash("n1")
    s.restart("n1")
    s.restart(back)
    s.until(lambda: all(n not in copies(s, job) for n in ("n1", back)), 30.0, "the copies gone")
    s.until(lambda: not s.sql("n1", "SELECT 1 FROM pgq.acks WHERE id = %s AND nodes IS NOT NULL",
                              (job,)), 60.0, "n1's collection done (its tombstone without holders)")


def test_forget_never_removes_the_node_itself(sim_databases):
    s = cluster(sim_databases)
    myself = s.node("n1").node_id
    s.sql("n1", contracts.TELL_NODE, {"kind": contracts.OUTBOX_FORGET, "queue": None,
                                      "arg": myself})
    s.sim._ring(s.node("n1"))
    s.holds(lambda: s.meshed(), 10.0, "every node sees every other alive")


def test_a_holder_back_from_a_crash_does_not_queue_a_job_acked_while_it_was_down(sim_databases):
    """Its overdue copy timer fired at its first look, before anyone could
    tell it of the ACK: the acker's SETACKs to it had backed off (1, 2, 4,
    8 s...) while it was down, and the job was delivered there again."""
    s = cluster(sim_databases)
    job = s.add("n1", b"x", replicate=3, retry=2)
    s.crash("n3")
    [got] = s.get("n1")
    assert s.ack("n1", got.id) == 1
    s.run_for(10.0)  # n3's timer is overdue; n1's SETACKs to it back off
    s.restart("n3")
    # Checked every 0.5 ms: without the fix the job sat queued on n3 for
    # the round trip of its QUEUED and the SETACK that answered it (1 ms
    # here), long enough for a consumer blocked there.
    s.holds(lambda: "n3" not in s.queued_on(job), 3.0, "n3 never queues the acked job",
            every=0.0005)
    s.until(collected(s, job), 20.0, "the ACK collected on every holder")


@pytest.mark.parametrize("direct", [False, True])
def test_a_replicated_add_run_again_after_its_job_was_acknowledged_stores_nothing(
        sim_databases, direct):
    """The add's reply was lost with its connection; meanwhile its job was
    consumed and acknowledged everywhere. Run again with the same IDs, it
    stored the job a second time (ON CONFLICT found no row), and it was
    delivered after its ACK returned. The origin's history says it is done
    (found on one node by the restart test)."""
    s = cluster(sim_databases, direct=direct)
    if direct:
        s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
                "the peers' databases advertised")
    call = commands.AddCall("q", [b"x"], params(replicate=3))
    [first] = s.do("n1", lambda session: commands.add_replicated_batch(session, [call]), "add")
    [job] = first
    [taken] = s.get("n1")
    assert taken.id == job and s.ack("n1", job) == 1
    s.until(collected(s, job), 10.0, "the ACK reached every holder")
    again = s.do("n1", lambda session: commands.add_jobs(
        session, call.queue, call.bodies, call.params, call.ids), "the add run again")
    assert again == [job]
    s.holds(lambda: copies(s, job) == set(), 3.0, "no copy of the acknowledged job")


def test_an_add_run_again_after_its_direct_commit_was_lost_leaves_no_copy_its_ack_misses(
        sim_databases):
    """A direct add's peers committed their copies, then its own commit was
    lost with the connection. Run again under the same IDs on other peers,
    its job was acknowledged there, and the first peers' copies (listing
    other holders) re-queued it after their retry: delivered after its ACK
    returned. The add goes on under new IDs, and the old ones' tombstones
    answer those copies SETACK."""
    s = cluster(sim_databases, nodes=5, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 4, 5.0,
            "the peers' databases advertised")
    call = commands.AddCall("q", [b"x"], params(replicate=3, retry=1))

    def first_attempt(session):  # its copies commit; its own commit is lost
        attempt = commands.add_replicated_batch(session, [call])
        request = next(attempt)
        while not isinstance(request, protocol.Commit):
            request = attempt.send((yield request))
        attempt.close()
        yield protocol.Rollback()

    s.do("n1", first_attempt, "the first attempt")
    [old] = next(iter(call.ids.values()))
    written = copies(s, old)
    assert len(written) == 2 and "n1" not in written
    view = s.node("n1").cluster_view
    for name in written:  # the add run again draws the other peers
        view.failing[s.node(name).node_id] = s.node("n1").clock.monotonic() + 60.0
    [job] = s.do("n1", lambda session: commands.add_jobs(
        session, call.queue, call.bodies, call.params, call.ids), "the add run again")
    [taken] = s.get("n1")
    assert taken.id == job and s.ack("n1", job) == 1
    s.until(lambda: collected(s, job)() and copies(s, old) == set(), 20.0,
            "the ACK collected, the first attempt's copies told SETACK")
    s.holds(lambda: s.queued_on(old) == [] and s.queued_on(job) == [], 5.0,
            "neither ID queued again")


def test_a_large_replicated_add_run_again_stores_the_chunks_it_missed_in_order(sim_databases):
    """A replicated add of more than COPY_THRESHOLD jobs stores them chunk by
    chunk, each chunk in its own transaction; the connection broke after the
    first. Run again, it stores only the missing chunk, under its IDs, and
    answers every ID in body order once each has its copies."""
    from pgq import statements as sql

    s = cluster(sim_databases)
    bodies = [b"%d" % i for i in range(commands.COPY_THRESHOLD + 3)]
    call = commands.AddCall("q", bodies, params(replicate=2))

    def first_attempt(session):  # the first chunk commits, then the connection breaks
        attempt = commands.add_jobs(session, call.queue, call.bodies, call.params, call.ids)
        request, chunks = next(attempt), 0
        while True:
            if isinstance(request, protocol.Query) and request.sql == sql.ADD_JOBS_CLUSTER:
                chunks += 1
                if chunks == 2:
                    attempt.close()
                    return
            request = attempt.send((yield request))

    s.do("n1", first_attempt, "the first attempt")
    ids = list(next(iter(call.ids.values())))
    assert s.sql("n1", "SELECT count(*) FROM pgq.jobs")[0][0] == commands.COPY_THRESHOLD
    again = s.do("n1", lambda session: commands.add_jobs(
        session, call.queue, call.bodies, call.params, call.ids), "the add run again")
    assert again == ids
    assert s.sql("n1", "SELECT count(*) FROM pgq.jobs WHERE state = 'queued'")[0][0] == len(ids)
    assert len(copies(s, ids[-1])) == 2 and len(copies(s, ids[0])) == 2


def test_ids_given_up_keep_their_tombstones_due_until_written(sim_databases):
    """A replicated add run again that finds nothing gives up its IDs and
    tombstones them. When the connection breaks while it writes them, the
    next run writes them too (with its own): none of the IDs a peer may
    hold a copy of is left without one, and the IDs the add goes on with
    never get one (a later run would call them done)."""
    from pgq import statements as sql

    s = cluster(sim_databases)
    call = commands.AddCall("q", [b"x"], params(replicate=2))

    def cut_at_tombstones(session):  # a run again that breaks as it writes them
        attempt = commands.add_jobs(session, call.queue, call.bodies, call.params, call.ids)
        request = next(attempt)
        while not (isinstance(request, protocol.Query) and request.sql == sql.WITHDRAWN_HERE):
            request = attempt.send((yield request))
        attempt.close()

    def first_ids(session):  # the IDs of a first attempt that stored nothing
        return commands._ids(session, call.params, 1, call.ids)
        yield

    [first] = s.do("n1", first_ids, "the first attempt's IDs")
    s.do("n1", cut_at_tombstones, "a run again, cut")
    [second] = next(iter(v for k, v in call.ids.items() if ":" not in k))
    [job] = s.do("n1", lambda session: commands.add_jobs(
        session, call.queue, call.bodies, call.params, call.ids), "the add run again")
    tombstones = {row[0] for row in s.sql("n1", "SELECT id FROM pgq.acks")}
    assert {first, second} <= tombstones and job not in tombstones | {first, second}
    assert copies(s, job) and s.queued_on(job) == ["n1"]


@pytest.mark.parametrize("how", ["ack", "fast_ack"])
def test_a_replicated_add_run_again_after_its_job_was_done_on_another_node_stores_nothing(
        sim_databases, how):
    """The add's reply was lost; meanwhile an ACK (or a FASTACK) on another
    node ended the job: the origin's copy went to SETACK (or DELJOB), which
    logs no history, and its tombstone to the DELJOB that ended the ACK's
    collection. Run again, the add found nothing of its job at the origin
    and stored it once more (under new IDs): a job done with, delivered
    again. The node that made the ID keeps a short tombstone (APPLY_DELJOB,
    RETRY_WINDOW)."""
    s = cluster(sim_databases)
    call = commands.AddCall("q", [b"x"], params(replicate=3))
    [[job]] = s.do("n1", lambda session: commands.add_replicated_batch(session, [call]), "add")
    assert getattr(s, how)("n2", job) == 1
    s.until(lambda: copies(s, job) == set() and set(s.holders(job)) <= {"n1"}, 10.0,
            "every copy deleted, the collection ended")
    again = s.do("n1", lambda session: commands.add_jobs(
        session, call.queue, call.bodies, call.params, call.ids), "the add run again")
    assert again == [job]
    s.holds(lambda: s.sql("n1", "SELECT count(*) FROM pgq.jobs")[0][0] == 0, 3.0,
            "nothing stored again on the origin")


def test_a_failed_direct_add_withdraws_nothing_from_a_peer_nothing_reached(sim_databases):
    """A peer the client could not send its copy to (here a DSN no node
    serves: PeerUnreached, as a real client gets for no connection in time)
    holds nothing to withdraw: waiting on it a second time would eat the
    time the node's way needs (found by a read-only review). The peer
    written to is withdrawn from, and the add goes the node's way."""
    s = cluster(sim_databases, direct=True)
    s.until(lambda: len(s.do("n1", commands.cluster_view, "view", within=1).peers) == 2, 5.0,
            "the peers' databases advertised")
    n2, n3 = s.node("n2").node_id, s.node("n3").node_id
    writes: list[tuple[str, list[str]]] = []
    peer_write = s.sim._peer_write

    def recorded(node, request):
        # n3's DSN, as this client knows it, reaches no node (a stale one)
        request = dataclasses.replace(request, writes=tuple(
            (peer, "host=nowhere dbname=gone" if peer == n3 else dsn, p)
            for peer, dsn, p in request.writes))
        done = peer_write(node, request)
        writes.append((request.sql, sorted(peer for peer, _dsn, _p in request.writes)))
        return done

    s.sim._peer_write = recorded
    job = s.add("n1", b"x", replicate=3)
    assert [peers for sql, peers in writes if sql == contracts.DIRECT_COPY] == [sorted([n2, n3])]
    assert [peers for sql, peers in writes if sql == client_sql.WITHDRAW_COPIES] == [[n2]]
    assert copies(s, job) == {"n1", "n2", "n3"}  # the node's way
