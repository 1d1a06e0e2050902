"""Records and failures that used to stop a node or a whole cluster for
good, each on its own part (no process): an IPv6 scope id holding a NUL, a
suspicion at the wire's incarnation bound, a failed save of the members,
the messages load decides before the bus exists, and a link to an address
that never answers."""

from __future__ import annotations

import random
import socket

import anyio
import pytest
from pgq.cluster import messages as m
from pgq.cluster import sql as node_sql
from pgq.cluster.addresses import valid_host
from pgq.cluster.bus import Bus, BusLimits, BusStats, accept_forever
from pgq.cluster.clock import VirtualClock
from pgq.cluster.core import CoreSettings, NodeCore
from pgq.cluster.membership import Membership
from pgq.cluster.node import Node


def test_a_scope_id_is_an_interface_name_never_any_text():
    assert valid_host("fe80::1%eth0") and valid_host("fe80::1%2") and valid_host("::1")
    for host in ("fe80::1%\x00", "::%\n", "fe80::1%", "fe80::1%" + "x" * 16, "fe80::1%a b"):
        assert not valid_host(host), host


def test_a_suspicion_at_the_incarnation_bound_is_not_refuted_past_it():
    me = m.Member("a" * 40, "127.0.0.1", 7000, 3, name="n1")
    membership = Membership(me, None, random.Random(1))
    claim = m.Member(me.id, me.host, me.port, m.MAX_INCARNATION, "suspect")
    membership.receive("b" * 40, m.PushPull((claim,), reply=False), 1.0)
    assert membership.me.incarnation == 3  # unchanged: every peer could still decode it
    m.decode(m.encode(m.PushPull((membership.me,), reply=False)))
    # below the bound, a suspicion is refuted as before
    claim = m.Member(me.id, me.host, me.port, 10, "suspect")
    membership.receive("b" * 40, m.PushPull((claim,), reply=False), 2.0)
    assert membership.me.incarnation == 11 and membership.me.status == "alive"


def test_a_left_record_from_the_wire_is_refused():
    # "left" is a node's own word for a member it forgot; no node gossips
    # it. Accepted, one such record excluded a healthy node (nothing
    # refutes it) and deleted it from every pgq.nodes.
    victim = m.Member("a" * 40, "127.0.0.1", 7000, 3, "left", name="n1")
    with pytest.raises(m.MessageError):
        m.decode(m.encode(m.PushPull((victim,), reply=False)))
    assert m.decode(m.encode(m.PushPull((m.Member("a" * 40, "127.0.0.1", 7000, 3, "dead"),),
                                        reply=False)))


async def _ignore(_peer: str, _message: m.Message) -> None:
    return None


def test_a_link_to_an_address_that_never_answers_goes_once_unused():
    from pgq.ports import free_port

    port = free_port("127.0.0.1")  # nobody listens there (not bind(0): a parallel test's pick)

    async def main() -> None:
        bus = Bus("a" * 40, b"s" * 32, "127.0.0.1", 0, handler=_ignore,
                  limits=BusLimits(link_idle=0.3))
        async with anyio.create_task_group() as tasks:
            await tasks.start(bus.serve)
            bus.send("127.0.0.1", port, m.Ping(1))
            assert ("127.0.0.1", port) in bus._links
            # Condition, not a sleep: the link retries with a back-off of at
            # most 2 s, and must end at the first failure after link_idle.
            with anyio.fail_after(10):
                while ("127.0.0.1", port) in bus._links:  # noqa: ASYNC110 (a condition on another task's state)
                    await anyio.sleep(0.05)
            assert bus.stats.dropped >= 1
            tasks.cancel_scope.cancel()

    anyio.run(main)


def _core() -> NodeCore:
    core = NodeCore(CoreSettings("n1", "127.0.0.1", 7000), VirtualClock(), random.Random(1))
    core.node_id = "a" * 40
    core.membership = Membership(m.Member(core.node_id, "127.0.0.1", 7000, 1, name="n1"),
                                 None, random.Random(1))
    return core


def test_a_forget_that_membership_ignores_ends_no_ack_collection():
    """A node forgotten less than the ban ago (still running) that sent a
    FORGET of a live holder made this node stop waiting for that holder's
    GOTACK and DELJOB the job before the holder had the SETACK: its copy
    re-queued, and the acknowledged job was delivered again (found by a
    read-only review). A FORGET of this node ends nothing either."""
    from pgq.cluster.acks import AckCollector

    core = _core()
    core.acks = AckCollector(core.node_id)
    banned, holder, job = "b" * 40, "c" * 40, "D-aaaaaaaa-" + "A" * 24 + "-0001"
    core.acks.add(job, {core.node_id, holder}, 0.0)
    core.membership.forget(banned, core.clock.monotonic())  # forgotten now: ignored for a while
    assert core.gossip(banned, m.Forget(holder)) is None
    assert core.gossip(holder, m.Forget(core.node_id)) is None
    assert job in core.acks.pending  # still waiting for the holder's GOTACK
    # A FORGET that membership honours does end it.
    step = core.gossip("d" * 40, m.Forget(holder))
    assert step is not None and job not in core.acks.pending


@pytest.mark.parametrize("bad", ["", "B" * 40, "not a node", "b" * 39])
def test_a_hand_written_forget_of_no_node_id_is_ignored(bad):
    """A FORGET event with an argument that is no node ID was banned and
    sent to every live peer, whose decoders refused it (bad node id) and
    closed the link, losing the other messages of the batch (found by a
    read-only review)."""
    me = m.Member("a" * 40, "127.0.0.1", 7000, 3, name="n1")
    membership = Membership(me, None, random.Random(1))
    membership.receive("b" * 40, m.PushPull((m.Member("b" * 40, "127.0.0.1", 7001, 1),), reply=False), 1.0)
    assert membership.forget(bad, 2.0) == []
    assert not membership.ignores(bad) and membership.get("b" * 40) is not None


def test_a_yourjobs_naming_one_job_twice_imports_it_once():
    # IMPORT_JOBS upserts: a row met twice fails the statement
    # (CardinalityViolation) and ended the inbox run with it.
    core = _core()
    copy = m.JobCopy("D-bbbbbbbb-" + "A" * 24 + "-0001", "q", b"x", 1, 1, 0.0, 0.0, 2e9)
    step = core._on_yourjobs("b" * 40, m.YourJobs((copy, copy)))
    request = next(step)
    assert request.sql == node_sql.IMPORT_JOBS and request.params["ids"] == [copy.id]
    step.close()


def test_a_failed_save_of_the_members_loses_no_forgotten_node():
    core = _core()
    core._forgotten = ["b" * 40]
    step = core.persist()
    request = next(step)
    assert request.sql == node_sql.SAVE_MEMBERS and request.params["forgotten"] == ["b" * 40]
    step.close()  # what the driver does when the statement fails
    assert core._forgotten == ["b" * 40] and core._members_dirty
    step = core.persist()  # the next persist saves them again
    assert next(step).params["forgotten"] == ["b" * 40]


def test_messages_decided_before_the_bus_exists_wait_for_it():
    node = Node.__new__(Node)  # only what _flush reads
    node.core, node.bus = _core(), None  # node_id reads core.node_id
    node.core.outgoing.append(("127.0.0.1", 7001, m.Ping(1)))
    node._flush()
    assert node.core.outgoing  # kept: load runs before the bus starts
    sent: list[tuple[str, int, m.Message]] = []

    class Recorder:
        def send(self, host: str, port: int, message: m.Message) -> None:
            sent.append((host, port, message))

    node.bus = Recorder()  # type: ignore[assignment]
    node._flush()
    assert [(h, p) for h, p, _ in sent] == [("127.0.0.1", 7001)] and not node.core.outgoing


def test_one_host_with_idle_connections_cannot_keep_the_others_out():
    """Idle connections from one address take at most max_pending_per_host
    handshake slots: before, 64 of them (about 13 a second, each held 5 s)
    kept every peer of the node out."""
    limits = BusLimits(max_pending_per_host=2, handshake_timeout=30)

    async def main() -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        bus = Bus("a" * 40, b"s" * 32, "127.0.0.1", port, handler=_ignore, listener=sock,
                  limits=limits)
        async with anyio.create_task_group() as tasks:
            await tasks.start(bus.serve)
            idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(3)]
            other = await anyio.connect_tcp("127.0.0.1", port, local_host="127.0.0.2")
            with anyio.fail_after(10):  # the four accepts run in the bus's tasks
                while bus.stats.connections_in < 4:  # noqa: ASYNC110 (the bus's own state)
                    await anyio.sleep(0.01)
            assert bus.stats.rejected["too many handshakes from one host"] == 1
            assert bus._pending_by_host == {"127.0.0.1": 2, "127.0.0.2": 1}
            for stream in (*idle, other):
                await stream.aclose()
            tasks.cancel_scope.cancel()

    anyio.run(main)


def test_idle_connections_filling_the_handshakes_do_not_keep_a_peer_out():
    """Past max_pending_handshakes the newcomer was refused: a few addresses
    holding idle connections kept every restarted peer out. The oldest
    handshake now makes room."""
    limits = BusLimits(max_pending_handshakes=2, handshake_timeout=30)
    got: list[m.Message] = []
    arrived = anyio.Event()

    async def handler(_peer: str, message: m.Message) -> None:
        got.append(message)
        arrived.set()

    async def main() -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        bus = Bus("a" * 40, b"s" * 32, "127.0.0.1", port, handler=handler, listener=sock,
                  limits=limits)
        peer = Bus("b" * 40, b"s" * 32, "127.0.0.1", 0, handler=_ignore)
        async with anyio.create_task_group() as tasks:
            await tasks.start(bus.serve)
            idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(2)]
            with anyio.fail_after(10):  # the accepts run in the bus's tasks
                while len(bus._handshaking) < 2:  # noqa: ASYNC110 (the bus's own state)
                    await anyio.sleep(0.01)
            await tasks.start(peer.serve)
            peer.send("127.0.0.1", port, m.Ping(7))
            with anyio.fail_after(10):
                await arrived.wait()
            assert got == [m.Ping(7)]
            assert bus.stats.rejected["oldest handshake evicted"] >= 1
            with anyio.fail_after(10), pytest.raises(anyio.EndOfStream):
                await idle[0].receive()  # the oldest was closed to make room
            for stream in idle:
                await stream.aclose()
            tasks.cancel_scope.cancel()

    anyio.run(main)


def test_connections_of_garbage_cost_a_log_line_a_second_not_one_each(caplog):
    """Anyone who could reach the bus wrote a warning per 77 bytes of
    garbage, and a detached node's log (never rotated) filled the disk."""
    import time

    from pgq.cluster.bus import DROP_LOG_EVERY

    async def main() -> float:
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        bus = Bus("a" * 40, b"s" * 32, "127.0.0.1", port, handler=_ignore, listener=sock)
        started = time.monotonic()
        async with anyio.create_task_group() as tasks:
            await tasks.start(bus.serve)
            for _ in range(20):
                async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                    await stream.send(b"\x00" * 77)  # not the bus's magic
            with anyio.fail_after(10):  # the drops happen in the bus's tasks
                while sum(bus.stats.rejected.values()) < 20:  # noqa: ASYNC110 (the bus's own state)
                    await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()
        return time.monotonic() - started

    with caplog.at_level("WARNING", logger="pgq.cluster.bus"):
        elapsed = anyio.run(main)
    lines = [r for r in caplog.records if "dropped a connection" in r.getMessage()]
    # at most one line a DROP_LOG_EVERY, whatever this machine's speed
    assert 1 <= len(lines) <= elapsed / DROP_LOG_EVERY + 1 < 20


def test_a_failed_accept_is_counted_and_the_listener_goes_on():
    """Out of file descriptors, accept() raises: anyio's serve() ended there,
    and the node process with it."""
    accepted: list[str] = []

    class Listener:
        def __init__(self) -> None:
            self.results: list[object] = [OSError(24, "Too many open files"), "first", "second"]

        async def accept(self) -> str:
            if not self.results:
                await anyio.sleep_forever()
            result = self.results.pop(0)
            if isinstance(result, Exception):
                raise result
            return str(result)

    async def handle(stream: str) -> None:
        accepted.append(stream)

    async def main() -> None:
        stats = BusStats()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(accept_forever, Listener(), handle, tasks, stats)
            with anyio.fail_after(10):
                while len(accepted) < 2:  # noqa: ASYNC110 (the handler's own record)
                    await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()
        assert accepted == ["first", "second"] and stats.rejected["accept failed"] == 1

    anyio.run(main)


def test_a_frame_of_nested_empty_arrays_is_refused_before_it_fills_memory():
    """An empty array is one byte on the wire and about 64 in memory: a 64 MiB
    frame of them built some 4 GB before its kind was even looked at."""
    import tracemalloc

    import msgpack

    from pgq.ids import new_job_ids

    payload = msgpack.packb({"k": "ping", "s": 1, "u": [[[]] * 50_000] * 60})  # 3 MB
    tracemalloc.start()
    try:
        with pytest.raises(m.MessageError):
            m.decode(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20  # 3M arrays would take about 200 MB
    copy = m.JobCopy(id=new_job_ids("abcd1234", 86400.0, 5.0, 1)[0], queue="q", body=b"x",
                     ctime=1, repl=3, retry=5.0, delay=0.0, expires_at=2e9,
                     nodes=("a" * 40, "b" * 40, "c" * 40))
    largest = m.ReplJob(jobs=(copy,) * 10_000)  # the most a REPLJOB may carry
    assert len(m.decode(m.encode(largest)).jobs) == 10_000


def test_fake_members_cannot_grow_the_view_past_what_one_pushpull_carries():
    me = m.Member("a" * 40, "127.0.0.1", 7000, 1, name="n1")
    membership = Membership(me, None, random.Random(1))
    fakes = tuple(m.Member(f"{i + 2:040x}", "10.0.0.1", 7000 + i % 50000, 1)
                  for i in range(m.MAX_MEMBERS))  # one full, valid PUSHPULL
    membership.receive("b" * 40, m.PushPull(fakes, reply=False), 1.0)
    assert len(membership.view()) == m.MAX_MEMBERS
    m.decode(m.encode(m.PushPull(tuple(membership.view()), reply=True)))  # still deliverable


def test_a_handshake_that_fails_after_its_claim_gives_the_id_back():
    """A peer that vanishes between its proof and the bus's answer (the send
    of ACCEPT fails) is cut off; its id used to stay claimed, so that its
    reconnects were refused as 'already connected' for stale_after seconds.
    Driven on a stream whose peer side is an Initiator in this test: which of
    the close and the send comes first is up to the kernel on a socket."""
    from pgq.cluster.secret import stretch
    from pgq.cluster.wire import Initiator

    secret, peer = b"s" * 32, "c" * 40
    initiator = Initiator(stretch(secret), peer)

    class VanishingPeer:
        """The peer's bytes, answered as a peer would; gone when accepted."""

        def __init__(self) -> None:
            self.incoming = bytearray(initiator.hello())
            self.sent = 0

        async def receive(self, max_bytes: int = 65536) -> bytes:
            if not self.incoming:
                raise anyio.EndOfStream
            data = bytes(self.incoming[:max_bytes])
            del self.incoming[:max_bytes]
            return data

        async def send(self, data: bytes) -> None:
            self.sent += 1
            if self.sent == 1:  # the challenge: the peer proves it holds the secret
                self.incoming += initiator.answer(data)
                return
            raise anyio.BrokenResourceError  # ACCEPT: the peer is gone

        def extra(self, attribute: object, default: object = None) -> object:
            return default

        async def aclose(self) -> None:
            return None

        async def __aenter__(self) -> VanishingPeer:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    async def main() -> None:
        bus = Bus("a" * 40, secret, "127.0.0.1", 0, handler=_ignore,
                  limits=BusLimits(stale_after=600))
        stream = VanishingPeer()
        await bus._accept(stream)  # type: ignore[arg-type]
        assert stream.sent == 2 and peer not in bus._inbound

    anyio.run(main)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
