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

from pgq import errors as pgq_errors
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


def test_add_with_priority_and_an_idempotency_key(dsn):
    plain = pgq("add", "cli-p", "plain", dsn=dsn).stdout.strip()
    urgent = pgq("add", "cli-p", "urgent", "--priority", "3", "--key", "order-1", dsn=dsn).stdout.strip()
    assert pgq("add", "cli-p", "retried", "--key", "order-1", dsn=dsn).stdout.strip() == urgent
    jobs = json.loads(pgq("get", "cli-p", "--count", "5", "--json", dsn=dsn).stdout)
    assert [j["id"] for j in jobs] == [urgent, plain]
    shown = json.loads(pgq("show", urgent, "--json", dsn=dsn).stdout)
    assert shown["priority"] == 3 and shown["key"] == "order-1"
    refused = pgq("add", "cli-p", "a", "b", "--key", "k", dsn=dsn, check=False)
    assert refused.returncode == 2 and "--key names one job" in refused.stderr
    bad = pgq("add", "cli-p", "a", "--priority", "-2", dsn=dsn, check=False)
    assert bad.returncode == 2 and "'--priority': -2 is not in the range 0<=x<=1000000" in bad.stderr


def test_wait_for_a_job_to_be_done_with(dsn):
    # issue 13: wait for completion in the CLI too (there was no command)
    job = pgq("add", "cli-w", "x", "--retry", "30", dsn=dsn).stdout.strip()
    pending = pgq("wait", job, "--timeout", "0.2", dsn=dsn, check=False)
    assert pending.returncode == 3 and "not done within 0.2 s" in pending.stderr
    [got] = json.loads(pgq("get", "cli-w", "--json", dsn=dsn).stdout)
    assert pgq("ack", got["id"], dsn=dsn).stdout.strip() == "1"
    assert json.loads(pgq("wait", job, "--json", dsn=dsn).stdout) == {"id": job, "done": True}
    unknown = pgq("wait", job.replace(job[11:19], "++++++++"), dsn=dsn, check=False)
    assert unknown.returncode != 0 and "not held on this node" in unknown.stderr

def test_bulk_add_from_a_file_and_jscan(dsn, tmp_path):
    lines = tmp_path / "jobs.txt"
    lines.write_text("".join(f"job {i}\n" for i in range(7000)))
    out = pgq("add", "bulk-cli", "--file", str(lines), "--json", dsn=dsn).stdout
    assert len(json.loads(out)) == 7000
    assert pgq("qlen", "bulk-cli", dsn=dsn).stdout.strip() == "7000"
    listed = json.loads(pgq("jscan", "--queue", "bulk-cli", "--limit", "10", "--json", dsn=dsn).stdout)
    assert len(listed) == 10 and {j["state"] for j in listed} == {"queued"}


def test_an_add_from_stdin_adds_as_it_reads(dsn, client):
    # The file was read whole before the first add: a pipe added nothing
    # until it closed, and a file larger than memory never did.
    from .conftest import wait_until

    with subprocess.Popen([*PGQ, "add", "stream-cli", "--file", "-", "--dsn", dsn],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdin is not None
            proc.stdin.write("".join(f"job {i}\n" for i in range(5000)))  # one chunk
            proc.stdin.flush()
            wait_until(lambda: client.qlen("stream-cli") == 5000, 30,
                       message="the first chunk added while stdin is still open")
            out, err = proc.communicate("last\n", timeout=60)  # then stdin closes
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert len(out.split()) == 5001 and client.qlen("stream-cli") == 5001


def test_a_path_the_command_cannot_use_is_one_line_of_error(tmp_path):
    # An OSError from deep inside (writing the node's secret under a file)
    # came out as a traceback.
    from pgq.localcluster import free_port

    (tmp_path / "a-file").write_text("")
    done = pgq("node", "start", "--name", "n1", "--bus", f"127.0.0.1:{free_port()}",
               "--data", str(tmp_path / "a-file" / "n1"), check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "Not a directory (check the path and its permissions)" in done.stderr


def test_bad_input_found_by_a_review_is_a_usage_error_or_exit_1_not_a_traceback(tmp_path):
    unreachable = "postgresql://nobody@127.0.0.1:1/x"
    # Standard input closed (<&-): click's RuntimeError came out as a traceback.
    done = subprocess.run([*PGQ, "add", "q", "--file", "-", "--dsn", unreachable],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
                          preexec_fn=lambda: os.close(0))
    assert done.returncode == 2 and "cannot read '-'" in done.stderr and "Traceback" not in done.stderr
    # A node whose database does not answer: what is known is printed, and the
    # exit status says it (it was 0, as for a healthy node).
    done = pgq("node", "status", "--dsn", unreachable, check=False)
    assert done.returncode == 1 and "database_error" in done.stdout
    assert "did not answer" in done.stderr
    # A worker module that does not compile: one line naming the file and line.
    (tmp_path / "brokenjobs.py").write_text("def f(:\n")
    done = subprocess.run([*PGQ, "worker", "brokenjobs:f", "--dsn", unreachable], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "SyntaxError: invalid syntax (brokenjobs.py, line 1)" in done.stderr


def test_the_default_spark_ingest_id_fits_for_any_queue_name():
    # A queue name of 184 characters or more made a default ingest ID
    # over 200 characters, which the ingestion refused once Spark started.
    from pgq.cli.spark import _default_ingest_id

    long_a, long_b = "a" * 512, "a" * 511 + "b"
    assert len(_default_ingest_id((), long_a)) <= 200
    assert _default_ingest_id((), long_a) != _default_ingest_id((), long_b)
    assert _default_ingest_id((), "q").startswith("q-")  # short names keep their ID


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
    subprocess.run([*PGQ, "--help"], capture_output=True, timeout=120)
    baseline = time.monotonic() - started  # the interpreter's start-up and imports, here and now
    started = time.monotonic()
    unreachable = subprocess.run([*PGQ, "qlen", "q", "--dsn", "postgresql://u:p@127.0.0.1:1/db"],
                                 capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PGQ_DSN": ""})
    took = time.monotonic() - started
    assert unreachable.returncode == 1 and "error:" in unreachable.stderr
    # one line with libpq's cause, at once: the command tries the server once
    # (it retried for 5 s before); 2.5 s over a bare start-up of the CLI
    # measured just before leaves room for a loaded machine
    assert unreachable.stderr.count("\n") == 1 and "Connection refused" in unreachable.stderr
    assert took < baseline + 2.5, (took, baseline)


def test_cluster_commands_refuse_a_database_no_node_serves(dsn, client, db):
    # `cluster leaving yes` wrote the mark into a plain database and said it
    # did; every add there then recursed until a RecursionError.
    for args in (("cluster", "leaving", "yes"), ("cluster", "leave", "--timeout", "0"),
                 ("cluster", "meet", "127.0.0.1:7711"), ("cluster", "forget", "a" * 40)):
        done = pgq(*args, dsn=dsn, check=False)
        assert done.returncode == 1 and "not a cluster node" in done.stderr, (args, done.stderr)
    assert db.execute("SELECT count(*) FROM pgq.meta WHERE key = 'leaving'").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM pgq.outbox").fetchone()[0] == 0
    # Marked all the same (by hand, or a node process gone for good): an add
    # says so, with what to do.
    from pgq import contracts

    db.execute(contracts.SET_LEAVING, {"leaving": True})
    db.commit()
    with pytest.raises(pgq_errors.LeavingError, match="leaving no"):
        client.add_job("marked", b"x", replicate=1)
    assert client.qlen("marked") == 0


def test_malformed_cluster_arguments_are_usage_errors_and_a_typo_in_node_wait_says_so(tmp_path):
    # Refused before any connection (the DSN leads nowhere): status 2, as
    # every other malformed argument; they were status 1.
    nowhere = "postgresql://nobody@127.0.0.1:1/none"
    for args, what in ((("cluster", "meet", "nohost"), "'ADDRESS'"),
                       (("cluster", "forget", "abc"), "'NODE_ID'")):
        done = pgq(*args, dsn=nowhere, check=False)
        assert done.returncode == 2 and what in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    # A directory where no node was started: its own timeout, then why.
    done = pgq("node", "wait", "--data", str(tmp_path / "typo"), "--timeout", "0.5", check=False)
    assert done.returncode == 1 and "no node.json there" in done.stderr, done.stderr


def test_limits_past_the_apis_say_which_option(dsn):
    for args in (("stats", "--limit", "9" * 20), ("dead-letters", "list", "--limit", "200000")):
        done = pgq(*args, dsn=dsn, check=False)
        assert done.returncode == 2 and "'--limit'" in done.stderr, done.stderr


def test_stopping_a_node_that_has_not_written_its_pid_names_no_pid(tmp_path):
    # The lock held, the pid not written yet (a node starting): the advice
    # was `kill -9 -1`, which kills every process of the user.
    import fcntl

    (tmp_path / "node.lock").write_text("")
    with open(tmp_path / "node.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = pgq("node", "stop", "--data", str(tmp_path), "--timeout", "0.2", check=False)
    said = done.stderr.replace(str(tmp_path), "DIR")  # pytest's own paths hold "-1" (pytest-100)
    assert done.returncode == 1 and "-1" not in said and "not written its pid" in said


def test_a_dsn_libpq_cannot_parse_is_never_echoed_with_its_password():
    # libpq quotes the bad token, and it may be part of the password.
    for bad in ("postgresql://app:Hunter%zz2@127.0.0.1:1/app",
                "postgresql://app:s3cret@[db/app"):
        done = pgq("qlen", "q", "--dsn", bad, check=False)
        assert done.returncode == 1 and "invalid DSN" in done.stderr, done.stderr
        assert "Hunter" not in done.stderr and "s3cret" not in done.stderr, done.stderr
    from pgq.spark.ingest import _safe

    assert "s3cret" not in _safe("host=db password=s3cret dbname=x")


def test_a_dsn_that_is_not_utf8_is_one_line_of_error_in_every_command(tmp_path):
    bad = "host=db\udcff"  # what the shell hands Python for the byte 0xff
    for args in (("migrate", "--dsn", bad), ("cluster", "nodes", "--dsn", bad),
                 ("cluster", "leaving", "no", "--dsn", bad),
                 ("node", "start", "--name", "n", "--bus", "127.0.0.1:1", "--data",
                  str(tmp_path / "n"), "--dsn", bad)):
        done = subprocess.run([*PGQ, *args], capture_output=True, timeout=60,
                              env={**os.environ, "PGQ_DSN": ""})
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 1 and "Traceback" not in err and "DSN" in err, (args, err)


def test_an_interrupted_add_from_a_file_says_what_a_second_run_would_repeat(capsys):
    from pgq.cli.jobs import _resume_note

    _resume_note(10000, 0, 0, False)
    assert "resume from line 10001" in capsys.readouterr().err
    _resume_note(10000, 5000, 0, False)  # interrupted during a chunk
    err = capsys.readouterr().err
    assert "lines 10001-15000" in err and "in part or whole" in err and "line 15001" in err
    _resume_note(0, 5000, 12, True)  # NOREPL: some of the chunk stayed
    assert "12 of their jobs stayed" in capsys.readouterr().err


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


def test_sigterm_past_the_grace_puts_in_flight_jobs_back_without_a_nack(dsn, client, tmp_path):
    # an interruption is no failure: counted as a nack, it brought a job
    # nearer its dead letter (max_nacks) at every deploy
    client.add_jobs("slow", [b"30"] * 3, retry=120)
    worker = start_worker(dsn, tmp_path, grace=0.5)
    wait_for_starts(tmp_path, 2)
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0 and time.monotonic() - started < 10, out
    assert "2 interrupted" in out
    assert client.qlen("slow") == 3  # back in the queue at once, not after the 120 s lease
    jobs = client.get_job("slow", count=3, withcounters=True)
    assert [j.nacks for j in jobs] == [0, 0, 0]
    assert sorted(j.additional_deliveries for j in jobs) == [0, 1, 1]  # delivered again


def test_a_second_sigterm_ends_the_grace_and_still_nacks(dsn, client, tmp_path):
    """The first signal's handler was removed once it had run: a second
    SIGTERM (or Ctrl-C) killed the worker during its grace, before it
    NACKed its running jobs (they waited out their 120 s lease)."""
    client.add_jobs("slow", [b"30"] * 3, retry=120)
    worker = start_worker(dsn, tmp_path, grace=60)
    wait_for_starts(tmp_path, 2)
    worker.send_signal(signal.SIGTERM)
    seen = []
    while not any("shutting down" in line for line in seen):  # the first one is handled
        line = worker.stdout.readline()
        assert line, "".join(seen)
        seen.append(line)
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=30)
    out = "".join(seen) + out
    # well within the 60 s grace: the second signal ended it
    assert worker.returncode == 0 and time.monotonic() - started < 20, out
    assert "2 interrupted" in out
    assert client.qlen("slow") == 3  # back in the queue at once


def test_text_output_leaves_out_what_does_not_apply(capsys):
    from pgq.cli.common import emit

    # an acked job in a cluster is a tombstone: its counters do not apply
    emit({"id": "D-x", "state": "acked", "ttl": 30, "nacks": None, "body": None}, False)
    assert capsys.readouterr().out.splitlines() == ["id     D-x", "state  acked", "ttl    30"]


def test_migrate_takes_a_node_directory_like_the_other_commands(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pgq", "migrate", "--data", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no running node found in" in done.stderr


def leaf_commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from leaf_commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


@pytest.mark.parametrize("path,command", list(leaf_commands(cli_main)), ids=lambda p: " ".join(p)
                         if isinstance(p, tuple) else "")
def test_every_command_takes_json(path, command):
    if path == ("bench",):  # its options are python -m bench's
        assert "--json" in pgq("bench", "--help").stdout
        return
    assert "--json" in {o for p in command.params for o in getattr(p, "opts", [])}, path


def test_bad_input_is_one_line_and_an_exit_status_never_a_traceback(tmp_path):
    (tmp_path / "binary.token").write_bytes(b"\xff\xfe secret")
    cases = [
        # (arguments, exit status, what stderr says); none touches a database
        (["cluster", "nodes", "--dsn", "bogus"], 1, "error: invalid DSN"),
        (["migrate", "--dsn", "bogus"], 1, "error: invalid DSN"),
        (["node", "wait", "--data", str(tmp_path), "--timeout", "nan"], 2, "finite number"),
        (["jscan", "--limit", "0"], 2, "--limit"),
        (["serve", "--http", "127.0.0.1:0", "--token-file", str(tmp_path / "binary.token")],
         2, "is not UTF-8 text"),
        (["worker", "nomodule:f", "--metrics", "foo"], 2, "--metrics wants HOST:PORT"),
        (["node", "start", "--name", "n", "--bus", "127.0.0.1:1", "--data", str(tmp_path / "n"),
          "--metrics", "bogus"], 2, "--metrics wants HOST:PORT"),  # a traceback, its server left up
        (["worker", ".jobs:handle", "--queue", "q"], 2, "cannot import .jobs"),  # a TypeError
        (["node", "status", "--data", "/dev/null/n1"], 1, "cannot read /dev/null/n1"),
        (["spark", "ingest", str(tmp_path / "missing.csv"), "--queue", "q"], 2,
         "no such file or directory"),
        (["demo", "--jobs", "-5"], 2, "--jobs"),
        # numbers checked before connecting (or starting the embedded
        # server): they came back from the client as exit status 1 after it
        (["get", "q", "--count", "0", "--dsn", "bogus"], 2, "--count"),
        (["get", "q", "--timeout", "-1", "--dsn", "bogus"], 2, "--timeout"),
        (["add", "q", "x", "--delay", "nan", "--dsn", "bogus"], 2, "--delay"),
        (["add", "q", "x", "--priority", "-1", "--dsn", "bogus"], 2, "--priority"),
        (["nack", "D-x", "--delay", "-1", "--dsn", "bogus"], 2, "--delay"),
        (["worker", "json:dumps", "--concurrency", "0", "--dsn", "bogus"], 2, "--concurrency"),
        (["worker", "json:dumps", "--dsn", "bogus"], 2, "--queue NAME"),  # the usage, not the DSN
        # the option named, and a port out of range said as such (a review)
        (["node", "start", "--name", "n", "--bus", "nope", "--data", str(tmp_path / "n")], 1,
         "--bus: expected HOST:PORT, not 'nope'"),
        (["node", "start", "--name", "n", "--bus", "127.0.0.1:1", "--join", "x:99999",
          "--data", str(tmp_path / "n")], 1, "--join: the port of 'x:99999' is not from 1 to 65535"),
    ]
    for args, status, message in cases:
        done = pgq(*args, check=False)
        assert (done.returncode, "Traceback" in done.stderr) == (status, False), (args, done.stderr)
        assert message in done.stderr, (args, done.stderr)
        if status == 1:  # one line: libpq's messages end in a newline, which left a blank one
            assert done.stderr.count("\n") == 1, (args, done.stderr)


def test_data_names_the_node_even_with_pgq_dsn_set(dsn, tmp_path):
    # click filled --dsn from $PGQ_DSN and --data was then ignored: `ack` or
    # `migrate --data DIR` acted on the environment's database.
    node = tmp_path / "n2"
    node.mkdir()
    (node / "node.json").write_text(json.dumps({"dsn": dsn}))
    elsewhere = {**os.environ, "PGQ_DSN": "postgresql://127.0.0.1:1/elsewhere"}
    for args in (["add", "by-data", "x"], ["qlen", "by-data"]):
        done = subprocess.run([*PGQ, *args, "--data", str(node)], env=elsewhere,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    both = subprocess.run([*PGQ, "qlen", "by-data", "--data", str(node), "--dsn", dsn],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "give one" in both.stderr, both.stderr


def test_a_worker_configured_in_code_refuses_the_options_it_would_ignore(tmp_path):
    # `pgq worker MODULE:WORKER --concurrency 16 --dsn ...` ran the worker's
    # own settings and database without a word.
    (tmp_path / "configured.py").write_text(
        "import pgq\n"
        "worker = pgq.Worker('postgresql://127.0.0.1:1/app', queues=['q'], handler=print)\n")
    for extra, named in ((["--concurrency", "16"], "--concurrency"),
                         (["--queue", "other", "--grace", "5"], "--queue, --grace"),
                         (["--dsn", "postgresql://127.0.0.1:1/prod"], "--dsn"),
                         (["--data", str(tmp_path)], "--data")):
        done = subprocess.run([*PGQ, "worker", "configured:worker", *extra], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"configured in its code: {named} would be ignored" in done.stderr, done.stderr


def test_a_body_that_is_not_utf8_is_added_as_its_bytes(dsn):
    # Python reads such an argument with surrogates; encode() refused them.
    done = subprocess.run([*PGQ, "add", "raw", b"\xffok", "--dsn", dsn],
                          capture_output=True, timeout=60)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    import pgq as library

    with library.Client(dsn) as client:
        assert [j.body for j in client.get_job("raw", nohang=True)] == [b"\xffok"]


def test_nothing_found_exits_3_with_json_that_says_so(dsn):
    job = json.loads(pgq("add", "none-cli", "x", "--json", dsn=dsn).stdout)[0]
    assert pgq("ack", job, dsn=dsn).stdout.strip() == "1"
    again = pgq("ack", job, "--json", dsn=dsn, check=False)  # known no more: nothing acked
    assert again.returncode == 3 and json.loads(again.stdout) == {"acked": 0}
    for args in (("nack", job), ("enqueue", job), ("dequeue", job)):
        assert pgq(*args, dsn=dsn, check=False).returncode == 3, args
    assert pgq("deljob", job, dsn=dsn).stdout.strip() == "1"  # its tombstone (Disque: any state)
    assert pgq("deljob", job, dsn=dsn, check=False).returncode == 3
    empty = pgq("qlen", "none-cli", "--json", dsn=dsn, check=False)
    assert empty.returncode == 3 and json.loads(empty.stdout) == {"queue": "none-cli", "length": 0}
    listed = pgq("dead-letters", "list", "--json", dsn=dsn, check=False)
    assert listed.returncode == 3 and json.loads(listed.stdout) == []
    assert pgq("dead-letters", "requeue", dsn=dsn, check=False).returncode == 3
    assert pgq("jscan", "--queue", "none-cli", "--state", "queued", dsn=dsn, check=False).returncode == 3
    assert pgq("periodic", "list", dsn=dsn, check=False).returncode == 3
    assert pgq("show", job.replace(job[2:10], "0" * 8), dsn=dsn, check=False).returncode == 3
    found = pgq("qlen", "none-cli", dsn=dsn, check=False)
    pgq("add", "none-cli", "y", dsn=dsn)
    assert found.returncode == 3 and pgq("qlen", "none-cli", dsn=dsn).returncode == 0


def test_json_has_numbers_iso_times_and_readable_bodies(dsn, client):
    import base64
    import datetime as dt

    raw = b"\xfa\x00binary"
    job = client.add_job("json-cli", raw, retry=30)
    text_job = client.add_job("json-cli", "héllo")
    jobs = json.loads(pgq("get", "json-cli", "--count", "2", "--json", dsn=dsn).stdout)
    by_id = {j["id"]: j for j in jobs}
    assert base64.b64decode(by_id[job]["body_base64"]) == raw and "body" not in by_id[job]
    assert by_id[text_job]["body"] == "héllo"
    shown = json.loads(pgq("show", job, "--json", dsn=dsn).stdout)
    assert base64.b64decode(shown["body_base64"]) == raw and shown["retry"] == 30
    client.dead_letter(job, reason="bad bytes")
    letter = json.loads(pgq("dead-letters", "list", "--json", dsn=dsn).stdout)[0]
    assert dt.datetime.fromisoformat(letter["died_at"]).tzinfo is not None  # ISO-8601 with offset
    assert isinstance(letter["nacks"], int) and base64.b64decode(letter["body_base64"]) == raw
    snapshot = json.loads(pgq("stats", "--json", "--interval", "0.2", dsn=dsn).stdout)
    queue = next(q for q in snapshot["queues"] if q["queue"] == "json-cli")
    assert isinstance(queue["oldest_age_seconds"], (int, float, type(None)))
    assert queue["in_per_s"] == 0 and dt.datetime.fromisoformat(snapshot["at"]).tzinfo is not None
    assert json.loads(pgq("pause", "json-cli", "out", "--json", dsn=dsn).stdout) == {
        "queue": "json-cli", "paused": "out"}


def test_cli_hints_name_the_cli_command(dsn):
    pgq("pause", "hint-cli", "in", dsn=dsn)
    refused = pgq("add", "hint-cli", "x", dsn=dsn, check=False)
    assert refused.returncode == 1
    assert refused.stderr.strip() == ("error: queue 'hint-cli' is paused for input: "
                                      "resume it with `pgq pause hint-cli none`")
    at_most_once = pgq("add", "hint-cli", "x", "--retry", "0", "--replicate", "2", dsn=dsn, check=False)
    assert "--retry 0 (at-most-once delivery) requires --replicate 1" in at_most_once.stderr
    import pgq as library
    from pgq.errors import PausedError

    with library.Client(dsn) as api, pytest.raises(PausedError, match=r"pause\(queue, 'none'\)"):
        api.add_job("hint-cli", b"x")


def test_stats_shows_a_timestamp_and_rates_and_quits_on_q(dsn, client):
    import pty
    import select

    client.add_jobs("live-cli", [b"a", b"b"])
    leader, follower = pty.openpty()
    live = subprocess.Popen([*PGQ, "stats", "--interval", "0.2", "--dsn", dsn], stdin=follower,
                            stdout=follower, stderr=subprocess.PIPE, close_fds=True,
                            env={**os.environ, "COLUMNS": "200", "LINES": "50"})  # a roomy terminal
    os.close(follower)
    screen = b""
    try:
        deadline = time.monotonic() + 30  # start-up of a Python process on a busy machine
        while b"in/s" not in screen or b"live-cli" not in screen:
            assert time.monotonic() < deadline and live.poll() is None, screen.decode(errors="replace")
            if select.select([leader], [], [], 0.5)[0]:
                screen += os.read(leader, 65536)
        assert b"queues at " in screen and b"q to quit" in screen
        os.write(leader, b"q")
        assert live.wait(timeout=20) == 0
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
        os.close(leader)


def test_bodies_and_names_are_never_read_as_markup(dsn, client):
    client.add_job("[red]q[/]", b"[/] not [bold]markup")
    listed = pgq("jscan", dsn=dsn).stdout  # a table: "[/]" used to crash rich (MarkupError)
    assert "[/] not [bold]markup" in listed and "[red]q[/]" in listed
    assert "[red]q[/]" in pgq("stats", "--once", "--interval", "0.1", dsn=dsn).stdout



def test_stats_piped_prints_a_snapshot_per_interval(dsn):
    # A live view prints only when it stops: `pgq stats | grep` showed nothing.
    import selectors

    watching = subprocess.Popen([*PGQ, "stats", "--interval", "0.2", "--dsn", dsn],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
    try:
        seen, deadline = b"", time.monotonic() + 30
        with selectors.DefaultSelector() as selector:
            selector.register(watching.stdout, selectors.EVENT_READ)
            while seen.count(b"queues at") < 2 and time.monotonic() < deadline:
                if selector.select(timeout=1):
                    seen += os.read(watching.stdout.fileno(), 65536)
        assert seen.count(b"queues at") >= 2, seen  # two snapshots, while it runs
    finally:
        watching.terminate()
        watching.wait(20)


def test_an_add_from_a_file_refused_part_way_prints_what_it_added(dsn, tmp_path):
    """The file goes in batches of 5,000, each its own commit: when one is
    refused, the IDs of those before it are printed (a second run would add
    them again) and stderr says where to resume."""
    (tmp_path / "jobs.txt").write_text("".join(f"{i}\n" for i in range(10_000)))
    done = pgq("add", "cli-part", "--file", str(tmp_path / "jobs.txt"), "--maxlen", "7000",
               dsn=dsn, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    ids = done.stdout.split()
    assert len(ids) == 5000 and "resume from line 5001" in done.stderr
    assert "none of them was added" in done.stderr  # a refused chunk is one statement
    assert pgq("qlen", "cli-part", dsn=dsn).stdout.strip() == "5000"


def test_an_add_from_a_file_names_a_line_too_large_and_survives_a_closed_stdout(dsn, tmp_path):
    # A line over the size limit refused its whole chunk, but the note said
    # the chunk "may have been added" and to resume after it (losing 4,999
    # good lines), without naming the line; the hint named a Python option.
    lines = [f"{i}" for i in range(10_000)]
    lines[7341] = "x" * 2000
    (tmp_path / "jobs.txt").write_text("\n".join(lines) + "\n")
    done = pgq("add", "cli-big", "--file", str(tmp_path / "jobs.txt"), "--max-body-size", "1024",
               dsn=dsn, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "line 7342 is 2000 bytes" in done.stderr and "--max-body-size" in done.stderr
    assert "none of them was added): resume from line 5001" in done.stderr, done.stderr
    assert len(done.stdout.split()) == 5000
    assert pgq("qlen", "cli-big", dsn=dsn).stdout.strip() == "5000"
    # `pgq add --file ... | head -1`: stdout closed after the first chunk's
    # IDs went out; it stopped with nothing on stderr.
    (tmp_path / "more.txt").write_text("".join(f"{i}\n" for i in range(20_000)))
    adding = subprocess.Popen([*PGQ, "add", "cli-head", "--file", str(tmp_path / "more.txt"),
                               "--dsn", dsn], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    adding.stdout.readline()
    adding.stdout.close()
    err = adding.stderr.read().decode()
    adding.wait(60)
    assert adding.returncode != 0 and "Traceback" not in err, err
    added = int(pgq("qlen", "cli-head", dsn=dsn).stdout)
    assert f"stdout was closed: {added} jobs were added" in err, (added, err)
    assert f"resume from line {added + 1}" in err, err


def test_listen_addresses_take_bracketed_ipv6():
    from pgq.metrics import parse_listen

    assert parse_listen("[::1]:7780") == ("::1", 7780)
    assert parse_listen("127.0.0.1:80") == ("127.0.0.1", 80)


def test_node_metrics_send_every_node_status_zero_included(dsn):
    # Only the statuses with nodes were sent: when the last alive node went,
    # {status="alive"} vanished instead of reading 0, and an alert on it
    # (alive < 3) never fired.
    from pgq.metrics import _NodeCollector

    snapshot = {"nodes": {"dead": 2}, "bus": {"messages_in": {}, "messages_out": {}, "rejected_total": 0}}
    families = {f.name: f for f in _NodeCollector(dsn, lambda: snapshot).collect()}
    counts = {s.labels["status"]: s.value for s in families["pgq_cluster_nodes"].samples}
    assert counts == {"alive": 0, "suspect": 0, "dead": 2, "left": 0}


def test_a_scrape_that_waits_on_a_lock_gives_up_and_says_so(dsn, monkeypatch):
    # No statement timeout: a scrape behind a lock (a migration, VACUUM FULL)
    # held its thread and connection, and the next ones piled up.
    from pgq import metrics

    from .conftest import TableLock

    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_MS", 300)
    lock = TableLock(dsn, "pgq.queue_counters")
    try:
        lock.take()
        snapshot = {"nodes": {}, "bus": {"messages_in": {}, "messages_out": {}, "rejected_total": 0}}
        began = time.monotonic()
        families = {f.name: f for f in metrics._NodeCollector(dsn, lambda: snapshot).collect()}
        assert time.monotonic() - began < 10  # 0.3 s and the connect; it took the lock's 20 s
        assert [s.value for s in families["pgq_database_up"].samples] == [0]
    finally:
        lock.release()


def test_every_dsn_option_refuses_an_empty_dsn(tmp_path):
    # libpq took '' for its defaults (the local socket, a role named after
    # the OS user): `--dsn "$PGQ_DSN"` with the variable unset reached
    # another database, or failed with a message about role "root".
    for args in (("qlen", "q"), ("migrate",), ("serve", "--http", "127.0.0.1:0"),
                 ("node", "status"), ("spark", "report"),
                 ("node", "start", "--name", "n", "--bus", "127.0.0.1:1", "--data",
                  str(tmp_path / "n"))):
        flag = "--node" if args[0] == "spark" else "--dsn"
        done = pgq(*args, flag, " ", check=False)
        assert done.returncode == 2 and "is empty: give a DSN" in done.stderr, (args, done.stderr)
    assert not (tmp_path / "n").exists()


def test_serve_stops_at_once_on_a_database_it_cannot_use(server, dsn):
    # It served, and /health answered 200 (node ""), while every request
    # failed on the database.
    missing = dsn.replace(dsn.rsplit("/", 1)[-1].split("?")[0], "pgq_no_such_database")
    done = pgq("serve", "--http", "127.0.0.1:0", dsn=missing, check=False)
    assert done.returncode == 1 and "pgq_no_such_database" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_worker_configured_in_code_keeps_its_metrics_and_job_log_level(dsn, tmp_path):
    # The command set the worker's metrics to None (no --metrics) and its
    # job log level to INFO (the option's default), whatever its code said
    # (found by a read-only review).
    (tmp_path / "own.py").write_text(
        "import pathlib\n"
        "import pgq\n"
        "class Metrics:\n"
        "    def observe(self, what, seconds):\n"
        "        pass\n"
        "    def job_done(self, queue, outcome):\n"
        "        pathlib.Path('job-done').write_text(outcome)\n"
        "worker = pgq.Worker(None, queues=['own'], handler=lambda job: None,\n"
        "                    metrics=Metrics(), job_log_level='WARNING')\n")
    import pgq as library

    from .conftest import wait_until

    with library.Client(dsn) as client:
        client.add_job("own", b"x")
    # --dsn: the worker names no database (with none, the command would
    # start the embedded server of the default home, and leave it running)
    process = subprocess.Popen([*PGQ, "worker", "own:worker", "--dsn", dsn], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "job-done").exists(), 60, message="the job done")
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=60)
    assert (tmp_path / "job-done").read_text() == "succeeded"
    assert "WARNING" in err and "own" in err, err
