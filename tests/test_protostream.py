"""pgq.protostream, the RESP server's byte stream, over real TCP sockets:
bytes in order then the end, half-closed peers, read and write
backpressure, a failed peer, and a cancelled receive."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import pytest

from pgq import protostream
from pgq.protostream import HIGH_WATER, ProtocolListener, ProtocolStream

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # psycopg's async connections, and so pgq's servers, run on asyncio


@contextlib.asynccontextmanager
async def _pair() -> AsyncIterator[tuple[ProtocolStream, socket.socket, ProtocolListener]]:
    """A stream accepted by a ProtocolListener, and the peer's plain socket;
    all three closed at the end (closing twice is harmless)."""
    server = socket.create_server(("127.0.0.1", 0))
    listener = ProtocolListener(server)
    peer = socket.create_connection(server.getsockname())
    try:
        stream = await listener.accept()
        try:
            yield stream, peer, listener
        finally:
            await stream.aclose()
    finally:
        peer.close()
        await listener.aclose()


async def _until(condition) -> None:
    # Polls the event loop, not the clock: the bound only stops a hung test.
    with anyio.fail_after(10):
        while not condition():  # noqa: ASYNC110 (a transport's callback sets it: no event to wait on)
            await anyio.sleep(0.001)


async def _read_to_end(peer: socket.socket) -> bytes:
    """What the peer reads until the server closes; the loop runs meanwhile
    (the transport writes and closes in it)."""
    peer.setblocking(False)
    got = b""
    with anyio.fail_after(10):
        while True:
            try:
                chunk = peer.recv(65536)
            except BlockingIOError:
                await anyio.sleep(0.001)
                continue
            if not chunk:
                return got
            got += chunk


async def test_bytes_come_in_order_then_the_end_and_a_half_closed_peer_gets_its_reply():
    async with _pair() as (stream, peer, listener):
        local = stream.local_address
        assert local[:2] == listener._socket.getsockname()[:2]
        peer.sendall(b"*1\r\n$4\r\nPING\r\n")
        peer.sendall(b"more")
        peer.shutdown(socket.SHUT_WR)  # `printf ... | nc -N`: sends, then half-closes
        got = b""
        with pytest.raises(anyio.EndOfStream):
            while True:
                got += await stream.receive()
        assert got == b"*1\r\n$4\r\nPING\r\nmore"
        with pytest.raises(anyio.EndOfStream):  # for ever
            await stream.receive()
        await stream.send(b"+PONG\r\n")  # the half-closed peer still reads
        await stream.aclose()
        assert await _read_to_end(peer) == b"+PONG\r\n"
        with pytest.raises(anyio.ClosedResourceError):
            await stream.send(b"x")


async def test_receive_keeps_to_max_bytes_and_the_rest_comes_next():
    async with _pair() as (stream, peer, listener):
        peer.sendall(b"abcdefgh")
        got = b""
        while len(got) < 8:
            chunk = await stream.receive(3)
            assert 1 <= len(chunk) <= 3
            got += chunk
        assert got == b"abcdefgh"


async def test_a_peer_that_sends_without_end_is_held_back_and_nothing_is_lost():
    """Reading pauses with HIGH_WATER bytes unread: the peer's sends then
    fill the kernel's buffers and block, instead of the server's memory."""
    async with _pair() as (stream, peer, listener):
        peer.setblocking(False)
        block = bytes(range(256)) * 256  # 64 KiB
        sent = bytearray()

        async def fill() -> None:
            while True:
                try:
                    n = peer.send(block)
                except BlockingIOError:
                    return  # held back
                sent.extend(block[:n])
                await anyio.lowlevel.checkpoint()  # let the server's loop read

        with anyio.fail_after(30):
            await fill()
        assert stream._reading_paused
        assert stream._unread < HIGH_WATER + len(block) * 4
        got = bytearray()
        with anyio.fail_after(30):
            while len(got) < len(sent):  # what the kernel held comes once reading resumes
                got += await stream.receive()
        assert bytes(got) == bytes(sent)


async def test_send_waits_while_the_peer_does_not_read_and_goes_on_when_it_does():
    async with _pair() as (stream, peer, listener):
        payload = b"r" * (32 * 1024 * 1024)  # more than the kernel's buffers hold
        done = anyio.Event()
        async with anyio.create_task_group() as tasks:
            async def write() -> None:
                await stream.send(payload)
                done.set()

            tasks.start_soon(write)
            await _until(lambda: stream._writable is not None)  # the transport paused writing
            assert not done.is_set()  # waiting for the peer
            received = 0
            peer.setblocking(False)
            with anyio.fail_after(60):
                while received < len(payload):
                    try:
                        received += len(peer.recv(1 << 20))
                    except BlockingIOError:
                        await anyio.sleep(0.001)
                await done.wait()
        assert received == len(payload)


async def test_a_reset_peer_breaks_the_stream_and_a_cancelled_receive_leaves_it_whole():
    async with _pair() as (stream, peer, listener):
        with anyio.move_on_after(0.05):  # a receive cancelled while it waits
            await stream.receive()
        peer.sendall(b"after")
        assert await stream.receive() == b"after"
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()  # linger 0: a reset
        with pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
            with anyio.fail_after(10):
                await stream.receive()
        with pytest.raises(anyio.BrokenResourceError):
            await stream.send(b"+OK\r\n")


async def test_a_close_whose_replies_are_never_read_aborts_after_its_grace(monkeypatch):
    """A peer that reads nothing keeps no socket (and so no client slot of
    the RESP server) for longer than CLOSE_GRACE after the server closed it;
    a close that is cancelled (the server's stop) aborts at once."""
    monkeypatch.setattr(protostream, "CLOSE_GRACE", 0.2)
    for cancelled in (False, True):
        async with _pair() as (stream, peer, listener):
            stream._transport.write(b"r" * (16 * 1024 * 1024))  # more than the kernel holds
            assert stream._transport.get_write_buffer_size() > 0
            with anyio.fail_after(10):
                with anyio.CancelScope() as scope:
                    if cancelled:
                        scope.cancel()
                    await stream.aclose()
                await _until(stream._lost.done)  # the transport is gone


async def test_a_second_receiver_is_refused():
    async with _pair() as (stream, peer, listener):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stream.receive)
            await _until(lambda: stream._readable is not None)
            with pytest.raises(anyio.BusyResourceError):
                await stream.receive()
            peer.sendall(b"x")  # the first receive takes it and ends
        peer.sendall(b"left unread")
        await _until(lambda: stream._unread > 0)
        await stream.aclose()
        with pytest.raises(anyio.ClosedResourceError):  # closed here: nothing more comes out
            await stream.receive()


async def test_draining_a_full_buffer_lets_the_event_loop_turn():
    """Bytes handed out without waiting yield once per YIELD_EVERY: a
    pipelining client's backlog is answered in turns with the others."""
    async with _pair() as (stream, peer, listener):
        turns = 0
        peer.sendall(b"p" * (HIGH_WATER // 2))
        await _until(lambda: stream._unread >= HIGH_WATER // 2)
        async with anyio.create_task_group() as tasks:
            async def count() -> None:
                nonlocal turns
                while True:
                    turns += 1
                    await anyio.lowlevel.checkpoint()

            tasks.start_soon(count)
            await anyio.lowlevel.checkpoint()
            before, got = turns, 0
            while got < HIGH_WATER // 2:
                got += len(await stream.receive(1024))
            assert turns - before >= (HIGH_WATER // 2) // protostream.YIELD_EVERY - 1
            tasks.cancel_scope.cancel()


def test_local_addresses_are_read_as_anyio_gave_them():
    assert protostream._address(("127.0.0.1", 7711)) == ("127.0.0.1", 7711)
    assert protostream._address(("::1", 7711, 0, 0)) == ("::1", 7711)
    assert protostream._address(("fe80::1", 7711, 0, 2)) == ("fe80::1%2", 7711)
