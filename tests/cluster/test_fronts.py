"""A node process serves other programs (pgq node start --http --resp
--dashboard): Disque's protocol and the HTTP API on a real 3-node cluster,
with replicated adds, through a raw RESP client, pydisque and an HTTP client."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

from pgq.resp import NULL_ARRAY, Error, Status

from ..conftest import wait_until
from ..test_resp import Resp
from .conftest import free_port


def http(base: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read() or b"null")


def answers(port: int) -> bool:
    try:
        Resp(port).close()
        return True
    except OSError:
        return False


def test_a_node_serves_resp_and_http_with_replicated_adds(make_cluster):
    resp_port, http_port, board_port = free_port("127.0.0.1"), free_port("127.0.0.1"), free_port("127.0.0.1")
    cluster = make_cluster(3, node_args={0: ["--resp", f"127.0.0.1:{resp_port}", "--http",
                                             f"127.0.0.1:{http_port}", "--dashboard",
                                             f"127.0.0.1:{board_port}"]})
    wait_until(lambda: answers(resp_port), 30, message="n1's RESP port")
    resp = Resp(resp_port)
    try:
        assert resp.call("PING") == Status("PONG")
        nodes = resp.call("CLUSTER", "NODES")
        assert len([line for line in nodes.decode().splitlines() if line]) == 3

        # ADDJOB REPLICATE 3 answers once the three databases hold the job
        job = resp.call("ADDJOB", "fronts", "hello", 0, "REPLICATE", 3, "RETRY", 30).text
        assert cluster.copies(job) == 3
        refused = resp.call("ADDJOB", "fronts", "x", 0, "REPLICATE", 4)
        assert isinstance(refused, Error) and refused.text.startswith("NOREPL")
        got = resp.call("GETJOB", "NOHANG", "FROM", "fronts")
        assert got == [[b"fronts", job.encode(), b"hello"]]
        assert resp.call("ACKJOB", job) == 1
        # the ACK reaches every copy: none is left to be delivered again
        wait_until(lambda: cluster.copies(job) == 0, 30, message="the ACK on every node")
    finally:
        resp.close()

    base = f"http://127.0.0.1:{http_port}"
    status, added = http(base, "/v1/queues/web/jobs", {"body": "from http", "replicate": 2, "retry": 30})
    assert status == 201 and cluster.copies(added["ids"][0]) == 2
    status, leased = http(base, "/v1/lease", {"queues": ["web"], "timeout": 5})
    assert status == 200 and [j["body"] for j in leased["jobs"]] == ["from http"]
    assert http(base, f"/v1/jobs/{urllib.parse.quote(leased['jobs'][0]['id'], safe='')}/ack", {})[0] == 200
    assert http(f"http://127.0.0.1:{board_port}", "/api/overview")[1]["clustered"] is True
    # NOREPL names the jobs of the call that stayed added (none here), so a
    # client that tries again leaves them out
    status, refused = http(base, "/v1/queues/web/jobs", {"jobs": [{"body": "a"}, {"body": "b"}],
                                                       "replicate": 4})
    assert (status, refused["error"], refused["ids"]) == (503, "NoReplError", [])
    # SIGTERM stops the node with its fronts, cleanly (the fronts stop gracefully first)
    cluster[0].process.terminate()
    assert cluster[0].process.wait(20) == 0


def test_pydisque_against_a_node(make_cluster):
    pydisque = pytest.importorskip("pydisque.client")
    port = free_port("127.0.0.1")
    cluster = make_cluster(3, node_args={1: ["--resp", f"127.0.0.1:{port}"]})
    wait_until(lambda: answers(port), 30, message="n2's RESP port")
    client = pydisque.Client([f"127.0.0.1:{port}"])
    client.connect()
    job = client.add_job("pyd-cluster", "over the wire", retry=30, replicate=3, timeout=10_000)
    assert cluster.copies(job.decode() if isinstance(job, bytes) else job) == 3
    got = client.get_job(["pyd-cluster"], timeout=1000, withcounters=True)
    assert [(q, i, b) for q, i, b, *_ in got] == [(b"pyd-cluster", job, b"over the wire")]
    client.ack_job(job)
    assert client.qlen("pyd-cluster") == 0


def test_every_command_across_a_3_node_cluster(make_cluster):
    """Disque's commands as clients send them, through pydisque on one node
    and a raw RESP client on another, against one 3-node cluster: the
    commands pydisque has a method for, then the rest (and pgq's own)
    raw. Cross-node parts: a job added on n1 is seen, waited for and keyed
    on n2; an ACK on one node reaches the copy on the other."""
    pydisque = pytest.importorskip("pydisque.client")
    one, two = free_port("127.0.0.1"), free_port("127.0.0.1")
    cluster = make_cluster(3, node_args={0: ["--resp", f"127.0.0.1:{one}"],
                                         1: ["--resp", f"127.0.0.1:{two}"]})
    wait_until(lambda: answers(one) and answers(two), 30, message="the RESP ports")
    py = pydisque.Client([f"127.0.0.1:{one}"])
    py.connect()
    raw = Resp(two)
    try:
        # HELLO lists where a Disque client reaches each node (as Disque's
        # client port): n2's front where this connection came, n1's RESP
        # front as n1 advertised it over the bus, n3's bus (it serves none).
        ids = cluster.ids()

        def hello_addresses() -> dict[str, tuple[str, str]]:
            return {node[0].decode(): (node[1].decode(), node[2].decode())
                    for node in raw.call("HELLO")[2:]}

        wait_until(lambda: hello_addresses().get(ids["n1"]) == ("127.0.0.1", str(one)), 30,
                   message="n2 to learn n1's RESP address")
        addresses = hello_addresses()
        assert addresses[ids["n2"]] == ("127.0.0.1", str(two))
        assert addresses[ids["n3"]][1] not in (str(one), str(two))
        assert f"{ids['n1']} 127.0.0.1:{one} ".encode() in raw.call("CLUSTER", "NODES")
        # pydisque on n1
        hello = py.hello()
        assert hello[0] == 1 and len(hello) == 2 + 3  # version, my ID, three nodes
        assert "disque_version" in str(py.info())
        job = py.add_job("every", "first", retry=30, replicate=3, timeout=10_000)
        job_id = job.decode() if isinstance(job, bytes) else job
        assert cluster.copies(job_id) == 3
        assert py.qlen("every") == 1
        assert [j[1] for j in py.qpeek("every", 5)] == [job]
        stat = py.qstat("every", return_dict=True)
        assert stat.get("len", stat.get(b"len")) == 1, stat
        cursor, queues = py.qscan(count=100)
        assert b"every" in queues or "every" in queues
        got = py.get_job(["every"], timeout=1000, withcounters=True)
        assert [(q, i, b) for q, i, b, *_ in got] == [(b"every", job, b"first")]
        assert py.working(job) == 30
        py.nack_job(job)  # pydisque drops NACK's reply: the counter tells
        shown = py.show(job, return_dict=True)
        assert shown.get("nacks", shown.get(b"nacks")) == 1, shown
        assert py.dequeue(job) == 1 and py.enqueue(job) == 1
        assert py.jscan(queue="every")[1]
        # PAUSE is local unless BCAST (Disque): n2 hears of it through the bus
        assert py.pause("every", kw_in=True, kw_bcast=True) in (b"in", "in")
        wait_until(lambda: raw.call("PAUSE", "every", "state") == Status("in"), 30,
                   message="the paused state broadcast to n2")
        assert raw.call("ADDJOB", "every", "refused", 0, "REPLICATE", 1).text.startswith("PAUSED")
        assert py.pause("every", kw_none=True, kw_bcast=True) in (b"none", "none")
        wait_until(lambda: raw.call("PAUSE", "every", "state") == Status("none"), 30,
                   message="the resumed state broadcast to n2")

        # the same job seen from n2 (which holds a copy)
        shown = raw.call("SHOW", job_id)
        fields = dict(zip(shown[::2], shown[1::2], strict=True))
        assert len(shown) == 30 and len(fields[b"nodes-delivered"]) == 3
        raw.send("WAITJOB", job_id, "TIMEOUT", 30_000)  # answered when the ACK arrives
        py.ack_job(job)  # pydisque drops ACKJOB's reply: the waiter tells
        assert raw.reply() == 1
        wait_until(lambda: cluster.copies(job_id) == 0, 30, message="the ACK on every node")
        # n2 answers SHOW null once its tombstone needs no more collection
        wait_until(lambda: raw.call("SHOW", job_id) is None, 30, message="SHOW null on n2")

        # keys and priorities across nodes: n1's keyed job is n2's too
        keyed = py.execute_command("ADDJOB", "keyed", "pay", 10_000, "REPLICATE", 3,
                                   "KEY", "pay-1", "PRIORITY", 2)
        keyed_id = keyed.decode() if isinstance(keyed, bytes) else keyed
        assert raw.call("ADDJOB", "keyed", "pay again", 0, "KEY", "pay-1").text == keyed_id

        # the rest, raw on n2
        fast = raw.call("ADDJOB", "rest", "x", 0, "REPLICATE", 2).text
        assert raw.call("FASTACK", fast) == 1
        deleted = raw.call("ADDJOB", "rest", "y", 0, "REPLICATE", 1).text
        assert raw.call("DELJOB", deleted) == 1 and raw.call("QLEN", "rest") == 0
        assert raw.call("GETJOB", "NOHANG", "COUNT", 3, "FROM", "rest") is NULL_ARRAY
        assert raw.call("CLUSTER", "MYID") == cluster[1].id().encode()  # a bulk string
        assert raw.call("CLUSTER", "LEAVING") == Status("no")
        assert raw.call("CONFIG", "GET", "appendonly") == [b"appendonly", b"yes"]
        assert raw.call("DEBUG", "SLEEP", 0) == Status("OK")
        assert raw.call("PING") == Status("PONG")
    finally:
        raw.close()


def test_cluster_meet_and_leaving_over_resp(make_cluster):
    """CLUSTER MEET ip port makes a lone node join a cluster, and CLUSTER
    LEAVING yes|no marks it leaving and back, both through its RESP port."""
    pair = make_cluster(2)
    port = free_port("127.0.0.1")
    make_cluster(1, mesh=False, node_args={0: ["--resp", f"127.0.0.1:{port}"]})  # a lone node
    wait_until(lambda: answers(port), 30, message="the lone node's RESP port")
    raw = Resp(port)
    try:
        host, bus_port = pair[0].bus.rsplit(":", 1)
        assert raw.call("CLUSTER", "MEET", host, bus_port) == Status("OK")
        wait_until(lambda: len(raw.call("CLUSTER", "NODES").decode().split("\n")) - 1 == 3, 30,
                   message="the lone node to know the other two")
        assert raw.call("CLUSTER", "LEAVING", "yes") == Status("OK")
        wait_until(lambda: raw.call("CLUSTER", "LEAVING") == Status("yes"), 30,
                   message="HELLO to show the node leaving")
        assert raw.call("CLUSTER", "LEAVING", "no") == Status("OK")
        wait_until(lambda: raw.call("CLUSTER", "LEAVING") == Status("no"), 30,
                   message="HELLO to show the node back")
        assert raw.call("CLUSTER", "MEET", "not a host", 1).text.startswith("ERR ")
        assert raw.call("CLUSTER", "FORGET", "x").text.startswith("ERR CLUSTER subcommands")
    finally:
        raw.close()
