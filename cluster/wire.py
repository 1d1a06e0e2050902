"""The cluster bus wire format: handshake, encryption and framing (no I/O).

A bus connection is a one-way pipe from the node that opened it (the
*initiator*) to the node that accepted it (the *acceptor*); every node opens
its own connection to each peer it talks to, as Disque does.

``K`` is the bus key: the cluster secret stretched by scrypt
(:func:`.secret.stretch`). Handshake, fixed-size fields, before any frame::

    initiator -> acceptor  HELLO      magic "PGQB", version, id_i, nonce_i
    acceptor  -> initiator CHALLENGE  version, id_a, nonce_a
    initiator -> acceptor  PROOF      HMAC(K, "initiator" | T)
    acceptor  -> initiator ACCEPT     HMAC(K, "acceptor" | T)

    T = nonce_i | nonce_a | id_i | id_a         (32-byte nonces, 40-hex ids)
    frame key = HMAC(K, "frames" | T)

Each later frame (initiator to acceptor only) is::

    length u32 | ChaCha20-Poly1305(frame key, nonce = sequence, aad = "PGQB" | length)(payload)

Why this is safe:

* **The initiator proves first.** The acceptor sends nothing that depends
  on ``K`` until the initiator proved it knows ``K``: whoever can merely
  connect learns a nonce and the acceptor's id, nothing to test guesses
  against. An impostor that lures a node into connecting gets one PROOF,
  and each offline guess at the secret then costs a scrypt (about 50 ms).
* **Identities are bound**: both ids are in every MAC and in the frame
  key, so a handshake made for one pair of nodes is useless for any other;
  the acceptor refuses an initiator claiming the acceptor's own id (the bus
  also refuses an id that already has a live connection).
* **Frames are encrypted and authenticated** (AEAD). The sequence number is
  the AEAD nonce and is never sent: a frame replayed, dropped or reordered
  fails authentication, as does any change to its length. Nonces are fresh
  per connection, so a recorded connection cannot be replayed either.
* The first check that fails raises :class:`WireError`; the caller counts it
  and closes the connection. Nothing in a rejected frame is interpreted.
* Frame lengths are bounded (:data:`MAX_FRAME`) before anything is buffered,
  and a payload too big for one frame is refused on the sending side.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

__all__ = [
    "WIRE_VERSION",
    "MAX_FRAME",
    "WireError",
    "FrameTooBig",
    "Initiator",
    "Acceptor",
    "FrameWriter",
    "FrameReader",
    "HELLO_SIZE",
    "CHALLENGE_SIZE",
    "PROOF_SIZE",
    "ACCEPT_SIZE",
]

WIRE_VERSION = 2
MAGIC = b"PGQB"
NONCE = 32
NODE_ID = 40
MAC = 32
TAG = 16
# A frame carries one message; senders split batches well below this
# (REPLJOB batches are cut at a few MiB), so it only bounds the damage a
# peer can do to our memory.
MAX_FRAME = 64 * 1024 * 1024

_HELLO = struct.Struct(f"!4sB{NODE_ID}s{NONCE}s")
_CHALLENGE = struct.Struct(f"!B{NODE_ID}s{NONCE}s")
_LENGTH = struct.Struct("!I")

HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
PROOF_SIZE = MAC
ACCEPT_SIZE = MAC


class WireError(Exception):
    """A frame or handshake failed a check; the connection must be closed."""


class FrameTooBig(ValueError):
    """A payload does not fit in one frame (the sender must split it)."""


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


def _transcript(nonce_i: bytes, nonce_a: bytes, id_i: str, id_a: str) -> bytes:
    return nonce_i + nonce_a + _ascii_id(id_i) + _ascii_id(id_a)


@dataclass
class Initiator:
    """The handshake as seen by the node that opens the connection."""

    key: bytes  # the stretched cluster secret
    node_id: str
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE))
    peer_id: str = ""
    frame_key: bytes = b""
    _transcript: bytes = b""

    def hello(self) -> bytes:
        return _HELLO.pack(MAGIC, WIRE_VERSION, _ascii_id(self.node_id), self.nonce)

    def answer(self, challenge: bytes) -> bytes:
        """Read the acceptor's CHALLENGE; return our PROOF. Raises WireError."""
        if len(challenge) != CHALLENGE_SIZE:
            raise WireError("bad challenge size")
        version, peer, nonce_a = _CHALLENGE.unpack(challenge)
        if version != WIRE_VERSION:
            raise WireError(f"peer speaks wire version {version}, we speak {WIRE_VERSION}")
        self.peer_id = _decode_id(peer)
        if self.peer_id == self.node_id:
            raise WireError("the peer claims our own node id (is it ourselves?)")
        self._transcript = _transcript(self.nonce, nonce_a, self.node_id, self.peer_id)
        return _mac(self.key, b"initiator", self._transcript)

    def accepted(self, accept: bytes) -> None:
        """Check the acceptor's ACCEPT (it knows the key too). Raises WireError."""
        if not self._transcript or len(accept) != ACCEPT_SIZE:
            raise WireError("bad accept")
        if not hmac.compare_digest(accept, _mac(self.key, b"acceptor", self._transcript)):
            raise WireError("peer does not know the cluster secret")
        self.frame_key = _mac(self.key, b"frames", self._transcript)


@dataclass
class Acceptor:
    """The handshake as seen by the node that accepts the connection."""

    key: bytes
    node_id: str
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE))
    peer_id: str = ""
    frame_key: bytes = b""
    _transcript: bytes = b""

    def challenge(self, hello: bytes) -> bytes:
        """Read the initiator's HELLO; return our CHALLENGE (which reveals
        nothing about the key). Raises WireError."""
        if len(hello) != HELLO_SIZE:
            raise WireError("bad hello size")
        magic, version, peer, nonce_i = _HELLO.unpack(hello)
        if magic != MAGIC:
            raise WireError("not a pgq bus connection")
        if version != WIRE_VERSION:
            raise WireError(f"peer speaks wire version {version}, we speak {WIRE_VERSION}")
        self.peer_id = _decode_id(peer)
        if self.peer_id == self.node_id:
            raise WireError("the peer claims our own node id")
        self._transcript = _transcript(nonce_i, self.nonce, self.peer_id, self.node_id)
        return _CHALLENGE.pack(WIRE_VERSION, _ascii_id(self.node_id), self.nonce)

    def verify(self, proof: bytes) -> bytes:
        """Check the initiator's PROOF; return our ACCEPT. Raises WireError."""
        if not self._transcript or len(proof) != PROOF_SIZE:
            raise WireError("bad proof")
        if not hmac.compare_digest(proof, _mac(self.key, b"initiator", self._transcript)):
            raise WireError("peer does not know the cluster secret")
        self.frame_key = _mac(self.key, b"frames", self._transcript)
        return _mac(self.key, b"acceptor", self._transcript)


def _nonce(sequence: int) -> bytes:
    return b"\0\0\0\0" + sequence.to_bytes(8, "big")


@dataclass
class FrameWriter:
    """Encrypts frames for one connection."""

    key: bytes
    max_frame: int = MAX_FRAME
    sequence: int = 0
    _aead: ChaCha20Poly1305 | None = None

    def frame(self, payload: bytes) -> bytes:
        """One frame for ``payload``. Raises FrameTooBig if it cannot fit."""
        length = len(payload) + TAG
        if length > self.max_frame:
            raise FrameTooBig(f"a {len(payload)}-byte message exceeds the bus frame limit")
        if self._aead is None:
            self._aead = ChaCha20Poly1305(self.key)
        self.sequence += 1
        header = _LENGTH.pack(length)
        return header + self._aead.encrypt(_nonce(self.sequence), payload, MAGIC + header)


@dataclass
class FrameReader:
    """Decrypts and checks frames for one connection; feed it bytes as they come."""

    key: bytes
    max_frame: int = MAX_FRAME
    sequence: int = 0
    _buffer: bytearray = field(default_factory=bytearray)
    _aead: ChaCha20Poly1305 | None = None

    def feed(self, data: bytes) -> list[bytes]:
        """Return the payloads completed by ``data``. Raises WireError on any bad frame."""
        if self._aead is None:
            self._aead = ChaCha20Poly1305(self.key)
        self._buffer += data
        payloads = []
        while len(self._buffer) >= 4:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length < TAG or length > self.max_frame:
                raise WireError(f"frame length {length} out of bounds")
            if len(self._buffer) < 4 + length:
                break
            header = bytes(self._buffer[:4])
            sealed = bytes(self._buffer[4:4 + length])
            del self._buffer[:4 + length]
            try:
                payloads.append(self._aead.decrypt(_nonce(self.sequence + 1), sealed,
                                                   MAGIC + header))
            except InvalidTag:
                raise WireError("frame authentication failed (tampered, replayed, "
                                "reordered or lost)") from None
            self.sequence += 1
        return payloads

    def pending(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return len(self._buffer)
