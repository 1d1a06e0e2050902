"""pgq.Worker against a real database: concurrency, lease extension, failures
with back-off and dead letters, timeouts, transactional mode."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

import anyio
import anyio.lowlevel
import pytest

import pgq
import pgq.testing

from .conftest import wait_until


def run_until(worker: pgq.Worker, predicate, timeout: float = 20.0) -> pgq.worker.WorkerStats:
    """Run the worker in a thread until predicate() is true, then stop it."""
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not predicate():
            assert time.monotonic() < deadline, "worker did not get there in time"
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()
    return worker.stats


def test_sync_handlers_run_concurrently(dsn, client):
    client.add_jobs("conc", [b"%d" % i for i in range(8)])
    running, peak, lock = [0], [0], threading.Lock()

    def handler(job):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.5)
        with lock:
            running[0] -= 1

    worker = pgq.Worker(client, queues=["conc"], handler=handler, concurrency=4)
    start = time.monotonic()
    stats = run_until(worker, lambda: worker.stats.succeeded == 8)
    assert peak[0] == 4 and time.monotonic() - start < 3.5
    assert stats.claimed == 8 and client.qlen("conc") == 0
    assert client.show(client.add_job("conc", b"x")) is not None  # queue still usable


def test_async_handlers_that_await_fill_every_slot(dsn, client):
    # Runners are woken one at a time (a handler that never yields runs a
    # whole claim on one runner): one that awaits must still get a runner
    # for each ready job, up to the concurrency.
    client.add_jobs("aconc", [b"%d" % i for i in range(12)])
    running, peak, full = [0], [0], {}

    async def handler(job):
        every_slot = full.setdefault("event", anyio.Event())  # made in the worker's loop
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        if peak[0] == 4:
            every_slot.set()
        with anyio.move_on_after(5):  # at most: the other three should start within ms
            await every_slot.wait()
        running[0] -= 1

    worker = pgq.Worker(client, queues=["aconc"], handler=handler, concurrency=4)
    stats = run_until(worker, lambda: worker.stats.succeeded == 12)
    assert peak[0] == 4 and stats.claimed == 12 and client.qlen("aconc") == 0


def test_decorator_and_async_handlers(dsn, client):
    worker = pgq.Worker(client, concurrency=10)
    seen = []

    @worker.task("async-q")
    async def handle(job):
        await anyio.sleep(0.2)
        seen.append(job.body)

    client.add_jobs("async-q", [b"a", b"b", b"c"])
    run_until(worker, lambda: len(seen) == 3)
    assert sorted(seen) == [b"a", b"b", b"c"]
    assert client.jscan(queue="async-q")[1] == []  # all acked


def test_a_worker_runs_again_after_it_stopped_and_refuses_two_runs_at_once(dsn, client):
    worker = pgq.Worker(client, concurrency=2)
    seen: list[bytes] = []
    worker.task("again-q")(lambda job: seen.append(job.body))
    client.add_job("again-q", b"first")
    worker.run(install_signal_handlers=False, until_empty=True)
    client.add_job("again-q", b"second")
    run_until(worker, lambda: seen == [b"first", b"second"])  # ends with stop()
    client.add_job("again-q", b"third")
    # The stop ended that run only: this one serves (it returned at once).
    worker.run(install_signal_handlers=False, until_empty=True)
    assert seen == [b"first", b"second", b"third"]

    async def twice() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(worker.run_async)
            with anyio.fail_after(20):
                while not worker._running:  # noqa: ASYNC110 (a test's wait for a flag)
                    await anyio.sleep(0.01)
            with pytest.raises(pgq.errors.InvalidArgumentError, match="running already"):
                await worker.run_async()
            worker.stop()

    anyio.run(twice)


def test_lease_extension_keeps_a_long_job_from_redelivery(dsn, client):
    job_id = client.add_job("long", b"x", retry=1, ttl=60)
    deliveries = []

    def handler(job):
        deliveries.append(job.id)
        time.sleep(3.5)  # 3.5 x retry

    worker = pgq.Worker(client, queues=["long"], handler=handler, concurrency=2)
    thief = pgq.Client(dsn)
    stolen = []

    def steal():
        while not deliveries:  # from the moment the worker holds the job
            time.sleep(0.01)
        for _ in range(33):
            stolen.extend(thief.get_job("long", nohang=True))
            time.sleep(0.1)

    stealer = threading.Thread(target=steal)
    stealer.start()
    stats = run_until(worker, lambda: worker.stats.succeeded == 1)
    stealer.join()
    thief.close()
    assert deliveries == [job_id] and stolen == []
    assert stats.extended >= 5
    assert client.show(job_id) is None  # acked


def test_jobs_waiting_behind_others_of_their_claim_keep_their_leases(dsn, client):
    # Leases were kept from each handler's start: a job waiting behind
    # others of its claim (their handlers busy before their first await)
    # had no WORKING scheduled, and its lease could run out before it
    # started (found by a read-only review). Now from the claim: while the
    # first handler holds the event loop, every job of the claim is watched.
    ids = client.add_jobs("behind", [b"%d" % i for i in range(5)], retry=30, ttl=60)
    holding = threading.Event()
    watched: list[bool] = []

    async def handler(job):
        if not holding.is_set():
            holding.set()
            time.sleep(1.0)  # noqa: ASYNC251 (holds the loop on purpose: the others wait, unstarted)
        await anyio.lowlevel.checkpoint()

    worker = pgq.Worker(client, queues=["behind"], handler=handler, concurrency=5)

    def look():
        holding.wait(30)
        watched.extend(i in worker._leases for i in ids)

    looker = threading.Thread(target=look)
    looker.start()
    run_until(worker, lambda: worker.stats.succeeded == 5)
    looker.join(30)
    assert watched == [True] * 5


def test_failures_back_off_then_go_to_dead_letters(dsn, client, db):
    job_id = client.add_job("flaky", b"payload", retry=30)
    attempts = []

    def handler(job):
        attempts.append(time.monotonic())
        raise RuntimeError("boom")

    worker = pgq.Worker(client, queues=["flaky"], handler=handler, max_nacks=3, backoff=0.3)
    stats = run_until(worker, lambda: worker.stats.dead == 1)
    assert len(attempts) == 3 and stats.failed == 2
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert 0.25 < gaps[0] < 1.5 and gaps[1] > gaps[0]  # 0.3 s, then 0.6 s
    assert client.show(job_id) is None and client.qlen("flaky") == 0
    dead = client.dead_letters("flaky")
    assert [(d["id"], d["body"], d["nacks"]) for d in dead] == [(job_id, b"payload", 2)]
    assert "RuntimeError: boom" in dead[0]["reason"]
    assert db.execute("SELECT outcome FROM pgq.history").fetchone() == ("dead",)
    assert db.execute("SELECT queue, dead FROM pgq.dead_letter_queues").fetchall() == [("flaky", 1)]
    again = client.requeue_dead_letters("flaky")
    assert len(again) == 1 and again[0] != job_id
    assert client.get_job("flaky", nohang=True)[0].body == b"payload"
    assert client.dead_letters("flaky") == []


def _raising(error: BaseException, is_async: bool):
    """A handler that raises ``error`` for the body b"bad" and succeeds otherwise."""
    def check(job: pgq.Job) -> str:
        if job.body == b"bad":
            raise error
        return "ok"

    if not is_async:
        return check

    async def handler(job: pgq.Job) -> str:
        await anyio.lowlevel.checkpoint()
        return check(job)

    return handler


class _Abort(BaseException):
    """A BaseException of the handler's own (pytest's fail() is one)."""


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "def"])
@pytest.mark.parametrize("error", [TimeoutError("read timed out"), asyncio.CancelledError(),
                                   SystemExit(3), KeyboardInterrupt(),
                                   BaseExceptionGroup("child tasks", [SystemExit(3)]), _Abort("no")],
                         ids=["TimeoutError", "CancelledError", "SystemExit", "KeyboardInterrupt",
                              "BaseExceptionGroup", "own BaseException"])
def test_whatever_a_handler_raises_fails_its_job_not_the_worker(dsn, client, error, is_async):
    """A handler's own TimeoutError with no timeout set raised TypeError
    (reporting "timed out after None s"), and a CancelledError, SystemExit
    or KeyboardInterrupt from its code ended the worker without draining:
    the job came back after its retry and did it again, every time."""
    client.add_jobs("raises", [b"bad", b"good"])
    worker = pgq.Worker(client, queues=["raises"], handler=_raising(error, is_async),
                        max_nacks=1, concurrency=1)
    run_until(worker, lambda: worker.stats.dead == 1 and worker.stats.succeeded == 1)
    [dead] = client.dead_letters("raises")
    assert dead["reason"].startswith(f"{type(error).__name__}: ") and "Traceback" in dead["reason"]


def test_a_handlers_own_timeout_error_is_no_timeout_of_the_worker(dsn, client):
    client.add_job("own-timeout", b"bad")
    worker = pgq.Worker(client, queues=["own-timeout"], timeout=30, max_nacks=1,
                        handler=_raising(TimeoutError("read timed out"), True))
    run_until(worker, lambda: worker.stats.dead == 1)
    assert client.dead_letters("own-timeout")[0]["reason"].startswith("TimeoutError: read timed out")


def test_a_failing_metrics_object_or_a_level_name_does_not_end_the_worker(dsn, client):
    class Broken:
        def observe(self, what: str, seconds: float) -> None:
            raise RuntimeError("metrics backend down")

        def job_done(self, queue: str, outcome: str) -> None:
            raise RuntimeError("metrics backend down")

    client.add_jobs("metrics", [b"1", b"2"])
    worker = pgq.Worker(client, queues=["metrics"], handler=lambda job: None, metrics=Broken(),
                        job_log_level="INFO")
    run_until(worker, lambda: worker.stats.succeeded == 2)
    assert worker.job_log_level == logging.INFO
    with pytest.raises(pgq.errors.InvalidArgumentError, match="job_log_level"):
        pgq.Worker(client, queues=["metrics"], handler=lambda job: None, job_log_level="LOUD")


def test_per_job_timeout_counts_as_a_failure(dsn, client):
    client.add_job("slow", b"x", retry=30)

    async def handler(job):
        await anyio.sleep(10)

    worker = pgq.Worker(client, queues=["slow"], handler=handler, timeout=0.3, max_nacks=1)
    run_until(worker, lambda: worker.stats.dead == 1, timeout=10)
    assert "timed out after 0.3 s" in client.dead_letters("slow")[0]["reason"]


def test_a_def_handler_still_running_after_its_timeout_keeps_its_slot(dsn, client):
    """Its thread cannot be stopped: its slot was freed all the same, so a
    handler that hangs ran again beside itself (its job NACKed and claimed
    again), threads grew past the concurrency, and a transactional
    handler's connections ran out."""
    client.add_jobs("hangs", [b"hang", b"next"])
    release, started = threading.Event(), []

    def handler(job: pgq.Job) -> None:
        started.append(job.body)
        if job.body == b"hang":
            release.wait(30)

    worker = pgq.Worker(client, queues=["hangs"], handler=handler, concurrency=1, timeout=0.3,
                        max_nacks=1)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        # Either "next" started beside the hung handler (the bug), or the
        # worker holds its one slot for the abandoned thread, nothing in flight.
        wait_until(lambda: worker.stats.dead == 1 and (
            b"next" in started or (not worker._in_flight and worker._free() == 0)), 20)
        assert started == [b"hang"]
        release.set()  # the thread returns: its slot is free again
        wait_until(lambda: worker.stats.succeeded == 1, 20)
        assert started == [b"hang", b"next"]
    finally:
        release.set()
        worker.stop()
        thread.join(30)


def test_failed_at_most_once_job_is_not_retried(dsn, client):
    kept = client.add_job("once", b"x", retry=0)
    calls = []

    def handler(job):
        calls.append(job.id)
        raise ValueError("nope")

    # by default it goes to the dead letters at once (never delivered again)
    worker = pgq.Worker(client, queues=["once"], handler=handler)
    run_until(worker, lambda: worker.stats.dead == 1)
    assert calls == [kept] and client.show(kept) is None
    assert [d["id"] for d in client.dead_letters("once")] == [kept]
    # with no dead-letter policy at all it is dropped, and logged
    dropped = client.add_job("once", b"y", retry=0)
    worker = pgq.Worker(client, queues=["once"], handler=handler, max_deliveries=None)
    run_until(worker, lambda: worker.stats.failed == 1)
    assert calls == [kept, dropped] and client.show(dropped) is None
    assert [d["id"] for d in client.dead_letters("once")] == [kept]


def test_transactional_mode_commits_writes_and_ack_together(dsn, client, db):
    db.execute("CREATE TABLE done (body text)")
    good = client.add_job("tx", b"good", retry=30)
    bad = client.add_job("tx", b"bad", retry=30)

    def handler(job, conn):
        conn.execute("INSERT INTO done VALUES (%s)", (job.body.decode(),))
        if job.body == b"bad":
            raise RuntimeError("rolled back")

    worker = pgq.Worker(client, queues=["tx"], handler=handler, transactional=True,
                        max_nacks=1)
    run_until(worker, lambda: worker.stats.succeeded == 1 and worker.stats.dead == 1)
    assert db.execute("SELECT body FROM done").fetchall() == [("good",)]
    assert client.show(good) is None and client.show(bad) is None
    assert [d["id"] for d in client.dead_letters("tx")] == [bad]


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_transactional_handler_whose_job_was_acknowledged_elsewhere_rolls_back(client, db,
                                                                                kind):
    """Its lease lapsed and another delivery was acknowledged first: this
    ACK finds no job, and the writes must not count twice (they committed)."""
    db.execute(f"CREATE TABLE late_{kind.split()[0]} (body text)")
    job_id = client.add_job(f"late-{kind}", b"x", retry=30)

    def work(job, conn):
        conn.execute(f"INSERT INTO late_{kind.split()[0]} VALUES ('written')")
        client.ack_job(job.id)  # the other delivery, done with meanwhile

    async def async_work(job, conn):
        await conn.execute(f"INSERT INTO late_{kind.split()[0]} VALUES ('written')")
        await anyio.to_thread.run_sync(client.ack_job, job.id)

    worker = pgq.Worker(client, queues=[f"late-{kind}"], transactional=True,
                        handler=work if kind == "def" else async_work)
    stats = run_until(worker, lambda: worker.stats.failed == 1)
    assert stats.succeeded == 0
    assert db.execute(f"SELECT count(*) FROM late_{kind.split()[0]}").fetchone() == (0,)
    assert client.show(job_id) is None


def test_a_transactional_at_most_once_job_that_expired_while_it_ran_keeps_its_writes(client, db):
    """Its ACK finds no live job (it expired meanwhile), but a retry-0 job has
    no other delivery: this run is its only one, and its writes stand."""
    db.execute("CREATE TABLE expired_once (body text)")
    job_id = client.add_job("expired-once", b"x", retry=0)

    def work(job, conn):
        conn.execute("INSERT INTO expired_once VALUES ('written')")
        db.execute("UPDATE pgq.jobs SET expires_at = now() - interval '1 second' WHERE id = %s",
                   (job.id,))  # its TTL runs out while it runs

    worker = pgq.Worker(client, queues=["expired-once"], transactional=True, handler=work)
    stats = run_until(worker, lambda: worker.stats.succeeded + worker.stats.failed == 1)
    assert stats.succeeded == 1
    assert db.execute("SELECT body FROM expired_once").fetchall() == [("written",)]
    assert client.show(job_id) is None


def test_a_handler_error_whose_message_cannot_be_made_fails_its_job_not_the_worker(client):
    class Coded(Exception):
        def __str__(self) -> str:
            return {1: "known"}[2]  # raises KeyError

    client.add_job("coded", b"bad", retry=30)
    client.add_job("coded", b"good", retry=30)

    def handler(job):
        if job.body == b"bad":
            raise Coded()

    worker = pgq.Worker(client, queues=["coded"], handler=handler, concurrency=1,
                        max_nacks=1)
    stats = run_until(worker, lambda: worker.stats.dead == 1 and worker.stats.succeeded == 1)
    [dead] = client.dead_letters("coded")
    assert dead["reason"].startswith("Coded: <its message could not be made: KeyError>")
    assert stats.claimed == 2


def test_a_plain_function_returning_a_coroutine_has_it_awaited_before_the_ack(client):
    """An async def behind a plain wrapper (a decorator, a lambda): the
    coroutine it returned went unawaited and the job was acknowledged undone."""
    ran: list[str] = []

    async def work(job):
        await anyio.lowlevel.checkpoint()
        ran.append(job.id)
        return "done"

    job_id = client.add_job("wrapped", b"x", retry=30)
    worker = pgq.Worker(client, queues=["wrapped"], handler=lambda job: work(job),
                        keep_results=60)
    run_until(worker, lambda: worker.stats.succeeded == 1)
    assert ran == [job_id]
    assert client.wait_result(job_id, timeout=0) == (b'"done"', None)


def test_a_transactional_handler_given_up_rolls_back_and_keeps_its_result(client, db):
    """A `def` handler past its timeout keeps running in its thread while its
    job is NACKed and runs again: that thread must roll back, or its writes
    count twice. And what a transactional handler returns is kept, in its
    transaction (it was dropped)."""
    db.execute("CREATE TABLE writes (attempt int)")
    job_id = client.add_job("slow-tx", b"x", retry=30)
    backends: list[int] = []
    first_done = threading.Event()

    def handler(job, conn):
        backends.append(conn.info.backend_pid)
        conn.execute("INSERT INTO writes VALUES (%s)", (len(backends),))
        if len(backends) == 1:
            # Past the 0.5 s timeout (the reason for this sleep): the worker
            # gives the job up and NACKs it while this thread goes on.
            time.sleep(1.5)
            first_done.set()
        return {"attempt": len(backends)}

    def first_transaction_ended() -> bool:
        state = db.execute("SELECT state FROM pg_stat_activity WHERE pid = %s",
                           (backends[0],)).fetchone()
        return state is None or state[0] == "idle"

    worker = pgq.Worker(client, queues=["slow-tx"], handler=handler, transactional=True,
                        timeout=0.5, backoff=0.1, keep_results=60)
    run_until(worker, lambda: worker.stats.succeeded == 1 and first_done.is_set()
              and first_transaction_ended())
    assert worker.stats.failed == 1 and len(backends) == 2
    assert db.execute("SELECT attempt FROM writes").fetchall() == [(2,)]
    assert client.wait_result(job_id, timeout=0) == (b'{"attempt":2}', None)
    assert client.show(job_id) is None


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_transactional_handlers_share_pooled_connections(client, db, kind):
    """One connection per slot at most, reused from job to job (a connection
    per job cost ~5 ms of connect and authentication each)."""
    db.execute("CREATE TABLE seen (job text, backend int)")
    ids = client.add_jobs("pooled", [b"x"] * 40, retry=30)
    record = "INSERT INTO seen SELECT %s, pg_backend_pid()"
    if kind == "def":
        def handler(job, conn):
            conn.execute(record, (job.id,))
    else:
        async def handler(job, conn):
            await conn.execute(record, (job.id,))

    worker = pgq.Worker(client, queues=["pooled"], handler=handler, transactional=True,
                        concurrency=4)
    run_until(worker, lambda: worker.stats.succeeded == 40)
    rows = db.execute("SELECT job, backend FROM seen").fetchall()
    assert sorted(job for job, _ in rows) == sorted(ids)  # each committed once, with its ACK
    assert len({backend for _, backend in rows}) <= 4
    assert all(client.show(job_id) is None for job_id in ids)


def test_nack_with_delay_requeues_later_without_counting_a_delivery(client):
    job_id = client.add_job("later", b"x", retry=30)
    client.get_job("later")
    assert client.nack_job(job_id, delay=0.6) == 1
    assert client.get_job("later", nohang=True) == []
    job = client.get_job("later", timeout=3, withcounters=True)[0]
    assert (job.id, job.nacks, job.additional_deliveries) == (job_id, 1, 0)
    assert job.retry == 30 and 86000 < job.ttl <= 86400


def test_bad_worker_configuration_is_explained(client):
    with pytest.raises(pgq.errors.InvalidArgumentError, match="handler"):
        pgq.Worker(client, queues=["q"])
    with pytest.raises(pgq.errors.InvalidArgumentError, match="nothing to do"):
        pgq.Worker(client).run(install_signal_handlers=False)
    worker = pgq.Worker(client)
    with pytest.raises(pgq.errors.InvalidArgumentError, match="unknown task option"):
        worker.task("q", retries=3)(lambda job: None)
    with pytest.raises(pgq.errors.InvalidArgumentError):
        pgq.Worker(client, concurrency=0)
    # Checked when made: each of these made every job fail, or the worker
    # crash or hang, only once it ran.
    for bad in ({"poll_timeout": 0}, {"poll_timeout": -1}, {"batch": 0}, {"timeout": -5},
                {"backoff": float("nan")}, {"max_nacks": 0}, {"grace": -1}):
        with pytest.raises(pgq.errors.InvalidArgumentError):
            pgq.Worker(client, **bad)
    for bad in ({"batch": 2.5}, {"timeout": "5"}, {"max_nacks": "5"}, {"grace": "x"}):
        with pytest.raises(pgq.errors.InvalidTypeError):
            pgq.Worker(client, **bad)
    with pytest.raises(pgq.errors.InvalidArgumentError):
        worker.task("", timeout=1)(lambda job: None)  # not a queue name
    with pytest.raises(pgq.errors.InvalidTypeError):
        worker.task("q2", backoff="1")(lambda job: None)


def test_the_back_off_stops_doubling_before_a_float_overflows():
    from pgq.worker import TaskOptions, backoff_delay

    options = TaskOptions(backoff=0.5, max_backoff=300.0)
    assert [backoff_delay(options, n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert backoff_delay(options, 5000) == 300.0  # 2 ** 4999 overflowed a float


def test_a_handler_error_that_is_no_storable_text_still_dead_letters_its_job(client, caplog):
    # A NUL or a lone surrogate in the error: storing it failed inside the
    # worker, which crashed, and the job came back to crash the next one.
    job_id = client.add_job("nul", b"x", retry=30)

    def handler(job):
        raise ValueError("bad\x00byte and \ud800")

    worker = pgq.Worker(client, queues=["nul"], handler=handler, max_deliveries=1,
                        keep_results=60)
    stats = run_until(worker, lambda: worker.stats.dead == 1)
    assert stats.dead == 1
    [letter] = client.dead_letters("nul")
    assert letter["id"] == job_id and letter["reason"].startswith("ValueError: bad\\x00byte and \\ud800")
    assert client.wait_result(job_id, timeout=0)[1].startswith("ValueError: bad\\x00byte")
    # and the worker's log line is UTF-8 too (a lone surrogate made every
    # UTF-8 log handler fail on it)
    [logged] = [r.getMessage() for r in caplog.records if "failed (ValueError" in r.getMessage()]
    assert logged.encode("utf-8") and "\\ud800" in logged


def test_a_failure_of_a_job_done_with_elsewhere_stores_no_error_and_no_dead_letter(client):
    """Another delivery of the job (its lease lapsed) succeeded and was
    acknowledged; this one then failed its last allowed delivery. The error
    was kept as the job's result over the success, and it counted as dead
    though nothing was dead-lettered."""
    job_id = client.add_job("twice", b"x", retry=30)

    def handler(job):
        client.ack_job(job.id)  # the other delivery, done with meanwhile
        raise ValueError("too late")

    worker = pgq.Worker(client, queues=["twice"], handler=handler, max_deliveries=1,
                        keep_results=60)
    stats = run_until(worker, lambda: worker.stats.failed + worker.stats.dead == 1)
    assert (stats.failed, stats.dead) == (1, 0)
    assert client.dead_letters("twice") == []
    with pytest.raises(pgq.errors.NoJobError):  # nothing stored over it: none will come
        client.wait_result(job_id, timeout=0.1)


def test_an_at_most_once_job_interrupted_at_shutdown_is_dead_lettered_not_lost(client):
    """A NACK never queues a delivered at-most-once job again: interrupted
    after the grace, it stayed active until its TTL and vanished, while the
    log said NACKed. It goes to the dead letters; an at-least-once job
    beside it is queued again at once, without a nack counted (an
    interruption is no failure: it brought the job nearer its dead letter
    under max_nacks at every deploy)."""
    once = client.add_job("cut", b"once", retry=0)
    again = client.add_job("cut", b"again", retry=60)
    started = threading.Event()
    release = threading.Event()

    def handler(job):
        started.set()
        release.wait(30)

    worker = pgq.Worker(client, queues=["cut"], handler=handler, concurrency=2, grace=0.2)
    try:
        stats = run_until(worker, lambda: worker.stats.claimed == 2 and started.is_set())
    finally:
        release.set()  # the abandoned handler threads end
    assert stats.interrupted == 2
    assert [d["id"] for d in client.dead_letters("cut")] == [once]
    assert "interrupted" in client.dead_letters("cut")[0]["reason"]
    [queued] = client.get_job("cut", nohang=True, withcounters=True)
    assert queued.id == again and queued.nacks == 0


def test_by_default_a_failing_job_is_dead_lettered_after_5_deliveries_with_its_traceback(
        client, caplog):
    import logging

    client.add_job("bounded", b"x", retry=30)
    calls = []

    def handler(job):
        calls.append(job.id)
        raise ValueError("no such user")

    worker = pgq.Worker(client, queues=["bounded"], handler=handler, backoff=0.05,
                        job_log_level=logging.INFO)
    with caplog.at_level(logging.INFO, logger="pgq.worker"):
        stats = run_until(worker, lambda: worker.stats.dead == 1)
    assert len(calls) == 5 and (stats.failed, stats.dead) == (4, 1)
    reason = client.dead_letters("bounded")[0]["reason"]
    assert reason.startswith("ValueError: no such user\nTraceback") and "in handler" in reason
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("worker ready: queues bounded, concurrency 4, node ") for m in messages)
    assert not any("password" in m or ":pgq@" in m for m in messages if "worker ready" in m)
    assert sum("Traceback" in m for m in messages) == 5  # each failure, with its traceback
    assert sum(m.endswith(" of bounded failed") for m in messages) == 4  # one line per job
    assert sum(m.endswith(" of bounded dead") for m in messages) == 1


def test_a_worker_keeps_results_when_told(client):
    ids = client.add_jobs("kept", [b"bytes", b"none", b"data"], retry=30)

    def handler(job):
        return {b"bytes": b"\x00raw", b"none": None, b"data": [1, "two"]}[job.body]

    pgq.testing.run_jobs(pgq.Worker(client, queues=["kept"], handler=handler, keep_results=60))
    assert [client.wait_result(i, timeout=0) for i in ids] == [
        (b"\x00raw", None), (None, None), (b'[1,"two"]', None)]
    plain = client.add_job("kept", b"data", retry=30)
    pgq.testing.run_jobs(pgq.Worker(client, queues=["kept"], handler=handler))
    with pytest.raises(pgq.errors.NoJobError, match="keeps none"):  # not kept unless asked
        client.wait_result(plain, timeout=0)


def test_a_result_that_cannot_be_encoded_acknowledges_the_job_and_says_why(client):
    # The encoder raised outside the worker's guard: the worker crashed and
    # the job, never acknowledged, crashed the next worker too.
    job_id = client.add_job("unkept", b"x", retry=30)

    def refuse(value):
        raise pgq.errors.InvalidTypeError(f"{type(value).__name__} is not JSON")

    worker = pgq.Worker(client, queues=["unkept"], handler=lambda job: {1, 2},
                        keep_results=60, encode_result=refuse)
    stats = pgq.testing.run_jobs(worker)
    assert stats.succeeded == 1 and client.qlen("unkept") == 0
    assert client.show(job_id) is None or client.show(job_id)["state"] == "acked"
    value, error = client.wait_result(job_id, timeout=0)
    assert value is None and "could not be kept: InvalidTypeError: set is not JSON" in error



def test_a_result_too_big_to_keep_acknowledges_the_job_and_says_why(client):
    # The store refused it (past the client's max_body_size) after the
    # handler succeeded: the job was acknowledged with no result, and
    # Tasks.result said NoJobError ("keeps none"), as if never asked to keep.
    from pgq.core import ClientOptions

    job_id = client.add_job("huge", b"x", retry=30)
    cap = ClientOptions().max_body_size
    worker = pgq.Worker(client, queues=["huge"], handler=lambda job: b"r" * (cap + 1), keep_results=60)
    stats = pgq.testing.run_jobs(worker)
    assert stats.succeeded == 1 and client.qlen("huge") == 0 and client.show(job_id) is None
    value, error = client.wait_result(job_id, timeout=0)
    assert value is None and error.startswith(pgq.worker.RESULT_NOT_KEPT) and f"at most {cap} bytes" in error


def test_a_result_the_database_did_not_take_is_kept_by_the_next_run(client, monkeypatch):
    # The database went away between the handler's end and its result's
    # store: the job was acknowledged all the same (its ACK retried until
    # the database came back), its result lost for good. Now the job is not
    # acknowledged: it comes back after its retry and runs again.
    from .conftest import wait_until

    stored = pgq.AsyncClient.store_result
    failures = [pgq.errors.DatabaseUnavailableError("the database is away")]

    async def store_once_away(self, *args, **kwargs):
        if failures:
            raise failures.pop()
        await stored(self, *args, **kwargs)

    monkeypatch.setattr(pgq.AsyncClient, "store_result", store_once_away)
    job_id = client.add_job("kept-later", b"x", retry=3)  # (a slow run must not see it back)
    once = client.add_job("kept-later", b"y", retry=0)  # ran once: acknowledged all the same
    runs: list[bytes] = []

    def handler(job):
        runs.append(job.body)
        return {"run": len(runs)}

    worker = pgq.Worker(client, queues=["kept-later"], handler=handler, keep_results=60, concurrency=1)
    assert pgq.testing.run_jobs(worker).succeeded == 2
    assert client.show(job_id)["state"] == "active" and client.show(once) is None
    wait_until(lambda: client.qlen("kept-later") == 1, 15, message="the job back after its retry")
    # each run counts its own (the second said 3: the sums of every run)
    assert pgq.testing.run_jobs(worker).succeeded == 1 and worker.stats.claimed == 1
    assert runs == [b"x", b"y", b"x"] and client.show(job_id) is None
    assert client.wait_result(job_id, timeout=0) == (b'{"run":3}', None)
    assert client.wait_result(once, timeout=0) == (b'{"run":2}', None)


def test_a_result_refused_for_good_does_not_run_the_job_again(client, monkeypatch):
    # Not away but refused (no right to write pgq.results, say): the job was
    # left unacknowledged and ran again at every retry until its TTL (found
    # by a review); it is acknowledged without its result.
    import psycopg

    async def refuse(self, *args, **kwargs):
        raise psycopg.errors.InsufficientPrivilege("permission denied for table results")

    monkeypatch.setattr(pgq.AsyncClient, "store_result", refuse)
    job_id = client.add_job("refused", b"x", retry=30)
    worker = pgq.Worker(client, queues=["refused"], handler=lambda job: 1, keep_results=60)
    assert pgq.testing.run_jobs(worker).succeeded == 1
    assert client.show(job_id) is None


class _AwayDatabase:
    """The worker's client while its database is away: each call raises
    what pgq.AsyncClient raises then (a unit test of the worker's rule for
    it; the client's own reconnecting is tested against a real server)."""

    def __init__(self) -> None:
        self.away = True
        self.acked: list[tuple[str, ...]] = []

    async def ack_job(self, *ids: str) -> int:
        if self.away:
            raise pgq.errors.DatabaseUnavailableError("the database is away")
        self.acked.append(ids)
        return len(ids)

    async def nack_job(self, *ids: str, delay: float | None = None) -> int:
        raise pgq.errors.DatabaseUnavailableError("the database is away")


def test_a_database_away_neither_ends_the_worker_nor_loses_its_acks():
    """An ACK or a NACK the database could not take used to end the worker
    (and drop the IDs taken for the ACK)."""
    from pgq.worker import _JobFailed

    worker = pgq.Worker("dbname=unused", concurrency=1)
    worker.task("q")(lambda job: None)
    away = _AwayDatabase()

    async def main() -> None:
        worker.client = away  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        worker._ack_later("a")
        worker._ack_later("b")
        assert await worker._flush_acks() is False
        assert worker._acks == ["a", "b"] and worker._acks_ready.is_set()
        worker._ack_later("c")
        away.away = False
        assert await worker._flush_acks() is True
        assert away.acked == [("a", "b", "c")] and worker._acks == []
        job = pgq.Job("D-x", "q", b"", nacks=0, additional_deliveries=0, retry=5.0)
        await worker._failed(worker.tasks["q"], job, _JobFailed("boom"))  # its NACK fails
        assert worker.stats.failed == 1

    anyio.run(main)


class _Settling:
    """The worker's client where a drain's end settles jobs: it records what
    is given back, dead-lettered and acknowledged, and lets the event loop
    turn in each call (a unit test of the worker's rules at its stop; the
    statements themselves are tested against a real server)."""

    def __init__(self) -> None:
        self.given_back: list[str] = []
        self.dead: list[str] = []
        self.acked: list[tuple[str, ...]] = []
        self.ack_started = anyio.Event()
        self.release_ack: anyio.Event | None = None  # the first ACK waits for it, then fails
        self.nacked: list[tuple[tuple[str, ...], float | None]] = []  # (ids, delay)
        self.nack_started = anyio.Event()
        self.release_nack: anyio.Event | None = None  # the first NACK waits for it

    def ids_command(self, name: str, ids: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        return name, ids

    def store_result_command(self, *args: object) -> None:
        """(The worker checks a result is storable with it before the store.)"""

    async def _run(self, command: tuple[str, tuple[str, ...]]) -> int:
        await anyio.lowlevel.checkpoint()
        name, ids = command
        assert name == "give_back_jobs"
        self.given_back.extend(ids)
        return len(ids)

    async def dead_letter(self, *ids: str, reason: str) -> int:
        await anyio.lowlevel.checkpoint()
        self.dead.extend(ids)
        return len(ids)

    async def ack_job(self, *ids: str) -> int:
        self.ack_started.set()
        if self.release_ack is not None:
            release, self.release_ack = self.release_ack, None
            await release.wait()
            raise pgq.errors.DatabaseUnavailableError("the database is away")
        self.acked.append(ids)
        return len(ids)

    async def nack_job(self, *ids: str, delay: float | None = None) -> int:
        self.nack_started.set()
        if self.release_nack is not None:
            release, self.release_nack = self.release_nack, None
            await release.wait()
        self.nacked.append((ids, delay))
        return len(ids)


def _job(n: int, retry: float) -> pgq.Job:
    return pgq.Job(f"D-{n}", "q", b"", nacks=0, additional_deliveries=0, retry=retry)


async def _hand_over(worker: pgq.Worker, jobs: anyio.abc.TaskGroup, job: pgq.Job) -> None:
    """One runner in ``jobs``, parked; then ``job`` handed to it as a claim
    does (in flight, ready, a runner woken), with no turn of the loop after."""
    jobs.start_soon(worker._runner)
    while not worker._idle:  # the runner parks
        await anyio.lowlevel.checkpoint()
    worker._in_flight[job.id] = job
    worker._ready.append(job)
    worker._wake_runner()


async def _finish_as_the_drain_ends(worker: pgq.Worker, jobs: anyio.abc.TaskGroup, job: pgq.Job,
                                    release: anyio.Event) -> None:
    """``job`` handed to a runner whose handler waits on ``release``; then the
    handler let go (its result or failure is due) as the drain's end comes,
    with no turn of the loop between: the runner's wake-up is due, so the
    cancellation skips it; then the run's unsettled jobs are given up."""
    await _hand_over(worker, jobs, job)
    while worker._ready:  # the runner took it: the handler waits
        await anyio.lowlevel.checkpoint()
    release.set()
    jobs.cancel_scope.cancel()
    await worker._interrupt(worker._unsettled(), "a test's stop")


def test_a_job_given_back_unstarted_is_not_started_by_the_runner_woken_for_it():
    """The drain's end (grace 0, or a second signal) gives back the jobs no
    handler saw, at-most-once ones too. A runner woken for one of them is
    not cancelled (its wake-up was due), and it started the job while the
    job went back to its queue: an at-most-once job could run twice (found
    by a read-only review)."""
    worker = pgq.Worker("dbname=unused", concurrency=1, grace=0)
    ran: list[str] = []

    @worker.task("q")
    async def handle(job: pgq.Job) -> None:
        ran.append(job.id)

    client = _Settling()

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        job = _job(1, retry=0.0)
        async with anyio.create_task_group() as jobs:
            await _hand_over(worker, jobs, job)
            # The drain's end, with no turn of the loop between:
            jobs.cancel_scope.cancel()
            await worker._interrupt({job.id: job}, "a test's stop")
        assert ran == [] and client.given_back == [job.id] and client.dead == []

    anyio.run(main)


def test_a_job_that_finishes_as_it_is_given_up_is_acknowledged_once_and_counted_once():
    """A handler whose result came in as the drain's end gave its job back
    was acknowledged as well, and counted both interrupted and succeeded."""
    worker = pgq.Worker("dbname=unused", concurrency=1)
    release = []

    @worker.task("q")
    async def handle(job: pgq.Job) -> None:
        await release[0].wait()

    client = _Settling()

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        release.append(anyio.Event())
        job = _job(2, retry=5.0)
        async with anyio.create_task_group() as jobs:
            await _finish_as_the_drain_ends(worker, jobs, job, release[0])  # its result is due
        assert client.given_back == [job.id]
        assert worker._acks == [job.id]  # finished: acknowledged, not run again for nothing
        assert (worker.stats.interrupted, worker.stats.succeeded) == (1, 0)

    anyio.run(main)


@pytest.mark.parametrize("retry", [0.0, 5.0])
def test_a_job_keeping_its_result_at_the_drains_end_is_settled_not_given_back(retry):
    """A job whose handler returned and that was storing its result when the
    grace ran out was given back (or dead-lettered) and acknowledged too;
    then the drain's end cut its store off, and it was acknowledged with its
    result lost. Now the store goes on (SETTLE_MAX more); a second signal
    cuts it off, and then an at-least-once job is not acknowledged (it runs
    again after its retry, keeping its result then)."""
    worker = pgq.Worker("dbname=unused", concurrency=1, keep_results=60)

    @worker.task("q")
    async def handle(job: pgq.Job) -> str:
        return "done"

    client = _Settling()
    storing, stored = anyio.Event(), []
    release: list[anyio.Event] = []

    async def store_result(job_id: str, value: object, error: object, keep: float) -> None:
        storing.set()
        await release[0].wait()  # the result's round trip, as the drain ends
        stored.append((job_id, value))

    client.store_result = store_result  # type: ignore[attr-defined]

    async def drain_end(second_signal: bool) -> pgq.Job:
        job = _job(3, retry=retry)
        release[:] = [anyio.Event()]
        async with anyio.create_task_group() as jobs:
            await _hand_over(worker, jobs, job)
            await storing.wait()
            left = worker._unsettled()  # as the drain's end reads them
            worker._bound_settling(0.0 if second_signal else pgq.worker.SETTLE_MAX)
            jobs.cancel_scope.cancel()
            await worker._interrupt(left, "a test's stop")
            assert left == {}
            if not second_signal:
                release[0].set()  # the store's answer comes after the cancellation
        assert client.given_back == [] and client.dead == []
        return job

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        job = await drain_end(second_signal=False)
        assert stored == [(job.id, b'"done"')] and worker._acks == [job.id]
        worker._new_run(until_empty=False)
        storing.__init__()  # type: ignore[misc]
        job = await drain_end(second_signal=True)
        assert stored == [(job.id, b'"done"')]  # the second store was cut off
        assert worker._acks == ([job.id] if retry == 0 else [])  # at-most-once: it never runs again

    anyio.run(main)


def test_a_failure_being_nacked_at_the_drains_end_keeps_its_back_off():
    """The drain's end cancelled the NACK of a job whose handler had failed:
    it came back after its retry, not its back-off, and its failure counted
    for nothing towards max_nacks."""
    worker = pgq.Worker("dbname=unused", concurrency=1, backoff=7)

    @worker.task("q")
    async def handle(job: pgq.Job) -> None:
        raise ValueError("no")

    client = _Settling()
    client.release_nack = release = anyio.Event()

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        job = _job(4, retry=5.0)
        async with anyio.create_task_group() as jobs:
            await _hand_over(worker, jobs, job)
            await client.nack_started.wait()
            left = worker._unsettled()
            worker._bound_settling(pgq.worker.SETTLE_MAX)
            jobs.cancel_scope.cancel()
            await worker._interrupt(left, "a test's stop")
            release.set()
        assert left == {} and client.given_back == [] and client.nacked == [((job.id,), 7.0)]
        assert worker.stats.failed == 1

    anyio.run(main)


def test_an_at_most_once_failure_cut_off_while_settled_is_dead_lettered_at_the_end():
    """A second signal cut off the dead letter of an at-most-once job whose
    handler had failed: the shielded scope swallowed the cut, and the job
    was in no queue and no dead letter, never delivered again (found by a
    review of the settling scopes). It is settled with the run's cut jobs."""
    worker = pgq.Worker("dbname=unused", concurrency=1)

    @worker.task("q")
    async def handle(job: pgq.Job) -> None:
        raise ValueError("no")

    client = _Settling()
    letting, recorded = anyio.Event(), client.dead_letter

    async def dead_letter_hangs_once(*ids: str, reason: str) -> int:
        if not letting.is_set():
            letting.set()
            await anyio.sleep_forever()  # the database does not answer in time
        return await recorded(*ids, reason=reason)

    client.dead_letter = dead_letter_hangs_once  # type: ignore[method-assign]

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        job = _job(7, retry=0.0)
        async with anyio.create_task_group() as jobs:
            await _hand_over(worker, jobs, job)
            await letting.wait()
            assert worker._unsettled() == {}  # being settled: not the drain's to give back
            worker._bound_settling(0.0)  # a second signal
            jobs.cancel_scope.cancel()
        assert list(worker._cut) == [job.id]
        await worker._interrupt(dict(worker._cut), "cut off as the worker stopped")
        assert client.dead == [job.id] and client.given_back == []
        assert (worker.stats.failed, worker.stats.interrupted) == (0, 1)  # counted once

    anyio.run(main)


def test_a_job_failing_as_it_is_given_up_is_not_nacked_after():
    """A handler that failed in the turn the drain's end gave its job back
    went on to NACK it (now that settling is shielded): a back-off on a job
    another worker may hold by then, and counted failed and interrupted."""
    worker = pgq.Worker("dbname=unused", concurrency=1)
    release: list[anyio.Event] = []

    @worker.task("q")
    async def handle(job: pgq.Job) -> None:
        await release[0].wait()
        raise ValueError("no")

    client = _Settling()

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        release.append(anyio.Event())
        job = _job(8, retry=5.0)
        async with anyio.create_task_group() as jobs:
            await _finish_as_the_drain_ends(worker, jobs, job, release[0])  # it fails
        assert client.given_back == [job.id] and client.nacked == []
        assert (worker.stats.failed, worker.stats.interrupted) == (0, 1)

    anyio.run(main)


def test_a_failure_waiting_for_its_working_as_the_job_is_given_up_is_not_nacked():
    """A failed job waits for its WORKING in flight before it is settled; the
    WORKING's answer came in the turn the drain's end gave the job back, and
    anyio does not cancel a task whose wake-up is due: the failure was then
    NACKed (or dead-lettered) beside the give-back (found by a review)."""
    worker = pgq.Worker("dbname=unused", concurrency=1)
    failing = anyio.Event()

    @worker.task("q")
    async def handle(job: pgq.Job) -> None:
        failing.set()
        raise ValueError("no")

    client = _Settling()

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        job = _job(9, retry=5.0)
        worker._extending[job.id] = extending = anyio.Event()  # a WORKING in flight
        async with anyio.create_task_group() as jobs:
            await _hand_over(worker, jobs, job)
            await failing.wait()
            for _ in range(5):  # the runner reaches the wait for the WORKING
                await anyio.lowlevel.checkpoint()
            extending.set()  # its answer, in the same turn as the drain's end
            left = worker._unsettled()
            jobs.cancel_scope.cancel()
            del worker._extending[job.id]
            await worker._interrupt(left, "a test's stop")
        assert client.given_back == [job.id] and client.nacked == []
        assert (worker.stats.failed, worker.stats.interrupted) == (0, 1)

    anyio.run(main)


def test_the_runs_last_ack_flush_waits_for_one_in_flight():
    """The last flush found the IDs taken by a flush still in flight, said
    nothing, and when that one failed its IDs were never acknowledged."""
    worker = pgq.Worker("dbname=unused", concurrency=1)
    client = _Settling()

    async def main() -> None:
        worker.client = client  # type: ignore[assignment]
        worker._new_run(until_empty=False)
        client.release_ack = release = anyio.Event()
        worker._ack_later("D-a")
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(worker._flush_acks, last=False))  # the flushing task's
            await client.ack_started.wait()
            last = []

            async def last_flush() -> None:
                last.append(await worker._flush_acks())

            tasks.start_soon(last_flush)
            release.set()  # the one in flight fails: its IDs come back
        assert last == [True] and client.acked == [("D-a",)] and worker._acks == []
        # The flushing task's flushes stop once the last one began (shielded,
        # they went on retrying a database that was away, and the stop
        # waited for them too).
        worker._ack_later("D-b")
        assert await worker._flush_acks(last=False) is True
        assert client.acked == [("D-a",)] and worker._acks == ["D-b"]

    anyio.run(main)


def test_requeued_dead_letters_commit_durably_on_a_cluster_node(dsn, db):
    """On a node of a cluster the new jobs write outbox events, and the
    doorbell that wakes the node process relaxed the commit of the whole
    transaction it ran in: a crash right after could lose the new jobs and
    bring the dead letters back. A deferred trigger sees the commit's setting."""
    db.execute("""INSERT INTO pgq.dead_letters (id, queue, body, nacks, additional_deliveries,
                      deliveries, ctime, retry, repl)
                  VALUES ('D-dead', 'q', 'x', 3, 0, 3, 0, 60, 1)""")
    db.execute("CREATE TABLE pgq.test_commit_settings (setting text)")
    db.execute("""CREATE FUNCTION pgq.test_log_commit() RETURNS trigger LANGUAGE plpgsql AS $$
                  BEGIN INSERT INTO pgq.test_commit_settings
                        VALUES (current_setting('synchronous_commit')); RETURN NULL; END $$""")
    db.execute("""CREATE CONSTRAINT TRIGGER log_commit AFTER DELETE ON pgq.dead_letters
                  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pgq.test_log_commit()""")
    # A node process at work (its heartbeat) with one peer alive: adds replicate.
    db.execute("""INSERT INTO pgq.meta (key, value)
                  VALUES ('heartbeat_at', now()::text), ('bus_host', '127.0.0.1'), ('bus_port', '7998')
                  ON CONFLICT (key) DO UPDATE SET value = excluded.value""")
    db.execute("""INSERT INTO pgq.nodes (id, host, port, status)
                  VALUES (repeat('b', 40), '127.0.0.1', 7999, 'alive')""")
    with pgq.Client(dsn) as client:
        assert len(client.requeue_dead_letters("q")) == 1
    assert db.execute("SELECT count(*) FROM pgq.outbox").fetchone()[0] > 0  # the doorbell's case
    assert db.execute("SELECT setting FROM pgq.test_commit_settings").fetchall() == [("on",)]


def test_a_def_handler_runs_in_the_context_of_the_worker(client):
    """Context variables (a tracing span, a logging or error-reporting scope)
    reach a plain `def` handler's thread, as they reach an async one."""
    import contextvars

    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")
    seen: list[str] = []
    client.add_job("ctx", b"x", retry=30)
    worker = pgq.Worker(client, queues=["ctx"], handler=lambda job: seen.append(request_id.get()))

    def serve() -> None:
        request_id.set("set by the worker's caller")
        worker.run(install_signal_handlers=False)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        wait_until(lambda: worker.stats.succeeded == 1, 20)
    finally:
        worker.stop()
        thread.join(30)
    assert seen == ["set by the worker's caller"]


def test_a_cancelled_run_puts_its_jobs_back_and_sends_its_acks(client):
    """An app's shutdown cancels the task of run_async(): no drain then, but
    the job in flight went to nobody until its retry and the finished one's
    pending ACK was dropped."""
    slow = client.add_job("cancelled-run", b"slow", retry=300)
    fast = client.add_job("cancelled-run", b"fast", retry=300)
    started, release = threading.Event(), threading.Event()

    def handler(job):
        if job.body == b"slow":
            started.set()
            release.wait(30)

    worker = pgq.Worker(client, queues=["cancelled-run"], handler=handler, concurrency=2)

    async def main() -> None:
        task = asyncio.create_task(worker.run_async(install_signal_handlers=False))
        while not (started.is_set() and worker.stats.succeeded == 1):  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # a poll of the worker's progress
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        release.set()  # the abandoned handler thread ends
    assert client.show(fast) is None  # acknowledged
    shown = client.show(slow)
    assert shown["state"] == "queued" and shown["nacks"] == 0
    assert worker.stats.interrupted == 1


def test_run_until_empty_claims_again_after_a_failed_claim(client, monkeypatch):
    # A failed claim (the database away a moment) was taken for "nothing
    # ready": run_jobs returned with the jobs still queued (found by a
    # read-only review). The claim fails once here; the jobs all run.
    from pgq.testing import run_jobs

    client.add_jobs("blip", [b"1", b"2", b"3"], retry=30)
    real = pgq.AsyncClient.get_job
    failed: list[bool] = []

    async def get_job(self, *queues, **options):
        if not failed:
            failed.append(True)
            raise pgq.errors.DatabaseUnavailableError("the database is away a moment")
        return await real(self, *queues, **options)

    monkeypatch.setattr(pgq.AsyncClient, "get_job", get_job)
    done: list[bytes] = []
    worker = pgq.Worker(client, queues=["blip"], handler=lambda job: done.append(job.body))
    stats = run_jobs(worker)
    assert failed and sorted(done) == [b"1", b"2", b"3"] and stats.succeeded == 3


def test_the_applications_signal_handlers_are_back_after_a_run(client):
    # The signal receiver's exit left the default handlers: a program that
    # went on after worker.run() was killed by its next SIGTERM without its
    # own clean-up (found by a read-only review).
    import signal

    def mine(signum, frame):
        pass

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, mine)
    try:
        client.add_job("signals", b"x")
        worker = pgq.Worker(client, queues=["signals"], handler=lambda job: None)
        worker.run(install_signal_handlers=True, until_empty=True)
        assert worker.stats.succeeded == 1
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
