"""pgq.Tasks: functions deferred with keyword arguments, run by a worker that
finds them by name; wrong calls fail in the caller; transactional defers;
unknown tasks end in the dead letters."""

from __future__ import annotations

import functools
import json

import psycopg
import pytest

import pgq
from pgq.errors import InvalidArgumentError, InvalidTypeError
from pgq.testing import run_jobs


def make_app(client, calls):
    app = pgq.Tasks(client)

    @app.task(queue="mail", retry=30)
    def send_email(to: str, subject: str = "Welcome") -> None:
        calls.append(("mail", to, subject))

    @app.task(name="billing.charge")
    async def charge(customer: int, cents: int) -> None:
        calls.append(("charge", customer, cents))

    return app, send_email, charge


def test_deferred_calls_run_with_their_arguments(client):
    calls = []
    app, send_email, charge = make_app(client, calls)
    first = send_email.defer(to="ada@example.com")
    send_email.defer_many([{"to": "bob@example.com", "subject": "Hi"}, {"to": "eve@example.com"}])
    charge.defer(customer=7, cents=1250)
    body = json.loads(client.show(first)["body"])
    assert body == {"task": f"{__name__}.make_app.<locals>.send_email",
                    "kwargs": {"to": "ada@example.com"}}
    assert client.show(first)["retry"] == 30
    stats = run_jobs(app.worker(concurrency=2))
    assert stats.succeeded == 4
    assert sorted(calls) == [("charge", 7, 1250), ("mail", "ada@example.com", "Welcome"),
                             ("mail", "bob@example.com", "Hi"), ("mail", "eve@example.com", "Welcome")]
    assert app.queues() == ["mail", "charge"]
    send_email(to="direct")  # still a plain function
    assert calls[-1] == ("mail", "direct", "Welcome")


def test_calls_sent_to_another_queue_are_served_by_a_worker_told_so(client):
    """using(queue=...) sends a call elsewhere: app.worker() read only the
    tasks' own queues (the job waited out its TTL unread), and
    app.worker(queues=...) was a TypeError."""
    calls = []
    app, send_email, _charge = make_app(client, calls)
    send_email.using(queue="urgent-mail").defer(to="now@example.com")
    worker = app.worker(queues=["urgent-mail"], concurrency=1)
    assert run_jobs(worker).succeeded == 1
    assert calls == [("mail", "now@example.com", "Welcome")]
    assert client.qlen("urgent-mail") == 0


def test_a_wrong_call_fails_in_the_caller_and_adds_nothing(client):
    app, send_email, _ = make_app(client, [])
    with pytest.raises(InvalidArgumentError, match="missing a required argument: 'to'"):
        send_email.defer(subject="x")
    with pytest.raises(InvalidArgumentError, match="unexpected keyword argument"):
        send_email.defer(to="a", cc="b")
    with pytest.raises(InvalidTypeError, match="JSON"):
        send_email.defer(to=object())
    with pytest.raises(InvalidTypeError, match="JSON"):  # NaN is no JSON: jsonb refuses it
        send_email.defer(to="a", subject=float("nan"))
    # A key that is no str: json.dumps wrote it as one, and {1: 'a', '1': 'b'}
    # came back {'1': 'b'} without a word.
    with pytest.raises(InvalidTypeError, match="a dict key of type int"):
        send_email.defer(to="a", subject=[{"x": {1: "a", "1": "b"}}])  # type: ignore[arg-type]
    assert client.qlen("mail") == 0
    with pytest.raises(InvalidArgumentError, match="unknown option"):
        send_email.using(prority=3)  # a typo
    with pytest.raises(InvalidArgumentError):  # it fell back to the task's queue
        send_email.using(queue="")
    assert client.qlen("mail") == 0


def test_a_task_without_a_queue_name_is_refused_when_made(client):
    app = pgq.Tasks(client)
    with pytest.raises(InvalidArgumentError):  # it became the queue 'send'
        app.task("")(lambda to: None)
    with pytest.raises(InvalidArgumentError, match="queue="):  # a partial has no __name__
        app.task()(functools.partial(print, "x"))
    assert app.task("mail", name="p")(functools.partial(print, "x")).options.queue == "mail"
    with pytest.raises(InvalidArgumentError, match="transactional"):  # every job failed
        app.worker(transactional=True)


def test_a_defer_inside_the_callers_transaction_commits_with_it(client, dsn):
    calls = []
    app, send_email, _ = make_app(client, calls)
    with psycopg.connect(dsn) as conn:
        send_email.using(conn=conn).defer(to="rolled@example.com")
        # A using() after the one with conn keeps it (it was dropped, and
        # this job committed on its own, outside the rolled-back transaction).
        send_email.using(conn=conn).using(delay=0).defer(to="rolled-too@example.com")
        conn.rollback()
        send_email.using(conn=conn, delay=0).defer(to="kept@example.com")
        conn.commit()
    run_jobs(app.worker())
    assert calls == [("mail", "kept@example.com", "Welcome")]


def test_an_async_client_or_unserializable_arguments_are_typed_errors(client, dsn):
    async def make() -> None:
        async with pgq.AsyncClient(dsn) as aclient:
            with pytest.raises(InvalidTypeError, match="blocking pgq.Client"):
                pgq.Tasks(aclient)

    import anyio

    anyio.run(make)
    # A DSN (pgq.Worker takes one): defer() failed with an AttributeError
    with pytest.raises(InvalidTypeError, match="needs a pgq.Client, not str"):
        pgq.Tasks(dsn)

    class Failing:
        def dumps(self, call):
            raise KeyError("no codec")

        def loads(self, body):
            return {}

    app = pgq.Tasks(client, serializer=Failing())

    @app.task(queue="ser")
    def task(x: object) -> None: ...

    with pytest.raises(InvalidTypeError, match="cannot be serialized: KeyError"):
        task.defer(x=1)
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    plain = pgq.Tasks(client)

    @plain.task(queue="ser2")
    def nested(x: object) -> None: ...

    with pytest.raises(InvalidTypeError, match="nest too deeply"):
        nested.defer(x=deep)
    assert client.qlen("ser") == client.qlen("ser2") == 0


def test_calls_may_carry_a_priority_and_an_idempotency_key(client):
    calls: list[tuple[object, ...]] = []
    app, send_email, _ = make_app(client, calls)
    first = send_email.using(key="welcome-ada").defer(to="ada@example.com")
    again = send_email.using(key="welcome-ada").defer(to="ada@example.com")  # a retried defer
    assert again == first and client.qlen("mail") == 1
    urgent = send_email.using(priority=5).defer(to="boss@example.com")
    assert [j.id for j in client.get_job("mail", count=2, nohang=True)] == [urgent, first]
    with pytest.raises(InvalidArgumentError, match="one call"):
        send_email.using(key="k").defer_many([{"to": "a@example.com"}, {"to": "b@example.com"}])
    # Keys are per task: another task on the same queue with the same key
    # is its own call (it added nothing and answered send_email's job).
    @app.task(queue="mail", retry=30)
    def send_sms(to: str) -> None:
        calls.append(("sms", to))

    sms = send_sms.using(key="welcome-ada").defer(to="+331234")
    assert sms != first and client.qlen("mail") == 1  # (the two others were claimed above)
    assert client.show(sms)["key"] == f"{send_sms.name}:welcome-ada"


def test_a_job_naming_an_unknown_task_ends_in_the_dead_letters(client):
    app, _, _ = make_app(client, [])
    ghost = client.add_job("mail", json.dumps({"task": "gone.task", "kwargs": {}}), retry=30)
    junk = client.add_job("mail", b"\xff not a task", retry=30)
    listed = client.add_job("mail", json.dumps({"task": ["x"], "kwargs": {}}), retry=30)
    stats = run_jobs(app.worker(max_deliveries=1))
    assert stats.dead == 3
    reasons = {d["id"]: d["reason"] for d in client.dead_letters("mail")}
    assert "calls task 'gone.task', unknown to this worker" in reasons[ghost]
    assert reasons[listed].startswith("UnknownTaskError:")  # a TypeError (unhashable) before
    assert "is not a task call" in reasons[junk]


def test_two_tasks_may_not_share_a_name(client):
    app = pgq.Tasks(client)
    app.task(name="x")(lambda: None)
    with pytest.raises(InvalidArgumentError, match="exists already"):
        app.task(name="x")(lambda: None)


def test_results_are_kept_and_waited_for(client):
    import threading

    app = pgq.Tasks(client)

    @app.task(queue="calc", retry=30)
    def add(a: int, b: int) -> dict:
        return {"sum": a + b}

    @app.task(queue="calc", retry=30)
    def divide(a: int, b: int) -> float:
        return a / b

    later = add.defer(a=2, b=3)
    waited = {}
    waiter = threading.Thread(target=lambda: waited.update(value=app.result(later, timeout=30)))
    waiter.start()  # waits for a worker that has not started yet
    broken = divide.defer(a=1, b=0)
    stats = run_jobs(app.worker(max_deliveries=1))
    waiter.join(30)
    assert waited == {"value": {"sum": 5}} and (stats.succeeded, stats.dead) == (1, 1)
    with pytest.raises(pgq.errors.TaskFailedError, match="ZeroDivisionError") as failed:
        app.result(broken, timeout=0)
    assert "Traceback" in str(failed.value) and "in divide" in str(failed.value)
    with pytest.raises(TimeoutError):
        app.result(add.defer(a=1, b=1), timeout=0.2)  # nobody runs it
    assert client.wait_result(later)[0] == b'{"result":{"sum":5}}'


def test_a_task_dead_lettered_before_its_error_was_kept_failed_all_the_same(client):
    """A worker dead-letters a failed job, then stores its error: a result()
    between the two, or after a store the database did not take, read "gone
    with no result" and raised NoJobError for a task that failed (found by a
    read-only review)."""
    app = pgq.Tasks(client)

    @app.task(queue="fragile", retry=30)
    def fragile() -> None:
        raise RuntimeError("unreachable: the job is dead-lettered by hand")

    job_id = fragile.defer()
    [job] = client.get_job("fragile", nohang=True)
    assert client.dead_letter(job, reason="ValueError: no\nTraceback ...") == 1  # no error kept
    with pytest.raises(pgq.errors.TaskFailedError, match="ValueError: no"):
        app.result(job_id, timeout=0)
    assert client.wait_result(job_id, timeout=0) == (None, "ValueError: no\nTraceback ...")
    [again] = client.requeue_dead_letters("fragile")  # a new job, under a new ID
    with pytest.raises(pgq.errors.NoJobError):
        app.result(job_id, timeout=0)
    with pytest.raises(TimeoutError):
        app.result(again, timeout=0.2)  # nobody runs it


def test_a_task_whose_value_cannot_be_kept_succeeded_all_the_same(client):
    """A task returning what JSON cannot hold (a datetime) was acknowledged,
    done; its result said TaskFailedError, which means dead-lettered, and a
    caller that retries on it did the work twice."""
    import datetime

    app = pgq.Tasks(client)

    @app.task(queue="when", retry=30)
    def when() -> datetime.datetime:
        return datetime.datetime(2026, 11, 27)

    job_id = when.defer()
    stats = run_jobs(app.worker())
    assert (stats.succeeded, stats.dead) == (1, 0) and client.show(job_id) is None
    with pytest.raises(pgq.errors.ResultNotKeptError, match="could not be kept"):
        app.result(job_id, timeout=0)


def test_waiting_for_a_result_that_will_never_come_says_so(client):
    # With no timeout, result() of a job gone without a result waited for ever.
    app = pgq.Tasks(client)

    @app.task(queue="unkept", retry=30)
    def noop() -> int:
        return 1

    ran = noop.defer()
    run_jobs(app.worker(keep_results=None))  # runs it, keeps no result
    assert client.qlen("unkept") == 0
    # (The timeouts only bound a regression: it waited them out, then TimeoutError.)
    with pytest.raises(pgq.errors.NoJobError, match="keeps none"):
        app.result(ran, timeout=10)
    waiting = noop.defer()
    outcome: dict[str, BaseException] = {}

    def wait() -> None:
        try:
            app.result(waiting, timeout=20)
        except BaseException as exc:  # the test reads it
            outcome["error"] = exc

    import threading

    waiter = threading.Thread(target=wait)
    waiter.start()  # polls while the job is queued
    assert client.del_job(waiting) == 1
    waiter.join(30)  # it ended; it waited for ever
    assert not waiter.is_alive() and isinstance(outcome["error"], pgq.errors.NoJobError)


def test_saving_results_never_waits_for_another_save(dsn):
    # Each save deletes up to 100 expired results. Without SKIP LOCKED two
    # concurrent saves picked the same rows and the second waited for the
    # first's commit: a worker's transactional handler holds its save's
    # locks across its ACK (found by a read-only review).
    import psycopg

    from pgq import statements as sql

    def save(conn: psycopg.Connection, job_id: str) -> None:
        conn.execute(sql.STORE_RESULT, {"id": job_id, "value": b"v", "error": None, "keep": 60.0})

    with psycopg.connect(dsn, autocommit=True) as setup:
        setup.execute("INSERT INTO pgq.results (id, value, expires_at) "
                      "SELECT 'old-' || n, 'x', pgq.now() - interval '1 hour' FROM generate_series(1, 5) n")
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        save(first, "A")  # its transaction stays open, its expired rows locked
        second.execute("SET lock_timeout = '2s'")
        save(second, "B")  # before: LockNotAvailable after 2 s
        second.commit()
        first.commit()
    with psycopg.connect(dsn, autocommit=True) as look:
        ids = {r[0] for r in look.execute("SELECT id FROM pgq.results")}
    assert {"A", "B"} <= ids and not any(i.startswith("old-") for i in ids)
