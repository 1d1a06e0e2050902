"""A job's life: ACK (and dummy acks), FASTACK, NACK, ENQUEUE, DEQUEUE, WORKING,
DELJOB, automatic re-queue after RETRY, at-most-once jobs, TTL in every state."""

from __future__ import annotations

import time

import pytest

from pgq.errors import BadIdError, NoJobError, TooLateError
from pgq.ids import new_job_id

from .conftest import counters_match_jobs


def unknown_id(client, retry=5, ttl=3600):
    return new_job_id(client.node_id, ttl, retry)


# ------------------------------------------------------------------ ACK


def test_ack_counts_known_unacked_jobs_and_logs_history(client, db):
    ids = client.add_jobs("a", [b"1", b"2", b"3"])
    client.get_job("a", count=2)
    assert client.ack_job(*ids) == 3  # delivered or still queued: both count
    assert client.ack_job(*ids) == 0  # already acknowledged
    assert client.qlen("a") == 0 and client.show(ids[0])["state"] == "acked"
    history = db.execute("SELECT id, outcome, deliveries FROM pgq.history").fetchall()
    assert sorted(h[0] for h in history) == sorted(ids)
    assert {h[1] for h in history} == {"acked"}
    assert sorted(h[2] for h in history) == [0, 1, 1]
    assert counters_match_jobs(db)


def test_ack_of_unknown_at_least_once_id_leaves_a_dummy_ack(client, db):
    ghost = unknown_id(client, retry=5, ttl=7200)
    assert client.ack_job(ghost) == 0
    info = client.show(ghost)
    assert info["state"] == "acked" and info["body"] is None
    # lifetime from the ID's TTL field: 120 minutes, made odd (121) for at-least-once
    assert 7200 < info["ttl"] <= 121 * 60
    dummy = db.execute("SELECT dummy FROM pgq.acks WHERE id = %s", (ghost,)).fetchone()
    assert dummy == (True,)


def test_ack_of_unknown_at_most_once_id_leaves_nothing(client, db):
    ghost = unknown_id(client, retry=0)
    assert client.ack_job(ghost) == 0
    assert client.show(ghost) is None
    assert db.execute("SELECT count(*) FROM pgq.acks").fetchone()[0] == 0


def test_one_id_and_many_ids_are_acknowledged_alike(client, db):
    """An ACK of one ID sends it as a plain value (ACK_ONE), of several as
    arrays (ACK): the same jobs go, the same dummy acks stay."""
    outcomes = []
    for alone in (True, False):
        known = client.add_job("a", b"1")
        ids = [known, unknown_id(client, retry=5, ttl=7200), unknown_id(client, retry=0)]
        acked = sum(client.ack_job(i) for i in ids) if alone else client.ack_job(*ids)
        dummies = db.execute("SELECT count(*) FROM pgq.acks WHERE dummy AND id = ANY (%s)",
                             (ids,)).fetchone()[0]
        history = db.execute("SELECT outcome FROM pgq.history WHERE id = ANY (%s)",
                             (ids,)).fetchall()
        outcomes.append((acked, dummies, history, client.show(ids[2]), client.qlen("a")))
    assert outcomes[0] == outcomes[1] == (1, 1, [("acked",)], None, 0)
    assert counters_match_jobs(db)


def test_ack_accepts_a_list_and_rejects_any_bad_id(client):
    ids = client.add_jobs("a", [b"1", b"2"])
    with pytest.raises(BadIdError):
        client.ack_job(ids[0], "garbage")
    assert client.qlen("a") == 2  # nothing was acked
    assert client.ack_job(ids) == 2


# ------------------------------------------------------------- FASTACK


def test_fast_ack_deletes_without_tombstone(client, db):
    job_id = client.add_job("f", b"x")
    client.get_job("f")
    assert client.fast_ack(job_id) == 1
    assert client.show(job_id) is None
    assert client.fast_ack(job_id) == 0
    assert db.execute("SELECT count(*) FROM pgq.acks").fetchone()[0] == 0
    assert db.execute("SELECT outcome FROM pgq.history").fetchone() == ("fastacked",)


# ---------------------------------------------------------- NACK/ENQUEUE


def test_nack_requeues_now_and_counts(client):
    job_id = client.add_job("n", b"x", retry=60)
    client.get_job("n")
    assert client.nack_job(job_id) == 1
    assert client.nack_job(job_id) == 0  # already queued: nothing to do
    job = client.get_job("n", withcounters=True, nohang=True)[0]
    assert (job.id, job.nacks, job.additional_deliveries) == (job_id, 1, 0)
    client.nack_job(job_id)
    job = client.get_job("n", withcounters=True, nohang=True)[0]
    assert job.nacks == 2


def test_enqueue_counts_an_additional_delivery_after_the_first_queueing(client):
    job_id = client.add_job("e", b"x", retry=60)
    client.get_job("e")
    assert client.enqueue(job_id) == 1
    job = client.get_job("e", withcounters=True, nohang=True)[0]
    assert (job.nacks, job.additional_deliveries) == (0, 1)
    delayed = client.add_job("e", b"later", delay=60)
    assert client.enqueue(delayed) == 1  # first queueing of a delayed job: no count
    job = client.get_job("e", withcounters=True, nohang=True)[0]
    assert (job.id, job.additional_deliveries) == (delayed, 0)


def test_dequeue_takes_a_job_out_until_its_retry(client):
    job_id = client.add_job("d", b"x", retry=1)
    assert client.dequeue(job_id) == 1
    assert client.dequeue(job_id) == 0
    assert client.qlen("d") == 0
    assert client.get_job("d", nohang=True) == []
    assert client.show(job_id)["state"] == "active"
    assert [j.id for j in client.get_job("d", timeout=5)] == [job_id]  # the retry timer


# ------------------------------------------------------- retry / re-queue


def test_unacked_job_is_requeued_after_retry_with_a_delivery_counted(client, db):
    job_id = client.add_job("r", b"x", retry=1)
    claimed = time.monotonic()  # (before the claim: its lease starts during it)
    first = client.get_job("r")[0]
    assert client.get_job("r", nohang=True) == []
    lease = client.show(job_id)["next_requeue_within"]
    assert 0 < lease <= 1.26
    again = client.get_job("r", timeout=5, withcounters=True)
    waited = time.monotonic() - claimed
    assert [j.id for j in again] == [first.id]
    assert again[0].additional_deliveries == 1
    assert 0.95 < waited < 3.5  # the retry (1 s) after the claim, not at once
    assert counters_match_jobs(db)


def test_sweep_queues_due_jobs_so_qlen_counts_them(client):
    job_id = client.add_job("s", b"x", retry=1)
    client.get_job("s")
    assert client.qlen("s") == 0
    time.sleep(1.4)
    assert client.qlen("s") == 1
    assert client.show(job_id)["state"] == "queued"
    assert client.get_job("s", withcounters=True)[0].additional_deliveries == 1


def test_at_most_once_job_is_never_delivered_twice(client, db):
    job_id = client.add_job("once", b"x", retry=0)
    assert [j.id for j in client.get_job("once")] == [job_id]
    info = client.show(job_id)
    assert info["next_requeue_within"] is None and info["state"] == "active"
    assert client.nack_job(job_id) == 0
    assert client.enqueue(job_id) == 0
    assert client.working(job_id) == 0
    client.sweep()
    assert client.get_job("once", timeout=1.2) == []
    assert client.qlen("once") == 0
    assert client.ack_job(job_id) == 1


# ------------------------------------------------------------- WORKING


def test_working_postpones_the_requeue(client):
    # retry 2: WORKING at 1.5 s, then a look at 2.5 s, 0.5 s past the first
    # lease and 1 s before the renewed one ends (room on both sides for a
    # loaded machine; with retry 1 the margins were 0.3 s).
    job_id = client.add_job("w", b"x", retry=2)
    client.get_job("w")
    time.sleep(1.5)
    assert client.working(job_id) == 2  # Disque's reply: the seconds it is postponed by
    time.sleep(1.0)  # 2.5 s after delivery: without WORKING it would be back
    assert client.get_job("w", nohang=True) == []
    assert [j.id for j in client.get_job("w", timeout=5)] == [job_id]


def test_working_dequeues_a_queued_job(client):
    job_id = client.add_job("wq", b"x", retry=30)
    retry = client.working(job_id)
    assert retry == 30 and isinstance(retry, int)
    assert client.qlen("wq") == 0 and client.show(job_id)["state"] == "active"


def test_working_is_too_late_after_half_the_ttl(client):
    job_id = client.add_job("late", b"x", ttl=2, retry=1)
    client.get_job("late")
    assert client.working(job_id) == 1
    time.sleep(1.1)
    with pytest.raises(TooLateError, match="half"):
        client.working(job_id)


def test_working_refuses_acked_and_unknown_jobs(client):
    job_id = client.add_job("wa", b"x")
    client.ack_job(job_id)
    client.ack_job(job_id)  # leaves a dummy ack: the job is known as acked
    with pytest.raises(NoJobError, match="acknowledged"):
        client.working(job_id)
    with pytest.raises(NoJobError, match="not known"):
        client.working(unknown_id(client))


# -------------------------------------------------------------- DELJOB


def test_del_job_deletes_in_any_state(client, db):
    queued = client.add_job("del", b"q")
    active = client.add_job("del", b"a")
    client.dequeue(active)
    tomb = unknown_id(client)
    client.ack_job(tomb)
    assert client.del_job(queued, active, tomb) == 3
    assert client.show(queued) is None and client.show(active) is None and client.show(tomb) is None
    assert client.del_job(queued) == 0
    assert {r[0] for r in db.execute("SELECT outcome FROM pgq.history")} == {"deleted"}


# ----------------------------------------------------------------- TTL


def test_ttl_expires_jobs_in_every_state(client, db):
    queued = client.add_job("ttl", b"queued", ttl=1)
    delivered = client.add_job("ttl", b"active", ttl=1, retry=0.2)
    delayed = client.add_job("ttl", b"delayed", ttl=1, delay=0.9)
    assert client.get_job("ttl")[0].id == queued
    client.nack_job(queued)
    client.dequeue(queued)  # keep it active, never due
    client.get_job("ttl")
    tomb = new_job_id(client.node_id, 60, 5)
    client.ack_job(tomb)
    db.execute("UPDATE pgq.acks SET expires_at = now() + interval '1 second'")
    time.sleep(1.2)
    for job_id in (queued, delivered, delayed, tomb):
        assert client.show(job_id) is None
    assert client.get_job("ttl", nohang=True) == []
    assert client.qlen("ttl") == 0
    assert client.ack_job(queued, delivered) == 0  # expired jobs are not "known"
    client.sweep()  # (the client's periodic sweep may already have done it)
    assert db.execute("SELECT count(*) FROM pgq.jobs").fetchone()[0] == 0
    # the expired tombstone is gone; the two late ACKs above left dummy acks
    assert sorted(r[0] for r in db.execute("SELECT id FROM pgq.acks")) == sorted([queued, delivered])
    outcomes = sorted(r[0] for r in db.execute("SELECT outcome FROM pgq.history"))
    assert outcomes == ["expired"] * 3
    assert counters_match_jobs(db)
