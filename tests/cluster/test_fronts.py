"""A node process serves other programs (pgq node start --http --resp
--dashboard): Disque's protocol and the HTTP API on a real 3-node cluster,
with replicated adds, through a raw RESP client, pydisque and an HTTP client."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

import pytest

from pgq.resp import Error, Status

from ..conftest import wait_until
from ..test_resp import Resp
from .conftest import free_port


def http(base: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status, json.loads(reply.read() or b"null")


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
