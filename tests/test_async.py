"""AsyncClient: the same commands, on asyncio through anyio."""

from __future__ import annotations

import time

import anyio
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import pgq
from pgq.errors import InvalidTypeError, MaxLenError

from .conftest import async_wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_add_get_ack_round_trip(dsn):
    async with pgq.AsyncClient(dsn) as client:
        job_id = await client.add_job("aq", b"hello", retry=30)
        ids = await client.add_jobs("aq", [b"1", b"2"])
        assert await client.qlen("aq") == 3
        jobs = await client.get_job("aq", count=5, withcounters=True)
        assert [j.id for j in jobs] == [job_id, *ids]
        assert await client.working(job_id) == 30
        assert await client.nack_job(job_id) == 1
        assert (await client.get_job("aq"))[0].id == job_id
        assert await client.ack_job(job_id, *ids) == 3
        assert await client.show(job_id) is None  # done and garbage-collected at once
        assert await client.qstat("aq") is not None
        assert (await client.hello())["id"] == client.node_id
        assert (await client.info())["jobs"]["active"] == 0


async def test_blocking_get_is_woken_and_cancellable(dsn):
    # poll_interval 30: the blocked GET's polls (50 ms doubling) fall near
    # 3.2 s and 6.4 s, so a job added 4 s in is found by a poll only ~2.2 s
    # later; woken by its NOTIFY it comes at once. The bound (1.5 s) has room
    # for a loaded machine (0.3 s failed there) and still tells the two apart.
    async with pgq.AsyncClient(dsn, poll_interval=30) as consumer, pgq.AsyncClient(dsn) as producer:
        got = []

        async def consume():
            got.extend(await consumer.get_job("aw", timeout=20))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(4)  # between two polls (see above), not a proof
            start = time.monotonic()
            job_id = await producer.add_job("aw", b"x")
        assert [j.id for j in got] == [job_id]
        assert time.monotonic() - start < 1.5
        # cancelling a blocked get leaves no waiter behind: the client's
        # shared listener drops its registration once nobody has waited for
        # its linger (pgq.listener.LINGER, 1 s)
        with anyio.move_on_after(0.3):
            await consumer.get_job("never")
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            async def none_left() -> bool:
                return await (await conn.execute("SELECT count(*) FROM pgq.waiters")).fetchone() == (0,)

            await async_wait_until(none_left, timeout=10)


async def test_concurrent_consumers_share_without_duplicates(dsn):
    async with pgq.AsyncClient(dsn, pool_size=8) as client:
        ids = set(await client.add_jobs("many", [b"%d" % i for i in range(300)]))
        seen: list[str] = []

        async def consume():
            while jobs := await client.get_job("many", count=9, nohang=True):
                seen.extend(j.id for j in jobs)
                await client.ack_job(*(j.id for j in jobs))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(consume)
        assert sorted(seen) == sorted(ids)
        assert await client.qlen("many") == 0


async def test_transactions_with_async_psycopg_and_sqlalchemy(dsn):
    async with pgq.AsyncClient(dsn) as client:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            job_id = await client.add_job("atx", b"x", conn=conn)
            await conn.rollback()
        assert await client.show(job_id) is None
        engine = create_async_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
        try:
            async with engine.connect() as alone:  # pgq's add, the only work: committed too
                job_id = await client.add_job("atx", b"alone", conn=alone)
                await alone.commit()
            assert (await client.show(job_id))["state"] == "queued"
            async with AsyncSession(engine) as session:
                await session.execute(text("SELECT 1"))
                job_id = await client.add_job("atx", b"y", conn=session)
                await session.commit()
            assert (await client.show(job_id))["state"] == "queued"
        finally:
            await engine.dispose()
        with pytest.raises(InvalidTypeError, match="pgq.Client"):
            with psycopg.connect(dsn) as sync_conn:
                await client.add_job("atx", b"z", conn=sync_conn)


async def test_errors_are_the_same_as_the_sync_clients(dsn):
    async with pgq.AsyncClient(dsn) as client:
        await client.add_job("cap", b"x", maxlen=1)
        with pytest.raises(MaxLenError):
            await client.add_job("cap", b"x", maxlen=1)
        with pytest.raises(pgq.errors.BadIdError):
            await client.ack_job("bad")


async def test_client_can_be_created_outside_a_loop_and_opened_lazily(dsn):
    client = pgq.AsyncClient(dsn)
    try:
        assert await client.qlen("lazy") == 0
        assert client.node_id
    finally:
        await client.close()


@pytest.mark.parametrize("canceller", ["anyio", "asyncio"])
def test_a_cancelled_command_runs_what_follows_its_rollback_before_it_stops(dsn, canceller):
    """After pgq's own transaction rolls back, what follows undoes what it
    left elsewhere (a direct add withdraws the copies it wrote into the
    peers' databases, then records which it missed). A cancellation that
    arrived meanwhile was taken just before that, and the copies stayed
    (found by a read-only review); then between the two steps (another).
    It is taken when the command ends."""
    import asyncio

    from pgq.driver import AsyncDriver
    from pgq.protocol import Begin, Query, Result, Rollback

    ran: list[object] = []

    def command(cancel):
        yield Begin()
        cancel()  # inside pgq's own transaction: taken after it
        yield Query("SELECT 1", None, Result.VALUE)
        yield Rollback()
        ran.append((yield Query("SELECT 2", None, Result.VALUE)))  # the clean-up
        ran.append((yield Query("SELECT 3", None, Result.VALUE)))  # and its record
        return "ended"

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            driver = AsyncDriver(conn, shield=True)
            if canceller == "anyio":
                with anyio.CancelScope() as scope:
                    assert await driver.run(command(scope.cancel)) == "ended"
                    await anyio.lowlevel.checkpoint()
                assert scope.cancelled_caught
            else:
                task = asyncio.current_task()
                assert task is not None
                with pytest.raises(asyncio.CancelledError):
                    await driver.run(command(task.cancel))  # raised at the end, not swallowed

    anyio.run(main)
    assert ran == [2, 3]


# asyncio's own cancellation (Task.cancel(): asyncio.wait_for, asyncio.timeout,
# a TaskGroup, web frameworks) goes through anyio's shields (pgq.cancelsafe).

@pytest.mark.parametrize("path", ["combined claim", "blocked GET"])
@pytest.mark.parametrize("retry", [300, 0])
async def test_a_get_cancelled_by_asyncio_after_its_claim_puts_the_job_back(dsn, monkeypatch, path,
                                                                           retry):
    # The cancellation landed after the claim committed: the job went to
    # nobody and stayed leased for its whole retry (300 s here); a retry-0
    # job was never delivered at all (ENQUEUE refuses a delivered one).
    import asyncio

    from pgq import statements
    from pgq.commands import Claimed
    from pgq.driver import AsyncDriver
    from pgq.protocol import Query

    from .test_listener import _blocked_async

    claims = {statements.CLAIM, statements.CLAIM_ONE, statements.CLAIM_RELAXED,
              statements.CLAIM_ONE_RELAXED}
    handle = AsyncDriver._handle
    consumer: list[asyncio.Task] = []

    async def cancelled_after_a_claim(self, request):
        reply = await handle(self, request)
        if isinstance(request, Query) and request.sql in claims \
                and any(Claimed(*row).id is not None for row in reply):
            consumer[0].cancel()  # asyncio's own, as wait_for's timeout does
        return reply

    queue = f"native-{path.split()[0]}-{retry}"
    async with pgq.AsyncClient(dsn) as client, pgq.AsyncClient(dsn) as producer:
        async def get() -> list[pgq.Job]:
            consumer.append(asyncio.current_task())
            return await client.get_job(queue, timeout=20)

        if path == "combined claim":
            job_id = await producer.add_job(queue, b"x", retry=retry)
            monkeypatch.setattr(AsyncDriver, "_handle", cancelled_after_a_claim)
            task = asyncio.create_task(get())
        else:
            task = asyncio.create_task(get())
            await async_wait_until(lambda: _blocked_async(client, 1), 10)
            monkeypatch.setattr(AsyncDriver, "_handle", cancelled_after_a_claim)
            job_id = await producer.add_job(queue, b"x", retry=retry)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)  # not swallowed: the task stops
        monkeypatch.setattr(AsyncDriver, "_handle", handle)
        shown = await producer.show(job_id)
        assert shown["state"] == "queued"
        if retry == 0:  # back although delivered once (no consumer saw it)
            assert shown["deliveries"] == 1 and shown["additional_deliveries"] == 0
        assert [j.id for j in await producer.get_job(queue, nohang=True)] == [job_id]



async def test_an_error_after_a_held_off_cancellation_does_not_swallow_it(dsn, monkeypatch):
    # asyncio's cancellation, held off inside pgq's own transaction, was
    # dropped when the command then failed (MAXLEN, checked after the
    # commit): the caller got MaxLenError and ran on, uncancelled.
    import asyncio

    from pgq.driver import AsyncDriver

    handle = AsyncDriver._handle
    victims: list[asyncio.Task] = []

    async def cancelling_in_a_transaction(self, request):
        if self._transactions and victims:
            victims.pop().cancel()  # asyncio's own, as asyncio.timeout's
        return await handle(self, request)

    async with pgq.AsyncClient(dsn) as client:
        await client.add_job("full", b"x")

        async def add() -> None:
            victims.append(asyncio.current_task())
            await client.add_job("full", b"y", maxlen=1)

        monkeypatch.setattr(AsyncDriver, "_handle", cancelling_in_a_transaction)
        task = asyncio.create_task(add())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)
        assert not victims  # the cancellation did land in pgq's transaction


async def test_a_get_waiting_to_join_the_shared_listener_is_cancellable(dsn):
    # Joining waits for the listener's task to register the queues, which a
    # locked pgq.waiters (a migration, VACUUM FULL) holds up. The join was
    # shielded: asyncio's cancellation of the GET waited for the lock.
    import asyncio

    from .conftest import TableLock

    lock = TableLock(dsn, "pgq.waiters")
    # The sweep (which also waits for the lock) made now, not in the GET.
    async with pgq.AsyncClient(dsn, sweep_interval=3600) as client:
        await client.sweep()
        try:
            await anyio.to_thread.run_sync(lock.take)
            began = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.get_job("unregistered", timeout=15), 1)
            # 1 s, and the time to see it through: it took the lock's 20 s
            assert time.monotonic() - began < 8
        finally:
            await anyio.to_thread.run_sync(lock.release)
