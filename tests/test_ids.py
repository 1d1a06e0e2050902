"""Job and node IDs: Disque's format, parity rule and validation."""

from __future__ import annotations

import base64
import re
import time

import pytest

from pgq.errors import BadIdError, InvalidTypeError
from pgq.ids import (
    is_at_least_once_id,
    new_job_id,
    new_job_ids,
    new_node_id,
    ttl_minutes_field,
    ttl_seconds_from_id,
    validate_job_id,
    validate_job_ids,
)

NODE = "0123456789abcdef0123456789abcdef01234567"


def test_job_id_has_disque_layout():
    job_id = new_job_id(NODE, 86400, 300)
    assert len(job_id) == 40
    assert job_id[:2] == "D-" and job_id[10] == "-" and job_id[35] == "-"
    assert job_id[2:10] == NODE[:8]
    assert re.fullmatch(r"[A-Za-z0-9+/]{24}", job_id[11:35])
    assert validate_job_id(job_id) == job_id


STANDARD = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
SORTABLE = "+/0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _decode(field: str) -> bytes:
    return base64.b64decode(field.translate(str.maketrans(SORTABLE, STANDARD)))


def test_id_field_is_creation_time_counter_and_72_random_bits():
    before = time.time_ns() // 1_000_000
    raw = _decode(new_job_id(NODE, 60, 1)[11:35])
    after = time.time_ns() // 1_000_000
    assert len(raw) == 18
    assert before <= int.from_bytes(raw[:6], "big") <= after
    ids = {new_job_id(NODE, 60, 1) for _ in range(5000)}
    assert len(ids) == 5000
    batch = new_job_ids(NODE, 60, 1, 5000)
    assert len(set(batch)) == 5000 and not ids & set(batch)
    assert {len(_decode(i[11:35])) for i in batch} == {18}
    assert [int.from_bytes(_decode(i[11:35])[6:9], "big") for i in batch] == list(range(5000))
    assert batch == sorted(batch)


def test_a_lone_id_is_encoded_as_the_first_of_a_batch():
    """One job's ID takes a shorter path (one encoding of its 18 bytes):
    the same characters as the batch's three encodings."""
    random = bytes(range(1, 19))

    def entropy(n: int) -> bytes:
        return random[:n]

    for millis in (0, 1, 1_764_000_000_000, 2**48 - 1):
        [lone] = new_job_ids(NODE, 86400, 300, 1, millis=millis, random_bytes=entropy)
        first = new_job_ids(NODE, 86400, 300, 2, millis=millis, random_bytes=entropy)[0]
        assert lone == first
        assert _decode(lone[11:35]) == millis.to_bytes(6, "big") + b"\0\0\0" + random[:9]


def test_ids_sort_by_creation_time():
    # The primary key then grows at its right edge (see pgq.ids).
    older = new_job_ids(NODE, 60, 1, 100)
    time.sleep(0.002)
    newer = new_job_ids(NODE, 60, 1, 100)
    assert max(older) < min(newer)
    assert SORTABLE == "".join(sorted(SORTABLE))


@pytest.mark.parametrize(("ttl", "retry", "minutes"), [
    (86400, 300, 1441),  # 1440 minutes, forced odd for at-least-once
    (86400, 0, 1440),    # even for at-most-once
    (60, 1, 1),
    (59, 0, 0),
    (59, 5, 1),
    (10**9, 1, 65535),   # capped, already odd
    (10**9, 0, 65534),   # capped and forced even
])
def test_ttl_field_encodes_minutes_and_delivery_mode(ttl, retry, minutes):
    assert int(ttl_minutes_field(ttl, retry), 16) == minutes
    job_id = new_job_id(NODE, ttl, retry)
    assert is_at_least_once_id(job_id) == (retry > 0)
    assert ttl_seconds_from_id(job_id) == minutes * 60


@pytest.mark.parametrize("bad", [
    "",
    "D-0123456-abcdefghijklmnopqrstuvwx-05a1",      # 39 chars
    "X-01234567-abcdefghijklmnopqrstuvwx-05a1",     # wrong prefix
    "D-01234567_abcdefghijklmnopqrstuvwx-05a1",     # no dash at 10
    "D-01234567-abcdefghijklmnopqrstuvwx_05a1",     # no dash at 35
    "D-0123456z-abcdefghijklmnopqrstuvwx-05a1",     # non-hex node prefix
    "D-01234567-abcdefghijklmnopqrstuv;x-05a1",     # not base64
    "D-01234567-abcdefghijklmnopqrstuvwx-05g1",     # non-hex TTL
    "D-01234567-abcdefghijklmnopqrstuvwx-05a1'; DROP TABLE pgq.jobs; --",
])
def test_malformed_ids_are_rejected(bad):
    with pytest.raises(BadIdError):
        validate_job_id(bad)


def test_one_bad_id_rejects_all():
    good = new_job_id(NODE, 60, 1)
    with pytest.raises(BadIdError):
        validate_job_ids([good, "nope"])
    with pytest.raises(BadIdError):
        validate_job_ids([])


def test_non_string_id_is_a_type_error():
    with pytest.raises(InvalidTypeError):
        validate_job_id(12345)
    assert issubclass(BadIdError, ValueError)


def test_node_ids_are_40_hex():
    node = new_node_id()
    assert re.fullmatch(r"[0-9a-f]{40}", node)


def test_the_entropy_pool_never_hands_out_the_same_bytes_twice():
    import threading

    from pgq.ids import _EntropyPool

    pool = _EntropyPool()
    taken: list[bytes] = []

    def take() -> None:
        for _ in range(2000):  # 9 bytes each: several refills of 4 KiB per thread
            taken.append(pool(9))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(len(b) == 9 for b in taken)
    assert len(set(taken)) == len(taken)  # 72 random bits: a repeat means reused bytes
    assert len(pool(5000)) == 5000  # a large draw goes to the OS directly


def test_a_forked_child_does_not_reuse_its_parents_buffered_entropy():
    import os

    from pgq.ids import _EntropyPool

    pool = _EntropyPool()
    pool(9)
    left = pool._buffer[pool._offset:]
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what would the parent hand out next?
        os.write(writer, pool(9))
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(reader, 9)
    os.close(reader)
    os.close(writer)
    assert child != left[:9]
    assert pool(9) == left[:9]  # the parent goes on with its own
