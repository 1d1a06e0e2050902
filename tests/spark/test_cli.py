"""`pgq spark ingest` and `pgq spark report`, run as a user would (each starts its own Spark)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pgq


def pgq_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pgq.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={"PGQ_SPARK_MASTER": "local[2]", **_env()})


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PGQ_DSN"}


def test_ingest_a_csv_file_then_report(tmp_path, dsn):
    source = tmp_path / "orders.csv"
    with source.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "body"])
        for i in range(250):
            writer.writerow([i, json.dumps({"order": i, "note": 'say "hi", twice'})])

    first = pgq_cli("spark", "ingest", str(source), "--queue", "orders", "--dsn", dsn, "--json")
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    assert result["jobs"] == 250 and not result["already_done"]

    again = pgq_cli("spark", "ingest", str(source), "--queue", "orders", "--dsn", dsn)
    assert again.returncode == 0, again.stderr
    assert "was done already: nothing added" in again.stdout

    with pgq.Client(dsn) as client:
        jobs = client.get_job("orders", count=300, nohang=True)
        assert len(jobs) == 250
        assert json.loads(jobs[0].body) == {"order": 0, "note": 'say "hi", twice'}
        client.ack_job(*(j.id for j in jobs[:200]))
        for job in jobs[200:210]:
            client.dead_letter(job.id, reason="bad address")

    out = tmp_path / "report"
    report = pgq_cli("spark", "report", "--dsn", dsn, "--out", str(out))
    assert report.returncode == 0, report.stderr
    assert "orders" in report.stdout and "chart:" in report.stdout
    figures = json.loads((out / "report.json").read_text())
    [orders] = [q for q in figures["queues"] if q["queue"] == "orders"]
    assert (orders["acked"], orders["dead"], orders["dead_letters_waiting"]) == (200, 10, 10)
    assert orders["wait_p50_s"] is not None and orders["deliveries_per_job"] == 1.0
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_input_and_bad_format_fail_clearly(tmp_path, dsn):
    odd = tmp_path / "data.xml"
    odd.write_text("<x/>")
    failed = pgq_cli("spark", "ingest", str(odd), "--queue", "q", "--dsn", dsn)
    assert failed.returncode == 2 and "--format" in failed.stderr
    # of a URL the default id would hash only its text: a daily run added nothing new
    url = pgq_cli("spark", "ingest", "s3a://bucket/daily/data.csv", "--queue", "q", "--dsn", dsn)
    assert url.returncode == 2 and "--ingest-id" in url.stderr, url.stderr
