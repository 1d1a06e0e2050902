"""The blocked GETs of an AsyncClient share one LISTEN connection
(pgq.listener): who a notification wakes (no I/O), and the real thing on a
real server."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import psycopg
import pytest

import pgq
from pgq.listener import BlockedCounts, Linger, SharedListener, SyncSharedListener, Ticket, Wakeups

from .conftest import async_wait_until

# ---------------------------------------------------------------- the rule


def test_a_notification_wakes_the_longest_waiting_ticket_of_its_queue_once():
    wakeups = Wakeups()
    first, second = wakeups.join(["a"]), wakeups.join(["a", "b"])
    other = wakeups.join(["c"])
    assert wakeups.notified("a") is first
    assert wakeups.notified("a") is second  # first is awake already
    assert wakeups.notified("a") is None  # everyone of "a" is awake
    assert wakeups.notified("zzz") is None
    assert not other.woken
    assert wakeups.queues() == {"a", "b", "c"}


def test_a_full_count_passes_the_wake_on_to_a_ticket_sharing_a_queue():
    wakeups = Wakeups()
    wakeups.join(["a"])
    b = wakeups.join(["b", "a"])
    wakeups.tickets[0].woken = True
    assert wakeups.pass_on(["b"]) is b
    assert wakeups.pass_on(["b"]) is None


def test_a_ticket_leaving_with_an_unconsumed_wake_passes_it_on_once():
    wakeups = Wakeups()
    leaving, staying = wakeups.join(["a"]), wakeups.join(["a"])
    assert wakeups.notified("a") is leaving
    assert wakeups.leave(leaving) is staying
    assert wakeups.leave(leaving) is None  # leaving twice is leaving
    assert wakeups.leave(staying) is None and not wakeups.tickets  # its wake: nobody to pass it to
    quiet = wakeups.join(["a"])
    assert wakeups.leave(quiet) is None


def test_a_failed_listener_wakes_every_ticket():
    wakeups = Wakeups()
    tickets = [wakeups.join(["a"]), wakeups.join(["b"])]
    assert wakeups.all() == tickets and all(t.woken for t in tickets)


def test_an_early_ticket_only_where_the_queues_are_registered_and_its_listen_reply():
    wakeups = Wakeups()
    assert wakeups.join_early(["a"], None) is None  # no connection yet
    assert wakeups.join_early(["a", "b"], {"a"}) is None
    early = wakeups.join_early(["a"], {"a", "b"})
    assert early is not None and early.ready.is_set()
    assert Wakeups.listened(early) is False  # nothing unnoticed: no second claim
    assert wakeups.notified("a") is early
    assert Wakeups.listened(early) is None and not early.woken  # claim again, wake consumed
    late = wakeups.join(["c"])
    assert wakeups.registered({"a"}) == [early] and late not in wakeups.registered({"a", "b"})


def test_a_failed_listener_leaves_unregistered_tickets_polling():
    wakeups = Wakeups()
    ready, waiting = wakeups.join(["a"]), wakeups.join(["b"])
    ready.ready.set()
    wakeups.all()
    assert not ready.failed and waiting.failed


def test_tickets_that_waited_through_a_failure_are_woken_when_registered_again():
    # A job added between their GETs' claim after the failure and the new
    # registration notified nobody: it waited for the GET's next poll, up to
    # poll_interval (found by a read-only review).
    wakeups = Wakeups()
    waited, elsewhere = wakeups.join(["a", "b"]), wakeups.join(["c"])
    for ticket in wakeups.all():  # the listener failed: all claim again, then wait
        ticket.ready.set()
        ticket.woken = False  # their claims consumed the wakes
    fresh = wakeups.join(["a"])  # subscribing now: it claims after its registration anyway
    assert wakeups.reregistered({"a"}) == [waited] and waited.woken
    assert not elsewhere.woken and not fresh.woken


@pytest.mark.anyio
async def test_a_subscribe_waits_for_the_registration_no_longer_than_its_get_may():
    # A GET that subscribed while the listener could not connect (or waited
    # to try again after a failure) waited for it, past its own TIMEOUT.
    # (It polls then for the rest of its wait, so no shortcut for the retry's
    # second: a GET that came then would have polled for ever.)
    release = anyio.Event()

    async def hanging_connect() -> psycopg.AsyncConnection:
        await release.wait()
        raise psycopg.OperationalError("unreachable")

    listener = SharedListener(hanging_connect)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(listener.run)
        with anyio.fail_after(5):  # within=0.2: the bound is the GET's, not the connect's
            ticket = await listener.subscribe(["q"], within=0.2)
        assert ticket.failed and not ticket.ready.is_set()  # it polls
        release.set()
        tasks.cancel_scope.cancel()


@pytest.mark.anyio
async def test_notifications_read_during_the_listeners_own_statements_are_dispatched_at_once():
    # psycopg's handler took them while REGISTER_WAITER or SET_WAITER_GETS
    # ran; the socket then had nothing more to say, and they waited for the
    # next notification, a change of tickets or the 5 s timeout.
    async def no_connection() -> psycopg.AsyncConnection:
        raise AssertionError("not used")

    listener = SharedListener(no_connection)
    listener._registered = {"q"}
    listener._conn = object()  # type: ignore[assignment]  # registered: _read would wait on its socket
    listener._received.append("q")
    with anyio.fail_after(1):  # at once (it read nothing from the object above)
        await listener._read(5.0)


@pytest.mark.anyio
async def test_a_subscribe_after_the_listener_stopped_polls_instead_of_waiting_for_ever():
    # A GET whose driver had the listener before the client closed, and
    # blocked after: its ticket was never made ready, and it waited past
    # its own timeout, holding up the front's graceful stop.
    async def no_connection() -> psycopg.AsyncConnection:
        raise AssertionError("nothing to register yet")

    listener = SharedListener(no_connection)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(listener.run)
        await anyio.lowlevel.checkpoint()  # run() starts
        tasks.cancel_scope.cancel()
    with anyio.fail_after(5):
        ticket = await listener.subscribe(["q"])
    assert ticket.failed and ticket.ready.is_set()


def test_a_thread_interrupted_while_it_subscribes_leaves_no_ticket():
    import signal
    import threading

    connecting, give_up = threading.Event(), threading.Event()

    def slow_connect() -> psycopg.Connection:
        connecting.set()
        give_up.wait(10)
        raise psycopg.OperationalError("gave up")

    listener = SyncSharedListener(slow_connect)

    def interrupt() -> None:
        connecting.wait(10)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    killer = threading.Thread(target=interrupt)
    killer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            listener.subscribe(["q"], timeout=30)
        assert listener.wakeups.tickets == []  # it counted as a blocked GET for good
    finally:
        killer.join(10)
        give_up.set()
        listener.close()


def test_the_registration_goes_a_linger_after_the_last_ticket_left():
    linger = Linger(1.0)
    assert not linger.over(wanted=True, registered=True, now=0.0)
    assert linger.timeout(wanted=True, registered=True) == 5.0
    assert not linger.over(wanted=False, registered=True, now=10.0)  # the linger starts
    assert linger.timeout(wanted=False, registered=True) == 1.0
    assert not linger.over(wanted=False, registered=True, now=10.5)
    assert linger.over(wanted=False, registered=True, now=11.0)
    assert not linger.over(wanted=True, registered=True, now=11.5)  # someone waits again
    assert not linger.over(wanted=False, registered=True, now=12.0)  # a new linger
    assert not linger.over(wanted=False, registered=False, now=20.0)  # nothing to drop


def test_blocked_counts_are_written_when_they_change_at_most_every_period():
    counts = BlockedCounts(every=0.25)
    a, b = Ticket(("q", "r"), None, None), Ticket(("q",), None, None)
    # A row is registered with 1: two GETs on q, one on r.
    assert counts.due([a, b], {"q", "r"}, now=10.0) == ({"q": 2}, None)
    counts.written({"q": 2}, now=10.0)
    assert counts.due([a, b], {"q", "r"}, now=10.1) == ({}, None)  # nothing changed
    assert counts.due([a], {"q", "r"}, now=10.1) == ({}, pytest.approx(0.15))  # held back
    assert counts.due([a], {"q", "r"}, now=10.3) == ({"q": 1}, None)
    counts.written({"q": 1}, now=10.3)
    assert counts.due([], {"q", "r"}, now=11.0) == ({"q": 0, "r": 0}, None)  # lingering: 0
    counts.forget()  # the rows went: new ones start at 1
    assert counts.due([b], {"q"}, now=11.1) == ({}, None)


# ---------------------------------------------------------------- real server

@pytest.fixture
def anyio_backend():
    return "asyncio"


def _blocked(client, count: int) -> bool:
    """``count`` GETs of ``client`` wait on its shared listener, registered."""
    listener = client._listener
    return listener is not None and len(listener.wakeups.tickets) == count \
        and all(t.ready.is_set() for t in listener.wakeups.tickets)


async def _blocked_async(client, count: int) -> bool:
    return _blocked(client, count)


@pytest.mark.anyio
async def test_a_blocked_get_cancelled_once_its_claim_committed_returns_the_job(dsn, monkeypatch):
    """The driver took a cancellation between the claim and the command's
    use of its rows: the jobs went to nobody, and a retry-0 job was lost."""
    from pgq import statements
    from pgq.commands import Claimed
    from pgq.driver import AsyncDriver
    from pgq.protocol import Query

    claims = {statements.CLAIM, statements.CLAIM_ONE, statements.CLAIM_RELAXED,
              statements.CLAIM_ONE_RELAXED}
    scope = anyio.CancelScope()
    handle = AsyncDriver._handle

    async def cancelled_after_a_claim(self, request):
        reply = await handle(self, request)
        # The GET's caller gives up just as its claim returns the job. Not
        # after a claim that took nothing: a blocked GET polls too (50 ms,
        # then doubling), and a poll before the add committed cancelled the
        # GET with the job still queued (seen under CI's load).
        if isinstance(request, Query) and request.sql in claims \
                and any(Claimed(*row).id is not None for row in reply):
            scope.cancel()
        return reply

    got: list[pgq.Job] = []

    async def consumer(client: pgq.AsyncClient) -> None:
        with scope:
            got.extend(await client.get_job("cancelled", timeout=20))

    async with pgq.AsyncClient(dsn) as client, pgq.AsyncClient(dsn) as producer:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consumer, client)
            await async_wait_until(lambda: _blocked_async(client, 1), 10)
            monkeypatch.setattr(AsyncDriver, "_handle", cancelled_after_a_claim)
            job_id = await producer.add_job("cancelled", b"x", retry=0)
        assert scope.cancel_called
        assert [j.id for j in got] == [job_id]


@pytest.mark.anyio
async def test_closing_a_client_is_bounded_when_its_registration_cannot_be_dropped(dsn):
    # The 1 s bound on dropping the registration was inside a shield, and
    # did nothing: a locked pgq.waiters (a migration, VACUUM FULL), a
    # paused server or a silent network held close() (and a node's stop).
    import time

    from .conftest import TableLock

    client = pgq.AsyncClient(dsn)
    await client.__aenter__()
    lock = TableLock(dsn, "pgq.waiters")
    try:
        assert await client.get_job("locked", timeout=0.05) == []  # registered, lingering
        lock.take()
        began = time.monotonic()
        await client.__aexit__(None, None, None)
        # 1 s for the registration, then the pool's close; it took the 20 s
        assert time.monotonic() - began < 10
    finally:
        lock.release()
        await client.close()


async def _waiters(dsn: str) -> list[tuple[int, str]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        return await (await conn.execute("SELECT pid, queue FROM pgq.waiters ORDER BY queue")).fetchall()


@pytest.mark.anyio
async def test_blocked_gets_of_one_client_share_one_registration_and_all_get_a_batch(dsn):
    # poll_interval 60: a consumer that no notification (or passed-on wake)
    # reaches would wait a minute, past the get's timeout of 20 s, and the
    # test would see it empty-handed.
    async with pgq.AsyncClient(dsn, poll_interval=60, pool_size=8) as consumer, \
            pgq.AsyncClient(dsn) as producer:
        got: list[list[pgq.Job]] = []

        async def consume() -> None:
            got.append(await consumer.get_job("shared", timeout=20))

        async with anyio.create_task_group() as tasks:
            for _ in range(4):
                tasks.start_soon(consume)
            await async_wait_until(lambda: _blocked_async(consumer, 4), timeout=10)
            waiters = await _waiters(dsn)
            assert len(waiters) == 1 and waiters[0][1] == "shared"  # one backend, whatever the GETs
            ids = await producer.add_jobs("shared", [b"1", b"2", b"3", b"4"])  # one statement, one NOTIFY
        assert sorted(j.id for jobs in got for j in jobs) == sorted(ids)
        assert all(len(jobs) == 1 for jobs in got)


@pytest.mark.anyio
async def test_blocked_gets_give_their_connections_back_to_the_pool(dsn):
    # Six GETs blocked on a pool of two, as the RESP port's workers block
    # with GETJOB: the same client still adds and acks. Each blocked GET
    # held a connection for its whole wait, so an add waited for one until
    # reconnect_timeout and failed (DatabaseUnavailableError).
    async with pgq.AsyncClient(dsn, pool_size=2, reconnect_timeout=5,
                               poll_interval=60) as client:
        got: list[list[pgq.Job]] = []

        async def consume() -> None:
            got.append(await client.get_job("lent", timeout=30))

        async with anyio.create_task_group() as tasks:
            for _ in range(6):
                tasks.start_soon(consume)
            await async_wait_until(lambda: _blocked_async(client, 6), timeout=10)
            other = await client.add_job("elsewhere", b"x")
            assert await client.qlen("elsewhere") == 1
            ids = await client.add_jobs("lent", [b"%d" % i for i in range(6)])
        assert sorted(j.id for jobs in got for j in jobs) == sorted(ids)
        assert await client.ack_job(*ids, other) == 7
        stats = client._pool.get_stats()
        assert stats.get("pool_size", 0) <= 2


@pytest.mark.anyio
async def test_qstat_counts_the_blocked_gets_of_one_client_not_the_client(dsn):
    # One registration row for the client, as before; QSTAT's blocked says 3,
    # as Disque's would for three blocked clients (it said 1).
    async with pgq.AsyncClient(dsn, pool_size=6) as consumer, pgq.AsyncClient(dsn) as other:
        async with anyio.create_task_group() as tasks:
            for _ in range(3):
                tasks.start_soon(lambda: consumer.get_job("counted", timeout=20))

            async def blocked() -> int:
                stat = await other.qstat("counted")
                return 0 if stat is None else int(stat["blocked"])

            await async_wait_until(lambda: _equals(blocked, 3), timeout=10)
            assert len(await _waiters(dsn)) == 1
            info = await other.info()
            assert info["blocked_clients"] == 3
            await other.add_jobs("counted", [b"1", b"2", b"3"])
        # They returned: 0 while the registration lingers, then no queue.
        await async_wait_until(lambda: _equals(blocked, 0), timeout=10)


async def _equals(read, value) -> bool:
    return await read() == value


@pytest.mark.anyio
async def test_blocked_gets_still_get_their_jobs_when_the_listener_backend_dies(dsn):
    async with pgq.AsyncClient(dsn, poll_interval=0.2, pool_size=4) as consumer, \
            pgq.AsyncClient(dsn) as producer:
        got: list[pgq.Job] = []

        async def consume() -> None:
            got.extend(await consumer.get_job("dies", timeout=20))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consume)
            (pid, _queue), = await async_wait_until(lambda: _waiters(dsn), timeout=10)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
                await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            job_id = await producer.add_job("dies", b"x")
        assert [j.id for j in got] == [job_id]


@pytest.mark.anyio
async def test_the_registration_goes_once_nobody_waits_and_comes_back_when_someone_does(dsn):
    async with pgq.AsyncClient(dsn) as consumer:
        assert await consumer.get_job("idle", timeout=0.2) == []
        async def gone() -> bool:
            return not await _waiters(dsn)

        await async_wait_until(gone, timeout=10)  # LINGER is 1 s
        job_id = await consumer.add_job("idle", b"x", delay=0.5)  # ready in 0.5 s: no NOTIFY
        got = await consumer.get_job("idle", timeout=10)
        assert [j.id for j in got] == [job_id]
    assert await _waiters(dsn) == []  # closed: nothing left behind


@pytest.mark.anyio
async def test_a_client_entered_in_one_task_and_left_in_another_serves_and_stops(dsn):
    # As an async pytest fixture or a framework's startup and shutdown hooks
    # do. The listener ran in a task group entered by `async with`, whose
    # exit from another task raised "Attempted to exit cancel scope in a
    # different task" and left the listener running.
    import asyncio

    consumer = pgq.AsyncClient(dsn, poll_interval=60)  # only a wake delivers within 20 s
    await asyncio.create_task(consumer.__aenter__())
    try:
        async with pgq.AsyncClient(dsn) as producer:
            waiting = asyncio.create_task(consumer.get_job("hooks", timeout=20))
            await async_wait_until(lambda: _waiters(dsn), timeout=10)
            job_id = await producer.add_job("hooks", b"x")
            assert [j.id for j in await waiting] == [job_id]
    finally:
        await asyncio.create_task(consumer.__aexit__(None, None, None))
    assert consumer._listener is None and consumer._listening is None
    assert await _waiters(dsn) == []  # its registration went with it


# ---------------------------------------------------------------- pgq.Client (threads)


def _sync_waiters(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT pid, queue FROM pgq.waiters ORDER BY queue").fetchall()


def test_blocked_gets_of_threads_share_one_registration_and_all_get_a_batch(dsn):
    import threading

    from .conftest import wait_until

    # poll_interval 60, as in the async test: only a wake can deliver in time.
    with pgq.Client(dsn, poll_interval=60, pool_size=8) as consumer, pgq.Client(dsn) as producer:
        got: list[list[pgq.Job]] = []
        threads = [threading.Thread(target=lambda: got.append(consumer.get_job("tshared", timeout=20)))
                   for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: _blocked(consumer, 4), 10, message="four blocked GETs")
            waiters = _sync_waiters(dsn)
            assert len(waiters) == 1 and waiters[0][1] == "tshared"  # one backend, whatever the GETs
            # ... yet QSTAT counts the four GETs (schema 0016), once the thread wrote them
            wait_until(lambda: producer.qstat("tshared")["blocked"] == 4, 10,
                       message="QSTAT to count four blocked GETs")
            ids = producer.add_jobs("tshared", [b"1", b"2", b"3", b"4"])  # one statement, one NOTIFY
        finally:
            for thread in threads:
                thread.join(30)
        assert sorted(j.id for jobs in got for j in jobs) == sorted(ids)
        assert all(len(jobs) == 1 for jobs in got)
    assert _sync_waiters(dsn) == []  # closed: the thread dropped its registration
    assert not consumer._listener._thread.is_alive()


def test_blocked_threads_give_their_connections_back_to_the_pool(dsn):
    import threading

    from .conftest import wait_until

    # As the async test: six threads blocked on a pool of two, and the same
    # client still adds (each blocked GET held a connection for its wait).
    with pgq.Client(dsn, poll_interval=60, pool_size=2, reconnect_timeout=5) as client:
        got: list[list[pgq.Job]] = []
        threads = [threading.Thread(target=lambda: got.append(client.get_job("tlent", timeout=30)))
                   for _ in range(6)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: _blocked(client, 6), 10, message="six blocked GETs")
            other = client.add_job("telsewhere", b"x")
            ids = client.add_jobs("tlent", [b"%d" % i for i in range(6)])
        finally:
            for thread in threads:
                thread.join(30)
        assert sorted(j.id for jobs in got for j in jobs) == sorted(ids)
        assert client.ack_job(*ids, other) == 7


def test_a_thread_blocked_on_a_dead_listener_still_gets_its_job(dsn):
    from .conftest import wait_until

    with pgq.Client(dsn, poll_interval=0.2) as consumer, pgq.Client(dsn) as producer:
        import threading

        got: list[pgq.Job] = []
        thread = threading.Thread(target=lambda: got.extend(consumer.get_job("tdies", timeout=20)))
        thread.start()
        try:
            (pid, _queue), = wait_until(lambda: _sync_waiters(dsn), 10, message="registration")
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            job_id = producer.add_job("tdies", b"x")
        finally:
            thread.join(30)
        assert [j.id for j in got] == [job_id]



def test_a_delayed_job_wakes_a_blocked_get_which_waits_for_its_due_time(dsn):
    # A GET blocked before a delayed job was added (or NACKed with a delay)
    # knew of no due time: it found the job only at its next poll, up to
    # poll_interval late (0.5 s by default; here 60). Every path that stores
    # a delayed job now NOTIFYs a registered waiter: one add, a bulk add by
    # COPY, and a NACK with a delay. A plain LISTEN beside the client sees
    # each notification (deterministic); the GET then gets the job.
    import threading

    from pgq.commands import COPY_THRESHOLD

    from .conftest import wait_until

    with pgq.Client(dsn, poll_interval=60) as consumer, pgq.Client(dsn) as producer, \
            psycopg.connect(dsn, autocommit=True) as listening:
        listening.execute("LISTEN pgq")

        def notified(queue: str) -> bool:
            # Other NOTIFYs of the other queue may come first: a client's
            # periodic sweep (pgq.requeue_due) that queues "one" once it is
            # due, while the GET on "later" is registered, sends its own. So
            # read until this queue's payload comes, or 10 s pass.
            deadline = time.monotonic() + 10
            while (left := deadline - time.monotonic()) > 0:
                if any(n.payload == queue for n in listening.notifies(timeout=left, stop_after=1)):
                    return True
            return False

        def blocked_get(queue: str) -> tuple[threading.Thread, list[list[pgq.Job]]]:
            got: list[list[pgq.Job]] = []
            thread = threading.Thread(target=lambda: got.append(consumer.get_job(queue, timeout=30)))
            thread.start()
            wait_until(lambda: _blocked(consumer, 1) and _sync_waiters(dsn) != [], 10,
                       message=f"a GET blocked on {queue}")
            return thread, got

        thread, got = blocked_get("later")
        try:
            producer.add_job("later", b"one", delay=3)  # the GET stays blocked (registered) meanwhile
            assert notified("later")
            bulk = producer.add_jobs("later", [b"x"] * COPY_THRESHOLD, delay=3600)  # by COPY
            assert notified("later")
        finally:
            thread.join(30)
        assert [j.body for jobs in got for j in jobs] == [b"one"]

        producer.add_job("back", b"two")
        [taken] = producer.get_job("back", nohang=True)
        thread, got = blocked_get("back")
        try:
            assert producer.nack_job(taken, delay=1) == 1
            assert notified("back")
        finally:
            thread.join(30)
        assert [j.id for jobs in got for j in jobs] == [taken.id]
        producer.del_job(*bulk)
