"""Bus wire format: handshake, authenticated frames, replay protection, strict decoding."""

from __future__ import annotations

import pytest

from pgq.cluster import messages as m
from pgq.cluster.wire import Acceptor, FrameReader, FrameWriter, Initiator, WireError

A = "a" * 40
B = "b" * 40
SECRET = b"cluster secret"


def handshake(secret_i=SECRET, secret_a=SECRET):
    ini, acc = Initiator(secret_i, A), Acceptor(secret_a, B)
    challenge = acc.challenge(ini.hello())
    proof = ini.answer(challenge)
    acc.verify(proof)
    return ini, acc


def test_handshake_agrees_on_a_session_key_and_identities():
    ini, acc = handshake()
    assert ini.session_key == acc.session_key and len(ini.session_key) == 32
    assert ini.peer_id == B and acc.peer_id == A
    ini2, _ = handshake()
    assert ini2.session_key != ini.session_key  # fresh nonces: fresh key


def test_wrong_secret_fails_both_ways():
    ini, acc = Initiator(b"wrong", A), Acceptor(SECRET, B)
    challenge = acc.challenge(ini.hello())
    with pytest.raises(WireError, match="secret"):
        ini.answer(challenge)
    ini, acc = Initiator(SECRET, A), Acceptor(b"wrong", B)
    challenge = acc.challenge(ini.hello())
    with pytest.raises(WireError):
        acc.verify(ini.answer(challenge))


def test_recorded_handshake_cannot_be_replayed():
    ini, acc = handshake()
    hello = Initiator(SECRET, A, nonce=ini.nonce).hello()
    old_proof = Initiator(SECRET, A, nonce=ini.nonce)
    old_proof.answer(Acceptor(SECRET, B, nonce=acc.nonce).challenge(hello))
    fresh = Acceptor(SECRET, B)  # a new connection has a new acceptor nonce
    fresh.challenge(hello)
    replayed = Initiator(SECRET, A, nonce=ini.nonce).answer(
        Acceptor(SECRET, B, nonce=acc.nonce).challenge(hello))
    with pytest.raises(WireError):
        fresh.verify(replayed)


def test_garbage_hello_is_rejected():
    with pytest.raises(WireError):
        Acceptor(SECRET, B).challenge(b"GET / HTTP/1.1\r\n" + b"x" * 44)
    with pytest.raises(WireError):
        Acceptor(SECRET, B).challenge(b"short")


def test_frames_round_trip_in_pieces():
    ini, acc = handshake()
    writer, reader = FrameWriter(ini.session_key), FrameReader(acc.session_key)
    data = b"".join(writer.frame(p) for p in (b"one", b"", b"three" * 1000))
    got = []
    for i in range(0, len(data), 7):
        got += reader.feed(data[i:i + 7])
    assert got == [b"one", b"", b"three" * 1000]


def test_tampered_replayed_and_reordered_frames_are_rejected():
    ini, acc = handshake()
    writer = FrameWriter(ini.session_key)
    first, second = writer.frame(b"first"), writer.frame(b"second")
    tampered = bytearray(first)
    tampered[15] ^= 1
    with pytest.raises(WireError, match="authentication"):
        FrameReader(acc.session_key).feed(bytes(tampered))
    reader = FrameReader(acc.session_key)
    assert reader.feed(first) == [b"first"]
    with pytest.raises(WireError, match="sequence"):
        reader.feed(first)  # replay
    with pytest.raises(WireError, match="sequence"):
        FrameReader(acc.session_key).feed(second)  # first one dropped
    other_session = handshake()[1].session_key
    with pytest.raises(WireError):
        FrameReader(other_session).feed(first)  # frame from another connection


def test_oversized_length_is_refused_before_buffering():
    reader = FrameReader(b"k" * 32, max_frame=1024)
    with pytest.raises(WireError, match="out of bounds"):
        reader.feed((10**6).to_bytes(4, "big") + b"x" * 10)


JOB = "D-aaaaaaaa-" + "A" * 24 + "-0001"


@pytest.mark.parametrize("message", [
    m.Ping(3, (m.Member(A, "127.0.0.2", 7000, 2, "suspect", True, "n1"),)),
    m.Ack(3, B), m.PingReq(4, B), m.PushPull((m.Member(B, "h", 1, 0),), True), m.Forget(A),
    m.ReplJob((m.JobCopy(JOB, "q", b"\x00body", 10**18, 3, 5.0, 0.0, 1.7e9, 1, 2, (A, B)),)),
    m.GotJob((JOB,)), m.Enqueue((JOB,)), m.WillQueue((JOB,)), m.Queued((JOB,), "nacks"),
    m.Working((JOB,)), m.SetAck(((JOB, (A, B)),)), m.GotAck(((JOB, True),)), m.DelJob((JOB,)),
    m.NeedJobs("q", 10), m.YourJobs(()), m.Pause("q", "out"),
])
def test_every_message_round_trips(message):
    assert m.decode(m.encode(message)) == message


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x93\x01\x02\x03",  # garbage, reserved byte, a list
    m.msgpack.packb({"k": "nope"}),
    m.msgpack.packb({"k": "ping", "s": -1, "u": []}),
    m.msgpack.packb({"k": "ping", "s": "1", "u": []}),
    m.msgpack.packb({"k": "gotjob", "i": ["not-a-job-id"]}),
    m.msgpack.packb({"k": "repljob", "j": [["x"]]}),
    m.msgpack.packb({"k": "pushpull", "m": [[A, "h", 99999, 0, "alive", False, ""]], "r": True}),
    m.msgpack.packb({"k": "pushpull", "m": [[A, "h", 1, 0, "zombie", False, ""]], "r": True}),
    m.msgpack.packb({"k": "queued", "i": [JOB], "c": "everything"}),
    m.msgpack.packb({"k": "setack", "a": [[JOB]]}),
])
def test_malformed_payloads_raise_message_error(payload):
    with pytest.raises(m.MessageError):
        m.decode(payload)
