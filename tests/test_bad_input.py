"""Bad input gets a clear, typed error before anything is stored, and hostile
queue names or bodies are stored and returned byte for byte."""

from __future__ import annotations

import pytest

import pgq
from pgq.errors import BadIdError, InvalidArgumentError, InvalidTypeError, PgqError

HOSTILE_NAMES = [
    "q'; DROP TABLE pgq.jobs; --",
    'q" OR 1=1 --',
    "q\\x00\\'%s%(x)s$1",
    "очередь/队列 🚀",
    "name with\nnewline\tand tab",
    "x" * 512,
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_sql_meta_characters_in_queue_names_are_just_names(client, db, name):
    job_id = client.add_job(name, b"payload")
    assert client.qlen(name) == 1
    assert client.qstat(name)["name"] == name
    job = client.get_job(name, nohang=True)[0]
    assert (job.id, job.queue, job.body) == (job_id, name, b"payload")
    assert client.ack_job(job_id) == 1
    assert db.execute("SELECT to_regclass('pgq.jobs') IS NOT NULL").fetchone() == (True,)


def test_bodies_keep_every_byte(client):
    body = bytes(range(256)) + b"\x00" * 10 + "é'\"%s".encode()
    client.add_job("bytes", body)
    assert client.get_job("bytes")[0].body == body


def test_oversize_body_is_refused_before_anything_is_stored(dsn, client):
    with pgq.Client(dsn, max_body_size=1024) as small:
        with pytest.raises(InvalidArgumentError, match="over the limit of 1024"):
            small.add_job("big", b"x" * 1025)
        with pytest.raises(InvalidArgumentError):
            small.add_jobs("big", [b"ok", b"x" * 2000])
        small.add_job("big", b"x" * 1024)
    assert client.qlen("big") == 1
    with pytest.raises(InvalidArgumentError):
        pgq.Client(dsn, max_body_size=2**40)


@pytest.mark.parametrize("call", [
    lambda c: c.ack_job("D-123"),
    lambda c: c.nack_job("not-an-id"),
    lambda c: c.show("D-xxxxxxxx-aaaaaaaaaaaaaaaaaaaaaaaa-0001"),
    lambda c: c.working("D-01234567-aaaaaaaaaaaaaaaaaaaaaaa!-0001"),
    lambda c: c.del_job(),
    lambda c: c.fast_ack(""),
])
def test_malformed_ids_are_bad_id_errors(client, call):
    with pytest.raises(BadIdError) as info:
        call(client)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("call", "error"), [
    (lambda c: c.add_job(42, b"x"), InvalidTypeError),
    (lambda c: c.add_job("q", 42), InvalidTypeError),
    (lambda c: c.add_job("q", None), InvalidTypeError),
    (lambda c: c.add_job("q", b"x", ttl="1h"), InvalidTypeError),
    (lambda c: c.add_job("q", b"x", delay=-1), InvalidArgumentError),
    (lambda c: c.add_jobs("q", b"not a list"), InvalidTypeError),
    (lambda c: c.add_jobs("q", 5), InvalidTypeError),  # Python's own TypeError before
    (lambda c: c.add_jobs("q", None), InvalidTypeError),
    (lambda c: c.wait_replicated(5), InvalidTypeError),
    (lambda c: c.add_job("q", b"x", delay=10**400), InvalidArgumentError),  # beyond any float
    (lambda c: c.get_job(), InvalidArgumentError),
    (lambda c: c.get_job("q", count=0), InvalidArgumentError),
    (lambda c: c.get_job("q", count=10**12), InvalidArgumentError),
    (lambda c: c.get_job("q", count="10"), InvalidTypeError),
    (lambda c: c.get_job("q", timeout=-1), InvalidArgumentError),
    (lambda c: c.get_job("q", nohang="yes"), InvalidTypeError),
    (lambda c: c.qpeek("q", 10**9), InvalidArgumentError),
    (lambda c: c.qscan(count=0), InvalidArgumentError),
    (lambda c: c.qscan("0"), InvalidArgumentError),
    (lambda c: c.jscan(states="bogus"), InvalidArgumentError),
    (lambda c: c.ack_job(*(["D-01234567-aaaaaaaaaaaaaaaaaaaaaaaa-0001"] * 100_001)),
     InvalidArgumentError),
    # Found by a read-only review: no cap on wait_replicated's IDs, and a
    # kept error with a NUL or a lone surrogate came back as psycopg's own
    # DataError or UnicodeEncodeError; a result had no size limit.
    (lambda c: c.wait_replicated(["D-01234567-aaaaaaaaaaaaaaaaaaaaaaaa-0001"] * 100_001),
     InvalidArgumentError),
    (lambda c: c.store_result("D-01234567-aaaaaaaaaaaaaaaaaaaaaaaa-0001", None, error="a\x00b"),
     InvalidArgumentError),
    (lambda c: c.store_result("D-01234567-aaaaaaaaaaaaaaaaaaaaaaaa-0001", None, error="\udc80"),
     InvalidArgumentError),
    (lambda c: c.store_result("D-01234567-aaaaaaaaaaaaaaaaaaaaaaaa-0001",
                              b"x" * (c.options.max_body_size + 1)), InvalidArgumentError),
])
def test_bad_arguments_are_typed_and_explained(client, call, error):
    with pytest.raises(error) as info:
        call(client)
    assert isinstance(info.value, PgqError) and str(info.value)


def test_a_wrong_connection_type_is_refused_before_the_async_client_connects():
    """AsyncClient opened its pool (and waited out the connect timeout of
    an unreachable database) before it looked at conn=; Client did not."""
    import anyio

    class NotAConnection:
        pass

    async def main() -> None:
        client = pgq.AsyncClient("postgresql://nobody@127.0.0.1:1/x", connect_timeout=1)
        with pytest.raises(InvalidTypeError):
            await client.ack_job("D-01234567-aaaaaaaaaaaaaaaaaaaaaaaa-0001", conn=NotAConnection())
        assert client._pool is None  # nothing was opened
        await client.close()

    anyio.run(main)


def test_unknown_client_options_and_dsn_types(dsn):
    with pytest.raises(InvalidTypeError, match="allowed"):
        pgq.Client(dsn, poolsize=3)
    for home in (5, b"/tmp/x"):  # Python's own TypeError from Path() before (a review)
        with pytest.raises(InvalidTypeError, match="home must be a directory path"):
            pgq.Client(home=home)
    with pytest.raises(InvalidArgumentError, match="NUL"):
        pgq.Client(home="/tmp/a\x00b")
    with pytest.raises(InvalidTypeError):
        pgq.Client(12345)
    with pytest.raises(InvalidArgumentError):
        pgq.Client("this is = not a valid === dsn")


def test_key_value_dsn_is_turned_into_a_url(dsn):
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    kv = make_conninfo(**conninfo_to_dict(dsn))
    with pgq.Client(kv) as client:
        assert client.dsn.startswith("postgresql://")
        assert conninfo_to_dict(client.dsn) == conninfo_to_dict(dsn)


def test_unreachable_database_is_a_typed_error():
    with pytest.raises(pgq.errors.DatabaseUnavailableError, match="cannot reach"):
        pgq.Client("postgresql://pgq:x@127.0.0.1:1/pgq", reconnect_timeout=1)


def test_pool_exhaustion_is_explained(dsn):
    # The pool's one connection taken, as by another thread's long call (a
    # blocked get_job no longer holds one while it waits: test_listener.py).
    with pgq.Client(dsn, pool_size=1, reconnect_timeout=0.5) as small:
        assert small.qlen("held") == 0
        with small._pool.connection():
            with pytest.raises(pgq.errors.DatabaseUnavailableError, match="pool_size"):
                small.qlen("held")


# ---------------------------------------------------------------- issue 10 §4, issue 15 §2


@pytest.mark.parametrize("cursor", [2**63, 2**64 - 1, 2**4200, int.from_bytes(b"a\x00b", "big"), -1])
def test_scan_cursors_that_no_call_returned_are_argument_errors(client, cursor):
    for scan in (client.qscan, client.jscan):
        with pytest.raises(InvalidArgumentError, match="cursor"):
            scan(cursor)


def test_a_real_cursor_round_trips_past_2_63(client):
    long_name = "q" * 40  # a cursor naming it is far above 2**63
    client.add_job(long_name, b"x")
    client.add_job("r", b"y")
    cursor, names = client.qscan(count=1)
    assert cursor > 2**63 and names
    assert client.qscan(cursor, count=10)[1]


@pytest.mark.parametrize("reason", ["bad\x00reason", "lone \ud800 surrogate"])
def test_dead_letter_reason_must_be_storable_text(client, reason):
    job_id = client.add_job("dl", b"x")
    with pytest.raises(InvalidArgumentError, match="reason"):
        client.dead_letter(job_id, reason=reason)
    assert client.qlen("dl") == 1  # nothing changed


def test_jscan_states_must_be_names(client):
    with pytest.raises(InvalidTypeError, match="states"):
        client.jscan(states=[["queued"]])


@pytest.mark.parametrize("dsn", ["host=x port=abc", "postgresql://u@h:99999/db",
                                 "host=x port=\u00b2", "host=x port=" + "1" * 5000])
def test_a_dsn_with_a_bad_port_is_an_argument_error(dsn):
    with pytest.raises(InvalidArgumentError, match="port"):
        pgq.Client(dsn)


@pytest.mark.parametrize("dsn,options", [
    ("host=a\x00b dbname=x", {}),  # libpq read host 'a'
    ("host=a\udc80 dbname=x", {}),  # a raw UnicodeEncodeError from inside psycopg
    ("host=a dbname=x", {"application_name": "app\x00"}),
    ("host=a dbname=x", {"application_name": "app\udc80"}),  # failed each connection, 30 s on
])
def test_a_dsn_or_application_name_libpq_cannot_send_is_an_argument_error(dsn, options):
    with pytest.raises(InvalidArgumentError):
        pgq.Client(dsn, **options)


def test_wrong_password_fails_at_once_with_the_servers_reason(dsn):
    import time

    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(dsn)
    params["password"] = "not-the-password"
    started = time.monotonic()
    with pytest.raises(pgq.errors.DatabaseUnavailableError) as info:
        pgq.Client(make_conninfo(**params))  # default reconnect_timeout: 30 s
    assert time.monotonic() - started < 3  # an authentication error is never retried
    message = str(info.value)
    assert "password authentication failed" in message and "not-the-password" not in message


def test_missing_database_fails_at_once_with_the_servers_reason(dsn):
    import time

    missing = dsn.rsplit("/", 1)[0] + "/no_such_database_here"
    if "?" in dsn:
        missing += "?" + dsn.split("?", 1)[1]
    started = time.monotonic()
    with pytest.raises(pgq.errors.DatabaseUnavailableError, match="does not exist"):
        pgq.Client(missing)
    assert time.monotonic() - started < 3


def test_nobody_answering_fails_within_seconds_with_the_cause():
    import time

    started = time.monotonic()
    with pytest.raises(pgq.errors.DatabaseUnavailableError, match="Connection refused"):
        pgq.Client("postgresql://pgq:x@127.0.0.1:1/pgq")  # default reconnect_timeout: 30 s
    # the first connection gets a few seconds (a server may be starting up)
    assert time.monotonic() - started < 8
