"""Bus wire format: handshake (initiator proves first), encrypted frames,
replay protection, strict decoding of every field."""

from __future__ import annotations

import pytest
from pgq.cluster import messages as m
from pgq.cluster.wire import (
    HELLO_SIZE,
    Acceptor,
    FrameReader,
    FrameTooBig,
    FrameWriter,
    Initiator,
    WireError,
)

A = "a" * 40
B = "b" * 40
KEY = b"k" * 32  # a stretched cluster secret
OTHER = b"o" * 32


def handshake(key_i=KEY, key_a=KEY):
    ini, acc = Initiator(key_i, A), Acceptor(key_a, B)
    challenge = acc.challenge(ini.hello())
    accept = acc.verify(ini.answer(challenge))
    ini.accepted(accept)
    return ini, acc


def test_handshake_agrees_on_a_frame_key_and_identities():
    ini, acc = handshake()
    assert ini.frame_key == acc.frame_key and len(ini.frame_key) == 32
    assert ini.peer_id == B and acc.peer_id == A
    ini2, _ = handshake()
    assert ini2.frame_key != ini.frame_key  # fresh nonces: fresh key


def test_the_initiator_proves_first():
    """Whoever merely connects learns nothing that depends on the secret:
    the challenge is the same whatever the acceptor's key."""
    hello = Initiator(OTHER, A).hello()
    nonce = b"n" * 32
    assert Acceptor(KEY, B, nonce=nonce).challenge(hello) == \
        Acceptor(OTHER, B, nonce=nonce).challenge(hello)
    acc = Acceptor(KEY, B)
    acc.challenge(hello)
    with pytest.raises(WireError, match="secret"):
        acc.verify(b"\x00" * 32)  # no ACCEPT without a valid PROOF


def test_wrong_secret_fails_both_ways():
    ini, acc = Initiator(OTHER, A), Acceptor(KEY, B)
    challenge = acc.challenge(ini.hello())
    with pytest.raises(WireError, match="secret"):
        acc.verify(ini.answer(challenge))
    # an acceptor without the secret cannot produce an ACCEPT either
    ini, acc = Initiator(KEY, A), Acceptor(OTHER, B)
    challenge = acc.challenge(ini.hello())
    proof = ini.answer(challenge)
    forged = Acceptor(OTHER, B, nonce=acc.nonce)
    forged.challenge(Initiator(KEY, A, nonce=ini.nonce).hello())
    with pytest.raises(WireError, match="secret"):
        ini.accepted(forged.verify(Initiator(OTHER, A, nonce=ini.nonce).answer(challenge)))
    assert proof  # the genuine proof is useless to the forger (checked above)


def test_a_peer_claiming_our_own_id_is_refused():
    with pytest.raises(WireError, match="own node id"):
        Acceptor(KEY, A).challenge(Initiator(KEY, A).hello())
    ini = Initiator(KEY, A)
    challenge = Acceptor(KEY, B).challenge(ini.hello())
    with pytest.raises(WireError, match="own node id"):  # an acceptor answering as us
        ini.answer(challenge.replace(B.encode(), A.encode()))


def test_recorded_handshake_cannot_be_replayed():
    ini, acc = handshake()
    replayed_proof = Initiator(KEY, A, nonce=ini.nonce).answer(
        Acceptor(KEY, B, nonce=acc.nonce).challenge(Initiator(KEY, A, nonce=ini.nonce).hello()))
    fresh = Acceptor(KEY, B)  # a new connection has a new acceptor nonce
    fresh.challenge(Initiator(KEY, A, nonce=ini.nonce).hello())
    with pytest.raises(WireError):
        fresh.verify(replayed_proof)


def test_garbage_hello_is_rejected():
    with pytest.raises(WireError):
        Acceptor(KEY, B).challenge(b"GET / HTTP/1.1\r\n" + b"x" * (HELLO_SIZE - 16))
    with pytest.raises(WireError):
        Acceptor(KEY, B).challenge(b"short")


def test_frames_round_trip_in_pieces_and_are_encrypted():
    ini, acc = handshake()
    writer, reader = FrameWriter(ini.frame_key), FrameReader(acc.frame_key)
    secret_body = b"the job body nobody else may read"
    data = b"".join(writer.frame(p) for p in (b"one", b"", secret_body * 100))
    assert secret_body not in data  # bodies are not readable on the wire
    got = []
    for i in range(0, len(data), 7):
        got += reader.feed(data[i:i + 7])
    assert got == [b"one", b"", secret_body * 100]


def test_tampered_replayed_and_reordered_frames_are_rejected():
    ini, acc = handshake()
    writer = FrameWriter(ini.frame_key)
    first, second = writer.frame(b"first"), writer.frame(b"second")
    tampered = bytearray(first)
    tampered[6] ^= 1
    with pytest.raises(WireError, match="authentication"):
        FrameReader(acc.frame_key).feed(bytes(tampered))
    reader = FrameReader(acc.frame_key)
    assert reader.feed(first) == [b"first"]
    with pytest.raises(WireError, match="authentication"):
        reader.feed(first)  # replay
    with pytest.raises(WireError, match="authentication"):
        FrameReader(acc.frame_key).feed(second)  # first one dropped
    other_session = handshake()[1].frame_key
    with pytest.raises(WireError):
        FrameReader(other_session).feed(first)  # frame from another connection


def test_oversized_length_is_refused_before_buffering():
    reader = FrameReader(b"k" * 32, max_frame=1024)
    with pytest.raises(WireError, match="out of bounds"):
        reader.feed((10**6).to_bytes(4, "big") + b"x" * 10)
    assert reader.pending() == 14  # nothing was allocated for the announced megabyte


def test_a_payload_too_big_for_a_frame_is_refused_by_the_writer():
    with pytest.raises(FrameTooBig):
        FrameWriter(b"k" * 32, max_frame=1024).frame(b"x" * 2000)


JOB = "D-aaaaaaaa-" + "A" * 24 + "-0001"


@pytest.mark.parametrize("message", [
    m.Ping(3, (m.Member(A, "127.0.0.2", 7000, 2, "suspect", True, "n1"),)),
    m.Ack(3, B), m.PingReq(4, B), m.PushPull((m.Member(B, "h", 1, 0),), True), m.Forget(A),
    m.ReplJob((m.JobCopy(JOB, "q", b"\x00body", 10**18, 3, 5.0, 0.0, 1.7e9, 1, 2, (A, B)),)),
    m.ReplJob((m.JobCopy(JOB, "q", b"b", 10**18, 3, 5.0, 0.0, 1.7e9, 0, 0, (A,), 7, "key-1"),)),
    m.ReplJob((m.JobCopy(JOB, "q", b"b", 10**18, 3, 5.0, 0.0, 1.7e9, 0, 0, (A,), 0, "k"),)),
    m.GotJob((JOB,)), m.Enqueue((JOB,)), m.WillQueue((JOB,)), m.Queued((JOB,), "nacks"),
    m.WillQueue((JOB,), ((A, B),)), m.Queued((JOB,), "", ((A,),)),
    m.Working((JOB,)), m.SetAck(((JOB, (A, B)),)), m.GotAck(((JOB, True),)), m.DelJob((JOB,)),
    m.NeedJobs("q", 10), m.YourJobs(()), m.Pause("q", "out"),
    m.Advert("host=h dbname=d"), m.Advert("", "10.0.0.2:7711"),
])
def test_every_message_round_trips(message):
    assert m.decode(m.encode(message)) == message


def test_an_advert_without_a_resp_address_is_read_as_none_and_sends_none():
    # A node from before schema 0015 sends only "d", and reads only "d".
    assert m.decode(m.encode(m.Advert("dsn"))) == m.Advert("dsn", "")
    assert m.Advert("dsn").fields() == {"d": "dsn"}


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
    m.msgpack.packb({"k": "queued", "i": [JOB], "c": "", "h": [[A], [B]]}),  # 2 lists, 1 job
    m.msgpack.packb({"k": "willqueue", "i": [JOB], "h": [["not-a-node"]]}),
    m.msgpack.packb({"k": "setack", "a": [[JOB]]}),
])
def test_malformed_payloads_raise_message_error(payload):
    with pytest.raises(m.MessageError):
        m.decode(payload)


E = "\u00e9" * 64
LIMIT = 2**62


@pytest.mark.parametrize("payload", [
    # hosts the IDNA codec rejects (they crashed the node's bus before)
    m.msgpack.packb({"k": "pushpull", "m": [[A, "\u200d", 7000, 0, "alive", False, ""]], "r": True}),
    m.msgpack.packb({"k": "pushpull", "m": [[A, E, 7000, 0, "alive", False, ""]], "r": True}),
    m.msgpack.packb({"k": "pushpull", "m": [[A, "", 7000, 0, "alive", False, ""]], "r": True}),
    m.msgpack.packb({"k": "pushpull", "m": [[A, "a b", 7000, 0, "alive", False, ""]], "r": True}),
    m.msgpack.packb({"k": "pushpull", "m": [[A, "h", 0, 0, "alive", False, ""]], "r": True}),
    # an incarnation that would overflow once incremented (or in a BIGINT)
    m.msgpack.packb({"k": "ping", "s": 1, "u": [[A, "h", 1, 2**63 - 1, "alive", False, ""]]}),
    m.msgpack.packb({"k": "ping", "s": 1, "u": [[A, "h", 1, LIMIT + 1, "alive", False, ""]]}),
    m.msgpack.packb({"k": "ping", "s": 2**63, "u": []}),
    # names with NUL (PostgreSQL text cannot hold them)
    m.msgpack.packb({"k": "ping", "s": 1, "u": [[A, "h", 1, 0, "alive", False, "n\x00"]]}),
    # durations: NaN, infinity, negative; bad queue names
    *[m.msgpack.packb({"k": "repljob", "j": [[JOB, q, b"b", 1, 1, r, d, x, 0, 0, []]]})
      for q, r, d, x in [("q", float("nan"), 0.0, 1.7e9), ("q", float("inf"), 0.0, 1.7e9),
                         ("q", -1.0, 0.0, 1.7e9), ("q", 1.0, -5.0, 1.7e9),
                         ("q", 1.0, 0.0, float("inf")), ("", 1.0, 0.0, 1.7e9),
                         ("a\x00b", 1.0, 0.0, 1.7e9), ("x" * 513, 1.0, 0.0, 1.7e9)]],
    # counters at the int4 maximum (the holder's next re-queue overflowed)
    m.msgpack.packb({"k": "repljob", "j": [[JOB, "q", b"b", 1, 1, 1.0, 0.0, 1.7e9, 2**31 - 1, 0, []]]}),
    m.msgpack.packb({"k": "repljob", "j": [[JOB, "q", b"b", 1, 1, 1.0, 0.0, 1.7e9, 0, 2**31 - 1, []]]}),
    m.msgpack.packb({"k": "needjobs", "q": "", "n": 1}),
    m.msgpack.packb({"k": "pause", "q": "q\x00", "p": "in"}),
    m.msgpack.ExtType(1, b"x") and m.msgpack.packb({"k": m.msgpack.ExtType(1, b"x")}),
])
def test_fields_are_checked_as_they_will_be_used(payload):
    with pytest.raises(m.MessageError):
        m.decode(payload)


def test_job_copies_keep_the_earlier_shape_and_read_a_later_one():
    plain = m.JobCopy(JOB, "q", b"b", 1, 1, 1.0, 0.0, 1.7e9)
    assert len(plain.to_wire()) == 11  # what nodes before priorities and keys read
    ranked = m.JobCopy(JOB, "q", b"b", 1, 1, 1.0, 0.0, 1.7e9, priority=3, key="k")
    assert len(ranked.to_wire()) == 13
    later = [*ranked.to_wire(), "a field of a later version"]
    assert m.JobCopy.from_wire(later) == ranked  # extra fields are ignored
    for bad in ([*plain.to_wire(), 3], [*plain.to_wire(), -1, None], [*plain.to_wire(), 0, ""],
                [*plain.to_wire(), 0, "a\x00b"], [*plain.to_wire(), 0, 5]):
        with pytest.raises(m.MessageError):
            m.JobCopy.from_wire(bad)


def test_the_largest_incarnation_still_round_trips():
    member = m.Member(A, "127.0.0.2", 7000, LIMIT, "alive", False, "n1")
    assert m.decode(m.encode(m.Ping(1, (member,)))) == m.Ping(1, (member,))
