"""The cluster bus wire format: handshake, framing and authentication (no I/O).

A bus connection is a one-way pipe from the node that opened it (the
*initiator*) to the node that accepted it (the *acceptor*); every node opens
its own connection to each peer it talks to, as Disque does.

Handshake (all fields fixed-size, before any message)::

    initiator -> acceptor  HELLO   magic "PGQB", version, initiator node id, nonce_i
    acceptor  -> initiator CHALLENGE  version, acceptor node id, nonce_a,
                                   HMAC(secret, "acceptor" | nonce_i | nonce_a | ids)
    initiator -> acceptor  PROOF   HMAC(secret, "initiator" | nonce_i | nonce_a | ids)

Both sides then derive the session key ``HMAC(secret, "session" | nonce_i |
nonce_a | ids)``. Each later frame is::

    length u32 | version u8 | sequence u64 | payload | HMAC(session key, version|sequence|payload)

Why this is safe:

* Only holders of the cluster secret can complete the handshake: the PROOF
  is bound to the acceptor's fresh nonce, so a recorded handshake cannot be
  replayed on a new connection.
* Within a connection the sequence number must grow by exactly one, and it is
  covered by the MAC: a frame cannot be replayed, dropped or reordered
  without detection.
* The first byte that fails a check raises :class:`WireError`; the caller
  counts it and closes the connection. Nothing in a rejected frame is
  interpreted, so a bad frame can never change node state.
* Frame lengths are bounded before anything is buffered.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

__all__ = [
    "WIRE_VERSION",
    "MAX_FRAME",
    "WireError",
    "Initiator",
    "Acceptor",
    "FrameWriter",
    "FrameReader",
    "HELLO_SIZE",
    "CHALLENGE_SIZE",
    "PROOF_SIZE",
]

WIRE_VERSION = 1
MAGIC = b"PGQB"
NONCE = 16
NODE_ID = 40
MAC = 32
MAX_FRAME = 1024 * 1024 * 1024  # a batch of jobs; bounded before it is buffered

_HELLO = struct.Struct(f"!4sB{NODE_ID}s{NONCE}s")
_CHALLENGE = struct.Struct(f"!B{NODE_ID}s{NONCE}s{MAC}s")
_PROOF = struct.Struct(f"!{MAC}s")
_HEADER = struct.Struct("!IBQ")  # length of (version..payload+mac), version, sequence

HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
PROOF_SIZE = _PROOF.size


class WireError(Exception):
    """A frame or handshake failed a check; the connection must be closed."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _ascii_id(node_id: str) -> bytes:
    raw = node_id.encode("ascii")
    if len(raw) != NODE_ID:
        raise ValueError("node ids are 40 characters")
    return raw


def _decode_id(raw: bytes) -> str:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise WireError("node id is not ASCII") from None
    if any(c not in "0123456789abcdef" for c in text):
        raise WireError("node id is not 40 lowercase hex characters")
    return text


@dataclass
class Initiator:
    """The handshake as seen by the node that opens the connection."""

    secret: bytes
    node_id: str
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE))
    peer_id: str = ""
    session_key: bytes = b""

    def hello(self) -> bytes:
        return _HELLO.pack(MAGIC, WIRE_VERSION, _ascii_id(self.node_id), self.nonce)

    def answer(self, challenge: bytes) -> bytes:
        """Check the acceptor's CHALLENGE; return our PROOF. Raises WireError."""
        if len(challenge) != CHALLENGE_SIZE:
            raise WireError("bad challenge size")
        version, peer, nonce_a, mac = _CHALLENGE.unpack(challenge)
        if version != WIRE_VERSION:
            raise WireError(f"peer speaks wire version {version}, we speak {WIRE_VERSION}")
        self.peer_id = _decode_id(peer)
        ids = _ascii_id(self.node_id) + peer
        if not hmac.compare_digest(mac, _mac(self.secret, b"acceptor", self.nonce, nonce_a, ids)):
            raise WireError("peer does not know the cluster secret")
        self.session_key = _mac(self.secret, b"session", self.nonce, nonce_a, ids)
        return _PROOF.pack(_mac(self.secret, b"initiator", self.nonce, nonce_a, ids))


@dataclass
class Acceptor:
    """The handshake as seen by the node that accepts the connection."""

    secret: bytes
    node_id: str
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE))
    peer_id: str = ""
    session_key: bytes = b""
    _peer_nonce: bytes = b""
    _expected_proof: bytes = b""

    def challenge(self, hello: bytes) -> bytes:
        """Check the initiator's HELLO; return our CHALLENGE. Raises WireError."""
        if len(hello) != HELLO_SIZE:
            raise WireError("bad hello size")
        magic, version, peer, nonce_i = _HELLO.unpack(hello)
        if magic != MAGIC:
            raise WireError("not a pgq bus connection")
        if version != WIRE_VERSION:
            raise WireError(f"peer speaks wire version {version}, we speak {WIRE_VERSION}")
        self.peer_id = _decode_id(peer)
        ids = peer + _ascii_id(self.node_id)
        self._peer_nonce = nonce_i
        self._expected_proof = _mac(self.secret, b"initiator", nonce_i, self.nonce, ids)
        self.session_key = b""
        mac = _mac(self.secret, b"acceptor", nonce_i, self.nonce, ids)
        return _CHALLENGE.pack(WIRE_VERSION, _ascii_id(self.node_id), self.nonce, mac)

    def verify(self, proof: bytes) -> None:
        """Check the initiator's PROOF. Raises WireError."""
        if len(proof) != PROOF_SIZE or not self._expected_proof:
            raise WireError("bad proof")
        if not hmac.compare_digest(proof, self._expected_proof):
            raise WireError("peer does not know the cluster secret")
        ids = _ascii_id(self.peer_id) + _ascii_id(self.node_id)
        self.session_key = _mac(self.secret, b"session", self._peer_nonce, self.nonce, ids)


@dataclass
class FrameWriter:
    """Encodes authenticated frames for one connection."""

    key: bytes
    sequence: int = 0

    def frame(self, payload: bytes) -> bytes:
        self.sequence += 1
        header = _HEADER.pack(1 + 8 + len(payload) + MAC, WIRE_VERSION, self.sequence)
        mac = _mac(self.key, header[4:], payload)
        return header + payload + mac


@dataclass
class FrameReader:
    """Decodes and checks frames for one connection; feed it bytes as they come."""

    key: bytes
    max_frame: int = MAX_FRAME
    sequence: int = 0
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[bytes]:
        """Return the payloads completed by ``data``. Raises WireError on any bad frame."""
        self._buffer += data
        payloads = []
        while len(self._buffer) >= 4:
            (length,) = struct.unpack_from("!I", self._buffer)
            if length < 1 + 8 + MAC or length > self.max_frame:
                raise WireError(f"frame length {length} out of bounds")
            if len(self._buffer) < 4 + length:
                break
            frame = bytes(self._buffer[4:4 + length])
            del self._buffer[:4 + length]
            version, sequence = struct.unpack_from("!BQ", frame)
            body, mac = frame[:-MAC], frame[-MAC:]
            if not hmac.compare_digest(mac, _mac(self.key, body)):
                raise WireError("frame authentication failed")
            if version != WIRE_VERSION:
                raise WireError(f"frame version {version} unsupported")
            if sequence != self.sequence + 1:
                raise WireError(f"frame sequence {sequence} after {self.sequence}: replayed or lost")
            self.sequence = sequence
            payloads.append(body[9:])
        return payloads
