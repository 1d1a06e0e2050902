"""The `pgq` command line through its real entry point (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from pgq.cli import main as cli_main

PGQ = [sys.executable, "-m", "pgq.cli"]


def pgq(*args: str, dsn: str | None = None, input: str | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    extra = ["--dsn", dsn] if dsn else []
    done = subprocess.run([*PGQ, *args, *extra], capture_output=True, text=True, input=input,
                          timeout=60)
    if check and done.returncode != 0:
        raise AssertionError(f"pgq {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr}")
    return done


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*prefix, name)
        if isinstance(command, click.Group):
            yield from all_commands(command, (*prefix, name))


@pytest.mark.parametrize("path", list(all_commands(cli_main)), ids=" ".join)
def test_every_command_has_help(path):
    done = pgq(*path, "--help")
    assert "Usage:" in done.stdout and done.stdout.count("\n") > 3


def test_python_dash_m_pgq_is_the_pgq_command_of_the_pgq_disque_distribution():
    import importlib.metadata

    done = subprocess.run([sys.executable, "-m", "pgq", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "Disque's distributed job queue" in done.stdout
    dist = importlib.metadata.distribution("pgq-disque")
    scripts = {(e.group, e.name): e.value for e in dist.entry_points}
    assert scripts[("console_scripts", "pgq")] == "pgq.cli:main"
    assert scripts[("pytest11", "pgq")] == "pgq.testing"  # the pgq_dsn/pgq_client fixtures


def test_add_get_ack_round_trip_with_json(dsn):
    ids = json.loads(pgq("add", "cli-q", "first", "second", "--retry", "30", "--json", dsn=dsn).stdout)
    assert len(ids) == 2
    assert pgq("qlen", "cli-q", dsn=dsn).stdout.strip() == "2"
    jobs = json.loads(pgq("get", "cli-q", "--count", "5", "--json", dsn=dsn).stdout)
    assert [j["body"] for j in jobs] == ["first", "second"] and [j["id"] for j in jobs] == ids
    shown = json.loads(pgq("show", ids[0], "--json", dsn=dsn).stdout)
    assert shown["state"] == "active" and shown["retry"] == 30
    assert pgq("nack", ids[0], dsn=dsn).stdout.strip() == "1"
    assert pgq("ack", *ids, dsn=dsn).stdout.strip() == "2"
    stat = json.loads(pgq("qstat", "cli-q", "--json", dsn=dsn).stdout)
    assert stat["len"] == 0 and stat["jobs_in"] == 3
    queues = json.loads(pgq("qscan", "--json", dsn=dsn).stdout)
    assert {"queue": "cli-q", "length": 0} in queues


def test_bulk_add_from_a_file_and_jscan(dsn, tmp_path):
    lines = tmp_path / "jobs.txt"
    lines.write_text("".join(f"job {i}\n" for i in range(7000)))
    out = pgq("add", "bulk-cli", "--file", str(lines), "--json", dsn=dsn).stdout
    assert len(json.loads(out)) == 7000
    assert pgq("qlen", "bulk-cli", dsn=dsn).stdout.strip() == "7000"
    listed = json.loads(pgq("jscan", "--queue", "bulk-cli", "--limit", "10", "--json", dsn=dsn).stdout)
    assert len(listed) == 10 and {j["state"] for j in listed} == {"queued"}


def test_pause_and_stats(dsn):
    assert pgq("pause", "p-cli", "in", dsn=dsn).stdout.strip() == "in"
    snapshot = json.loads(pgq("stats", "--json", dsn=dsn).stdout)
    assert {"p-cli"} <= {q["queue"] for q in snapshot["queues"]}
    assert pgq("stats", "--once", dsn=dsn).stdout.count("p-cli") == 1


def test_exit_codes_for_bad_input_and_nothing_found(dsn):
    bad_id = pgq("ack", "not-a-job-id", dsn=dsn, check=False)
    assert bad_id.returncode == 1 and bad_id.stderr.startswith("error: invalid job ID")
    usage = pgq("get", dsn=dsn, check=False)
    assert usage.returncode == 2
    assert pgq("get", "empty-cli", "--nohang", dsn=dsn, check=False).returncode == 3
    assert pgq("qstat", "nothing-cli", dsn=dsn, check=False).returncode == 3
    paused = pgq("pause", "x", "sideways", dsn=dsn, check=False)
    assert paused.returncode == 1 and "allowed" in paused.stderr
    started = time.monotonic()
    unreachable = subprocess.run([*PGQ, "qlen", "q", "--dsn", "postgresql://u:p@127.0.0.1:1/db"],
                                 capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PGQ_DSN": ""})
    took = time.monotonic() - started
    assert unreachable.returncode == 1 and "error:" in unreachable.stderr
    # one line with libpq's cause, at once: the command tries the server once
    # (it retried for 5 s before); 4 s leaves the interpreter's start-up room on a loaded machine
    assert unreachable.stderr.count("\n") == 1 and "Connection refused" in unreachable.stderr
    assert took < 4.0, took


def test_dead_letters_commands(dsn, client):
    job = client.add_job("dl-cli", b"hopeless")
    client.get_job("dl-cli")
    client.dead_letter(job, reason="gave up")
    listed = json.loads(pgq("dead-letters", "list", "--json", dsn=dsn).stdout)
    assert [(d["id"], d["reason"], d["body"]) for d in listed] == [(job, "gave up", "hopeless")]
    assert pgq("dead-letters", "requeue", "--queue", "dl-cli", dsn=dsn).stdout.strip() == "1"
    assert client.qlen("dl-cli") == 1


WORKER_MODULE = '''
import os, time

def handle(job):
    marks = os.environ["MARKS"]
    name = job.id.replace("/", "_")
    open(os.path.join(marks, "start-" + name), "w").close()
    time.sleep(float(job.body))
    open(os.path.join(marks, "done-" + name), "w").close()
'''


def start_worker(dsn: str, tmp_path: Path, grace: float) -> subprocess.Popen:
    (tmp_path / "slowjobs.py").write_text(WORKER_MODULE)
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    return subprocess.Popen([*PGQ, "worker", "slowjobs:handle", "--queue", "slow", "--concurrency", "2",
                             "--grace", str(grace), "--dsn", dsn],
                            cwd=tmp_path, env={**os.environ, "MARKS": str(marks)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_starts(tmp_path: Path, n: int) -> None:
    deadline = time.monotonic() + 20
    while len(list((tmp_path / "marks").glob("start-*"))) < n:
        assert time.monotonic() < deadline, "the worker did not start the jobs"
        time.sleep(0.05)


def test_sigterm_finishes_in_flight_jobs_and_leaves_the_rest_queued(dsn, client, tmp_path):
    ids = client.add_jobs("slow", [b"1.5"] * 6, retry=60)
    worker = start_worker(dsn, tmp_path, grace=10)
    wait_for_starts(tmp_path, 2)
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out
    done = {p.name[5:] for p in (tmp_path / "marks").glob("done-*")}
    assert len(done) == 2 and "2 succeeded" in out
    finished = [i for i in ids if i.replace("/", "_") in done]
    assert all(client.show(i) is None for i in finished)  # acked before exiting
    assert client.qlen("slow") == 4  # never started: still queued, at once


def test_sigterm_past_the_grace_nacks_in_flight_jobs(dsn, client, tmp_path):
    client.add_jobs("slow", [b"30"] * 3, retry=120)
    worker = start_worker(dsn, tmp_path, grace=0.5)
    wait_for_starts(tmp_path, 2)
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0 and time.monotonic() - started < 10, out
    assert "2 interrupted" in out
    assert client.qlen("slow") == 3  # back in the queue at once, not after the 120 s lease
    counters = sorted(j.nacks for j in client.get_job("slow", count=3, withcounters=True))
    assert counters == [0, 1, 1]


def test_text_output_leaves_out_what_does_not_apply(capsys):
    from pgq.cli.common import emit

    # an acked job in a cluster is a tombstone: its counters do not apply
    emit({"id": "D-x", "state": "acked", "ttl": 30, "nacks": None, "body": None}, False)
    assert capsys.readouterr().out.splitlines() == ["id     D-x", "state  acked", "ttl    30"]


def test_migrate_takes_a_node_directory_like_the_other_commands(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pgq", "migrate", "--data", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no running node found in" in done.stderr
