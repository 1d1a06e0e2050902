"""Argument validation: Disque's defaults, limits and error types (no database)."""

from __future__ import annotations

import math

import pytest

from pgq import arguments as args
from pgq.errors import InvalidArgumentError, InvalidTypeError, PgqError


def params(**overrides):
    values = dict(replicate=None, delay=0, retry=None, ttl=None, maxlen=None,
                  asynchronous=False, timeout=None)
    values.update(overrides)
    return args.job_params(**values)


def test_defaults_follow_disque():
    p = params()
    assert p.ttl == 86400
    assert p.retry == 300  # min(ttl/10, 300)
    assert p.replicate is None and p.delay == 0 and p.maxlen is None  # the node decides W


@pytest.mark.parametrize(("ttl", "retry"), [(100, 10), (5, 1), (3000, 300), (1, 1)])
def test_default_retry_is_a_tenth_of_ttl_between_1_and_300(ttl, retry):
    assert params(ttl=ttl).retry == retry


def test_delay_must_be_shorter_than_ttl():
    with pytest.raises(InvalidArgumentError, match="delay"):
        params(delay=10, ttl=10)
    assert params(delay=9.5, ttl=10).delay == 9.5


def test_retry_zero_requires_replicate_one():
    with pytest.raises(InvalidArgumentError, match="at-most-once"):
        params(retry=0, replicate=2)
    assert params(retry=0, replicate=1).retry == 0


@pytest.mark.parametrize(("name", "value"), [
    ("ttl", 0), ("ttl", -1), ("ttl", math.inf), ("ttl", math.nan), ("ttl", 10 * 365 * 86400 + 1),
    ("delay", -1), ("retry", -0.5), ("replicate", 0), ("replicate", 65536), ("maxlen", 0),
    ("timeout", -1),
])
def test_out_of_range_values_are_value_errors(name, value):
    with pytest.raises(InvalidArgumentError) as info:
        params(**{name: value})
    assert isinstance(info.value, ValueError) and isinstance(info.value, PgqError)
    assert name in str(info.value)


@pytest.mark.parametrize(("name", "value"), [
    ("ttl", "10"), ("delay", True), ("retry", [1]), ("replicate", 1.5), ("maxlen", "3"),
    ("asynchronous", 1),
])
def test_wrong_types_are_type_errors(name, value):
    with pytest.raises(InvalidTypeError) as info:
        params(**{name: value})
    assert isinstance(info.value, TypeError)


def test_queue_names():
    assert args.queue_name("a queue; DROP TABLE x; --'\"") == "a queue; DROP TABLE x; --'\""
    assert args.queue_name("é" * 256) == "é" * 256  # 512 bytes
    for bad in ("", "a\x00b", "é" * 257, "\udc80"):
        with pytest.raises(InvalidArgumentError):
            args.queue_name(bad)
    with pytest.raises(InvalidTypeError):
        args.queue_name(b"bytes")
    assert args.queue_names(["b", "a", "b"]) == ["b", "a"]
    with pytest.raises(InvalidArgumentError):
        args.queue_names([])


def test_bodies():
    assert args.body_bytes("héllo", 100) == "héllo".encode()
    assert args.body_bytes(bytearray(b"x"), 100) == b"x"
    assert args.body_bytes(memoryview(b"xy"), 100) == b"xy"
    with pytest.raises(InvalidArgumentError, match="over the limit"):
        args.body_bytes(b"x" * 101, 100)
    with pytest.raises(InvalidTypeError):
        args.body_bytes(12, 100)
    with pytest.raises(InvalidTypeError):
        args.body_bytes(None, 100)


def test_counts_and_timeouts():
    assert args.count(1) == 1 and args.count(args.MAX_COUNT) == args.MAX_COUNT
    for bad in (0, -1, args.MAX_COUNT + 1, 10**12):
        with pytest.raises(InvalidArgumentError):
            args.count(bad)
    with pytest.raises(InvalidTypeError):
        args.count(2.0)
    assert args.timeout(None) is None
    assert args.timeout(0) is None  # Disque: TIMEOUT 0 blocks forever
    assert args.timeout(1.5) == 1.5


@pytest.mark.parametrize("dsn", [
    "host=db password=s3cret dbname=pgq",  # no user (PGUSER): the password was dropped
    "host=a,b port=5432,5433 user=u dbname=pgq",  # was one host 'a,b', port '5432,'
    "host=a,b dbname=q",
    "host=::1 port=5 user=u password=p%@ dbname=x sslmode=require",
    "host=db user=u dbname=pgq",
])
def test_a_key_value_dsn_becomes_a_url_libpq_reads_the_same(dsn):
    from psycopg.conninfo import conninfo_to_dict

    from pgq.dsn import libpq_url

    url = libpq_url(dsn)
    assert url.startswith("postgresql://") and conninfo_to_dict(url) == conninfo_to_dict(dsn)


def test_a_clients_checked_add_options_are_kept_by_value_and_type():
    """ClientCore keeps the JobParams of options it checked (a producer
    passes the same ones every time): the same values give the same
    params, with the client's default timeout; a value equal but of another
    type (True == 1) is checked on its own, and a refused one stays refused."""
    import pgq  # an AsyncClient connects lazily: no database here

    client = pgq.AsyncClient("postgresql://nobody@127.0.0.1:1/none", replication_timeout=7)
    options = dict(replicate=None, delay=0, retry=1, ttl=None, maxlen=None,
                   asynchronous=False, timeout=None)
    first = client.add_call("q", [b"x"], **options).params
    assert first.retry == 1.0 and first.timeout == 7 and first.ttl == args.DEFAULT_TTL
    assert client.add_call("other", [b"y"], **options).params is first
    for _ in range(2):
        with pytest.raises(InvalidTypeError, match="retry"):
            client.add_call("q", [b"x"], **{**options, "retry": True})
    assert client.add_call("q", [b"x"], **{**options, "retry": 1.0}).params == first
    assert client.add_call("q", [b"x"], **{**options, "timeout": 2}).params.timeout == 2
    with pytest.raises(InvalidArgumentError):  # checked again, not taken from the memo
        client.add_call("q", [b"x"], **{**options, "delay": 10**9})
    many = [client.add_call("q", [b"x"], **{**options, "retry": r}).params.retry
            for r in range(1, 600)]  # more combinations than it keeps
    assert many == [float(r) for r in range(1, 600)]
    # Idempotency keys are checked per call, kept out of the memo (each
    # keyed add names a new one, and would have emptied it every 256 adds).
    client.add_call("q", [b"x"], **options)  # in the memo again (the loop above emptied it)
    kept = len(client._params_memo)
    keyed = [client.add_call("q", [b"x"], key=f"order-{n}", **options).params for n in range(300)]
    assert [p.key for p in keyed] == [f"order-{n}" for n in range(300)]
    assert keyed[0].retry == 1.0 and len(client._params_memo) == kept
    with pytest.raises(InvalidArgumentError):
        client.add_call("q", [b"x"], key="", **options)
