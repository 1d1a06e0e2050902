"""What clients and the node process share is written once (pgq.contracts)
and the two faces of the client stay one API:

* every NOTIFY channel and outbox kind a statement uses is a contract's,
  and the node handles every kind;
* the CLI and the simulation speak to a node with the contract statements
  (an event and its doorbell, the leaving flag, what a node holds);
* the async client has every public method of the sync one, with the same
  parameters, as a coroutine; both drivers run every request kind.
"""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import psycopg
import pytest
from pgq.cluster import core
from pgq.cluster import sql as node_sql

from pgq import contracts, driver, protocol
from pgq import statements as client_sql
from pgq.aio import AsyncClient
from pgq.client import Client
from pgq.schema import outbox
from pgq.spark import sql as spark_sql

MODULES = (client_sql, node_sql, spark_sql, contracts)


def _statements():
    for module in MODULES:
        for name, text in vars(module).items():
            if name.isupper() and isinstance(text, str):
                yield f"{module.__name__}.{name}", text


def test_every_notify_names_a_contract_channel():
    channels = {contracts.JOBS_CHANNEL, contracts.DOORBELL_CHANNEL}
    seen = set()
    for name, text in _statements():
        for channel in re.findall(r"pg_notify\('([^']*)'", text):
            seen.add(channel)
            assert channel in channels or channel == contracts.REPLICATION_CHANNEL_PREFIX, name
    assert seen == {*channels, contracts.REPLICATION_CHANNEL_PREFIX}
    assert driver.CHANNEL == contracts.JOBS_CHANNEL


def test_every_outbox_kind_written_is_a_contract_kind_the_node_handles():
    written = set()
    for _name, text in _statements():
        for insert in re.findall(r"INSERT INTO pgq\.outbox[^;]*?(?:RETURNING|\)\s*$)", text, re.S):
            written |= set(re.findall(r"SELECT '(\w+)', ", insert))
    assert written and written <= set(contracts.OUTBOX_KINDS)
    handled = inspect.getsource(core.NodeCore._handle_outbox)
    for kind in contracts.OUTBOX_KINDS:
        assert f"c.OUTBOX_{kind.upper()}" in handled, kind
    check = next(c for c in outbox.constraints if getattr(c, "name", "") == "outbox_kind_check")
    assert re.findall(r"'(\w+)'::text", str(check.sqltext)) == list(contracts.OUTBOX_KINDS)


def test_no_inline_sql_in_the_cluster_cli():
    source = Path(__file__).parents[1].joinpath("pgq/cli/cluster.py").read_text()
    assert not re.search(r"\b(SELECT|INSERT|UPDATE|DELETE)\b", source)


@pytest.mark.parametrize("holders", [[], ["a"], ["a", "b"]])
def test_arguments_round_trip(holders):
    assert contracts.split_holders(contracts.holders_arg(holders)) == holders
    assert contracts.split_notice(contracts.notice_arg("nacks", holders)) == ("nacks", holders)
    assert contracts.split_notice(None) == ("", [])


def test_tell_node_writes_the_event_and_rings_the_doorbell(dsn):
    with psycopg.connect(dsn, autocommit=True) as listener, \
            psycopg.connect(dsn, autocommit=True) as conn:
        listener.execute(f"LISTEN {contracts.DOORBELL_CHANNEL}")
        conn.execute(contracts.TELL_NODE, {"kind": contracts.OUTBOX_MEET, "queue": None,
                                           "arg": "127.0.0.1:7711"})
        rung = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.channel for n in rung] == [contracts.DOORBELL_CHANNEL]
        assert conn.execute("SELECT kind, arg FROM pgq.outbox").fetchall() == [
            ("meet", "127.0.0.1:7711")]
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(contracts.TELL_NODE, {"kind": "bogus", "queue": None, "arg": None})


def test_the_leaving_flag_and_what_a_node_holds(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        for flag in (True, False, True):
            conn.execute(contracts.SET_LEAVING, {"leaving": flag})
            assert conn.execute("SELECT pgq.meta_value('leaving')").fetchone() == (
                "true" if flag else "false",)
        conn.execute("INSERT INTO pgq.jobs (id, queue, state, body, retry, expires_at, "
                     "nodes_delivered) VALUES "
                     "('D-mine', 'q', 'queued', '', 1, pgq.now() + interval '1 hour', ARRAY['me']), "
                     "('D-theirs', 'q', 'active', '', 1, pgq.now() + interval '1 hour', "
                     "ARRAY['other'])")
        assert conn.execute(contracts.HELD_BY_NODE, {"myself": "me"}).fetchone() == (1,)
        # Tombstones: one whose collection this node drives counts; a passive
        # one (waiting for a DELJOB) and an expired one do not.
        conn.execute("INSERT INTO pgq.acks (id, queue, expires_at, nodes, dummy) VALUES "
                     "('D-driven', 'q', pgq.now() + interval '1 hour', ARRAY['me', 'x'], false), "
                     "('D-passive', 'q', pgq.now() + interval '1 hour', NULL, false), "
                     "('D-expired', 'q', pgq.now() - interval '1 second', ARRAY['me'], false)")
        assert conn.execute(contracts.HELD_BY_NODE, {"myself": "me"}).fetchone() == (2,)


def test_a_direct_copy_leaves_an_id_there_alone_where_a_resent_copy_merges(dsn):
    # A client's direct copy is of a job it has just made: an ID there
    # already (an attempt that never committed at the origin) is not
    # merged, and the missing `stored` row fails that peer
    # (pgq.commands._failed_peers); a node's re-sent REPLJOB merges holders.
    def copy(job_id: str, holders: str) -> dict[str, object]:
        return {"id": job_id, "queue": "dq", "body": b"x", "ctime": 1, "repl": 2, "retry": 60.0,
                "delay": 0.0, "expires": 4e9, "nacks": 0, "adds": 0, "nodes": holders,
                "priority": 0, "key": None, "myself": "me"}

    def holders(job_id: str) -> list[str]:
        return conn.execute("SELECT nodes_delivered FROM pgq.jobs WHERE id = %s",
                            (job_id,)).fetchone()[0]

    def many(one: dict[str, object]) -> dict[str, object]:
        arrays = {array: [one[column]] for array, column in contracts.ONE_COPY_NAMES.items()}
        return {**arrays, "myself": one["myself"]}

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO pgq.meta (key, value) VALUES ('node_id', 'me') "
                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value")
        first = copy("D-dc", "a,me")
        assert conn.execute(contracts.DIRECT_COPY, first).fetchall() == [("stored", "D-dc", None)]
        assert conn.execute(contracts.DIRECT_COPY, copy("D-dc", "b,me")).fetchall() == []
        assert conn.execute(contracts.DIRECT_COPIES, many(copy("D-dc", "b,me"))).fetchall() == []
        assert holders("D-dc") == ["a", "me"]
        assert conn.execute(contracts.STORE_COPIES, many(copy("D-dc", "b,me"))).fetchall() == [
            ("stored", "D-dc", None)]
        assert holders("D-dc") == ["a", "b", "me"]
        # Not this node's database: nothing stored.
        assert conn.execute(contracts.DIRECT_COPY, {**copy("D-other", "a,me"),
                                                    "myself": "else"}).fetchall() == []


def test_the_async_client_has_the_sync_clients_api():
    def public(cls):
        return {n: v for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}

    sync, aio = public(Client), public(AsyncClient)
    assert set(sync) <= set(aio), set(sync) - set(aio)
    for name, method in sync.items():
        mine = [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]
        theirs = [(p.name, p.kind, p.default)
                  for p in inspect.signature(aio[name]).parameters.values()]
        assert mine == theirs, name
        assert inspect.iscoroutinefunction(aio[name]) or inspect.isasyncgenfunction(aio[name]), name


def test_both_drivers_run_every_request_kind():
    kinds = {k.__name__ for k in typing.get_args(protocol.Request)}
    for handler in (driver.SyncDriver._handle, driver.AsyncDriver._handle):
        handled = set(re.findall(r"isinstance\(request, (\w+)\)", inspect.getsource(handler)))
        assert handled == kinds, handler.__qualname__
