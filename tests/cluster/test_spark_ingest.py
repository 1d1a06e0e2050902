"""Bulk ingestion into a 3-node cluster: copies, consumption, a node failure."""

from __future__ import annotations

import pgq
from pgq.spark import write_jobs

from .conftest import wait_until


def test_ingested_jobs_have_w_copies_and_survive_the_loss_of_their_origin(spark, make_cluster):
    cluster = make_cluster(3)
    dsns = [node.dsn for node in cluster]
    ids = cluster.ids()
    bodies = [f"row {i}" for i in range(300)]
    df = spark.sparkContext.parallelize([(b,) for b in bodies], 4).toDF(["body"])
    result = write_jobs(df, "lake", nodes=dsns, replicate=2, retry=2, ingest_id="lake-1")
    assert (result.jobs, result.replicate) == (300, 2)
    assert sorted(result.copies_by_node.values()) == [200, 200, 200]

    # Every job: two holders, queued at its origin (the node its ID names),
    # an active copy at the other; the same ID and ctime on both.
    rows = {node.name: node.sql("SELECT id, state, ctime, nodes_delivered FROM pgq.jobs") for node in cluster}
    by_id: dict[str, list[tuple[str, str, int, list[str]]]] = {}
    for name, found in rows.items():
        for job_id, state, ctime, holders in found:
            by_id.setdefault(job_id, []).append((name, state, ctime, holders))
    assert len(by_id) == 300
    for job_id, copies in by_id.items():
        assert len(copies) == 2
        origin = [c for c in copies if c[1] == "queued"]
        assert len(origin) == 1 and ids[origin[0][0]][:8] == job_id[2:10]
        assert len({c[2] for c in copies}) == 1
        assert sorted(copies[0][3]) == sorted(ids[c[0]] for c in copies)

    # A re-run changes nothing.
    assert write_jobs(df, "lake", nodes=dsns, replicate=2, retry=2, ingest_id="lake-1").already_done

    # The origin n1 fails: its jobs come back through their copies on n2/n3.
    cluster[0].kill()
    seen: set[bytes] = set()
    clients = [pgq.Client(node.dsn) for node in cluster.nodes[1:]]
    try:
        def all_delivered() -> bool:
            for client in clients:
                jobs = client.get_job("lake", count=300, timeout=0.2)
                if jobs:
                    client.ack_job(*(j.id for j in jobs))
                    seen.update(j.body for j in jobs)
            return len(seen) == 300

        wait_until(all_delivered, timeout=60, every=0.2, message="every ingested job delivered")
    finally:
        for client in clients:
            client.close()
    assert seen == {b.encode() for b in bodies}
