"""The cluster secret: made strong, checked, stretched.

Every node of a cluster holds the same secret; the bus handshake proves
knowledge of it and derives per-connection keys from it (:mod:`.wire`).

Invariants:

* New secrets are 32 random bytes, written as 43 URL-safe base64
  characters (``pgq cluster secret``, or ``DIR/cluster.secret`` on a first
  start). Files holding one are created 0600 atomically.
* A weak secret is refused before the node starts, with the command that
  makes a good one: shorter than 32 bytes, or made of fewer than 12
  distinct characters.
* The bus never uses the secret as a key directly: :func:`stretch` runs it
  through scrypt (~50 ms, 16 MiB), so each guess of someone who recorded a
  handshake costs that much, and a passphrase-style secret is no longer
  found at 200k guesses a second.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from pgq.errors import InvalidArgumentError

__all__ = ["MIN_BYTES", "new_secret", "check", "load", "stretch", "HOW_TO_MAKE"]

MIN_BYTES = 32
MIN_DISTINCT = 12
HOW_TO_MAKE = "make one with `pgq cluster secret > FILE` and give FILE to every node"
_SALT = b"pgq cluster bus v2"


def new_secret() -> str:
    return secrets.token_urlsafe(MIN_BYTES)


def check(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_BYTES:
        raise InvalidArgumentError(
            f"the cluster secret in {where} is too short ({len(secret)} bytes, at least "
            f"{MIN_BYTES}): {HOW_TO_MAKE}")
    if len(set(secret)) < MIN_DISTINCT:
        raise InvalidArgumentError(
            f"the cluster secret in {where} is too easy to guess (only {len(set(secret))} "
            f"distinct characters): {HOW_TO_MAKE}")
    return secret


def load(secret_file: str | None, data: Path | None) -> bytes:
    """The cluster secret: --secret-file, else $PGQ_CLUSTER_SECRET, else
    DIR/cluster.secret (made on a first start). Checked."""
    from pgq.embedded import write_private

    if secret_file:
        return check(Path(secret_file).read_bytes().strip(), secret_file)
    if os.environ.get("PGQ_CLUSTER_SECRET"):
        return check(os.environ["PGQ_CLUSTER_SECRET"].encode().strip(), "$PGQ_CLUSTER_SECRET")
    if data is None:
        raise InvalidArgumentError(
            f"a cluster secret is needed: --secret-file FILE or PGQ_CLUSTER_SECRET ({HOW_TO_MAKE})")
    path = data / "cluster.secret"
    if not path.exists():
        write_private(path, new_secret() + "\n")
        import logging

        logging.getLogger("pgq.cluster").warning(
            "created a new cluster secret in %s: give the same file to every other node "
            "with --secret-file", path)
    return check(path.read_bytes().strip(), str(path))


def stretch(secret: bytes) -> bytes:
    """The bus's master key: scrypt of the secret (slow on purpose)."""
    return hashlib.scrypt(secret, salt=_SALT, n=2**14, r=8, p=1, maxmem=64 * 1024 * 1024, dklen=32)
