"""SHOW, QLEN, QPEEK, QSTAT, QSCAN, JSCAN, PAUSE, HELLO, INFO."""

from __future__ import annotations

import pytest

from pgq.errors import InvalidArgumentError


def test_show_reports_disque_fields(client):
    job_id = client.add_job("s", b"payload", ttl=100, retry=10)
    client.get_job("s")
    info = client.show(job_id)
    assert set(info) == {"id", "queue", "state", "repl", "ttl", "ctime", "delay", "retry",
                         "nacks", "additional_deliveries", "deliveries", "nodes_delivered",
                         "nodes_confirmed", "next_requeue_within", "next_awake_within", "body",
                         "priority", "key"}  # pgq's own two (schema 0013)
    assert info["state"] == "active" and info["deliveries"] == 1
    assert 9.5 < info["next_requeue_within"] <= 10.25
    assert info["next_awake_within"] == pytest.approx(info["next_requeue_within"], abs=0.01)
    assert info["nodes_delivered"] == [client.node_id]
    assert isinstance(info["ctime"], int) and info["ctime"] > 10**18
    assert client.show(job_id.replace(job_id[11:35], "A" * 24)) is None


def test_qlen_and_qpeek(client):
    ids = client.add_jobs("p", [b"%d" % i for i in range(5)])
    assert client.qlen("p") == 5 and client.qlen("nothing") == 0
    assert [j.id for j in client.qpeek("p", 2)] == ids[:2]
    assert [j.id for j in client.qpeek("p", -2)] == ids[::-1][:2]
    assert client.qlen("p") == 5  # peeking takes nothing
    peeked = client.qpeek("p", 1)[0]
    assert (peeked.body, peeked.nacks, peeked.additional_deliveries) == (b"0", 0, 0)
    with pytest.raises(InvalidArgumentError):
        client.qpeek("p", 0)


def test_qstat(client):
    assert client.qstat("never") is None
    client.add_jobs("st", [b"1", b"2", b"3"])
    client.get_job("st", count=2)
    stat = client.qstat("st")
    assert {k: stat[k] for k in ("name", "len", "blocked", "jobs_in", "jobs_out", "pause",
                                 "import_from", "import_rate")} == {
        "name": "st", "len": 1, "blocked": 0, "jobs_in": 3, "jobs_out": 2, "pause": "none",
        "import_from": [], "import_rate": 0}
    assert 0 <= stat["age"] < 30 and 0 <= stat["idle"] < 30
    client.pause("st", "in")
    assert client.qstat("st")["pause"] == "in"


def test_qscan_iterates_every_queue_with_filters(client):
    names = [f"queue-{i:03d}" for i in range(25)]
    for i, name in enumerate(names):
        client.add_jobs(name, [b"x"] * (i % 5 + 1))
    seen, cursor, calls = [], 0, 0
    while True:
        cursor, page = client.qscan(cursor, count=7)
        seen += page
        calls += 1
        if cursor == 0:
            break
    assert sorted(seen) == names and calls == 4
    _, big = client.qscan(count=100, minlen=5)
    assert big == [n for i, n in enumerate(names) if i % 5 + 1 >= 5]
    _, small = client.qscan(count=100, maxlen=1)
    assert small == [n for i, n in enumerate(names) if i % 5 == 0]
    assert client.qscan(count=100, importrate=1) == (0, [])  # nothing imported on one node


def test_jscan_iterates_jobs_and_acks_with_filters(client):
    queued = client.add_jobs("j1", [b"a"] * 12)
    other = client.add_jobs("j2", [b"b"] * 5)
    active = [j.id for j in client.get_job("j2", count=2)]
    ghost = "D-" + client.node_id[:8] + "-" + "Z" * 24 + "-0001"
    client.ack_job(ghost)  # a dummy ACK: no job, so JSCAN skips it (Disque)
    done = active.pop()
    assert client.ack_job(done) == 1  # a lone node keeps no tombstone: gone from JSCAN
    every, cursor = [], 0
    while True:
        cursor, page = client.jscan(cursor, count=4)
        every += page
        if cursor == 0:
            break
    assert sorted(every) == sorted(queued + [j for j in other if j != done]) and done in other
    assert every == sorted(every)  # by ID
    _, j2 = client.jscan(count=100, queue="j2")
    assert sorted(j2) == sorted(set(other) - {done})
    _, act = client.jscan(count=100, states=["active"])
    assert sorted(act) == sorted(active)
    assert client.jscan(count=100, states=["acked"], reply="all") == (0, [])
    _, full = client.jscan(count=3, queue="j1", reply="all")
    assert all(f["queue"] == "j1" and f["body"] == b"a" for f in full) and len(full) == 3
    # a STATE filter goes through every page (a page of the filter's rows
    # that came back short ended the scan early)
    mixed = client.add_jobs("j3", [b"c"] * 6)
    claimed = [j.id for j in client.get_job("j3", count=3)]  # the three oldest: active
    assert claimed == mixed[:3]
    found, cursor = [], 0
    while True:
        cursor, page = client.jscan(cursor, count=2, queue="j3", states=["queued"])
        found += page
        if cursor == 0:
            break
    assert found == mixed[3:]
    with pytest.raises(InvalidArgumentError, match="unknown job state"):
        client.jscan(states=["done"])
    with pytest.raises(InvalidArgumentError):
        client.jscan(reply="everything")
    with pytest.raises(InvalidArgumentError):
        client.jscan(-1)


def test_pause_flags(client):
    assert client.pause("pz", "state") == "none"
    assert client.pause("pz", "in") == "in"
    assert client.pause("pz", "out") == "out"  # flags replace, as in Disque
    assert client.pause("pz", "in", "out") == "all"
    assert client.pause("pz", "state") == "all"
    assert client.pause("pz", "none") == "none"
    assert client.pause("pz", "all", "bcast") == "all"  # bcast: no peers on one node
    with pytest.raises(InvalidArgumentError, match="allowed"):
        client.pause("pz", "sideways")
    with pytest.raises(InvalidArgumentError):
        client.pause("pz")


def test_hello_and_info(client):
    hello = client.hello()
    assert hello["id"] == client.node_id and len(hello["nodes"]) == 1
    assert hello["nodes"][0]["priority"] == 1
    client.add_jobs("i", [b"1", b"2"])
    client.get_job("i")
    info = client.info()
    assert info["node_id"] == client.node_id
    assert info["jobs"] == {"wait-repl": 0, "active": 1, "queued": 1, "acked": 0}
    assert info["registered_jobs"] == 2 and info["queues"] == 1
    assert info["fsync"] == "on" and info["synchronous_commit"] == "on"
    assert info["server_version"].startswith(("15", "16", "17", "18"))
