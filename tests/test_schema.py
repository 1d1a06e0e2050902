"""Schema pgq: made only by migrations, equal to the SQLAlchemy metadata, with
the functions, triggers and views the library and users rely on."""

from __future__ import annotations

import threading

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

import pgq
from pgq.migrate import SCHEMA_VERSION, head_revision
from pgq.schema import metadata


def test_migrated_schema_equals_metadata(dsn):
    # Reflect with schema pgq off the search path, so PostgreSQL prints
    # defaults fully qualified, as the metadata writes them.
    engine = create_engine(
        "postgresql+psycopg://", poolclass=NullPool,
        creator=lambda: psycopg.connect(dsn, options="-c search_path=public"))
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "include_schemas": True,
            "version_table_schema": "pgq",
            "compare_type": True,
            "compare_server_default": True,
            "include_object": lambda obj, name, type_, reflected, compare_to:
                not (type_ == "table" and name == "alembic_version"),
        })
        diff = compare_metadata(context, metadata)
    engine.dispose()
    assert [d for d in diff if not _same_volatile_default(d)] == []


def _same_volatile_default(change) -> bool:
    """Alembic compares defaults by evaluating both in SELECT a = b; a volatile
    default (clock_timestamp(), nextval()) never equals itself that way, so an
    identical text is accepted as no change."""
    if not isinstance(change, list) or len(change) != 1 or change[0][0] != "modify_default":
        return False
    *_, reflected, declared = change[0]
    return reflected is not None and declared is not None and \
        str(reflected.arg.text) == str(declared.arg.text)


def test_library_schema_version_is_the_newest_migration():
    assert SCHEMA_VERSION == head_revision()


def test_storage_settings_of_the_hot_table(db):
    options = db.execute(
        "SELECT reloptions FROM pg_class WHERE oid = 'pgq.jobs'::regclass").fetchone()[0]
    assert "fillfactor=70" in options
    assert "vacuum_truncate=false" in options  # no ACCESS EXCLUSIVE stall when it empties
    for table in ("acks", "outbox"):
        assert "vacuum_truncate=false" in db.execute(
            "SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (f"pgq.{table}",)).fetchone()[0]
    assert any(o.startswith("autovacuum_vacuum_scale_factor=") for o in options)
    indexes = dict(db.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'pgq' AND tablename = 'jobs'"
    ).fetchall())
    assert "WHERE (state = 'queued'::text)" in indexes["jobs_queued_idx"]
    assert "requeue_at IS NOT NULL" in indexes["jobs_timer_idx"]
    persistence = db.execute(
        "SELECT relpersistence FROM pg_class WHERE oid = 'pgq.waiters'::regclass").fetchone()[0]
    assert persistence == "u"


def test_no_row_triggers_on_the_hot_table(db):
    triggers = db.execute("""
        SELECT tgname, (tgtype & 1) = 1 AS per_row FROM pg_trigger
        WHERE tgrelid = 'pgq.jobs'::regclass AND NOT tgisinternal""").fetchall()
    assert {name for name, _ in triggers} == {
        "count_inserted_jobs", "count_updated_jobs", "count_deleted_jobs", "count_truncated_jobs"}
    assert not any(per_row for _, per_row in triggers)


def test_views_and_functions_exist(db):
    views = {r[0] for r in db.execute(
        "SELECT viewname FROM pg_views WHERE schemaname = 'pgq'").fetchall()}
    assert views == {"queue_stats", "job_counts", "job_history", "cluster_state", "cluster_nodes",
                     "dead_letter_queues", "dead_letter_jobs", "live_jobs"}
    functions = {r[0] for r in db.execute(
        "SELECT proname FROM pg_proc WHERE pronamespace = 'pgq'::regnamespace").fetchall()}
    assert {"sweep", "expire_jobs", "requeue_due", "expire_acks", "compact_counters",
            "recount"} <= functions


def test_migrate_is_idempotent_and_serialised(server):
    server.create_database("pgq_migrate_race")
    target = server.dsn("pgq_migrate_race")
    results, errors = [], []

    def run():
        try:
            results.append(pgq.migrate(target))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert results == [SCHEMA_VERSION] * 4
        assert pgq.migrate(target) == SCHEMA_VERSION
        with psycopg.connect(target) as conn:
            nodes = conn.execute("SELECT count(*) FROM pgq.meta WHERE key = 'node_id'").fetchone()
        assert nodes == (1,)
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE pgq_migrate_race WITH (FORCE)")


def test_client_refuses_an_unmigrated_database_with_the_fix(server):
    server.create_database("pgq_bare")
    try:
        with pytest.raises(pgq.errors.SchemaNotReadyError, match="pgq migrate"):
            pgq.Client(server.dsn("pgq_bare"), reconnect_timeout=2)
        with pgq.Client(server.dsn("pgq_bare"), migrate=True) as client:
            assert client.qlen("q") == 0
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE pgq_bare WITH (FORCE)")


def test_downgrade_removes_everything_but_the_version_table(server):
    from alembic import command

    from pgq.migrate import _alembic_config

    server.create_database("pgq_down")
    target = server.dsn("pgq_down")
    try:
        pgq.migrate(target)
        with pgq.Client(target) as client:  # a dead letter's history: 0003's downgrade failed on it
            job = client.add_job("down", b"x")
            client.get_job("down")
            assert client.dead_letter(job, reason="test") == 1
        engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(target),
                               poolclass=NullPool)
        with engine.connect() as connection:
            config = _alembic_config()
            config.attributes["connection"] = connection
            command.downgrade(config, "base")
        engine.dispose()
        with psycopg.connect(target) as conn:
            left = conn.execute("""
                SELECT count(*) FROM pg_class
                WHERE relnamespace = 'pgq'::regnamespace AND relname <> 'alembic_version'
                  AND relkind IN ('r', 'v', 'S')""").fetchone()[0]
        assert left == 0
        assert pgq.migrate(target) == SCHEMA_VERSION  # and up again
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE pgq_down WITH (FORCE)")


def test_a_migration_is_one_transaction_that_leaves_nothing_on_its_connection(server):
    """Behind PgBouncer in transaction mode every transaction may run on
    another server connection: the migration's session advisory lock and
    its SET lock_timeout, taken and undone in separate transactions, stayed
    on whichever server connection ran them, and every later migration
    waited for that lock with no timeout. One transaction, with a
    transaction-level lock and SET LOCAL, leaves nothing behind wherever it
    ran."""
    from alembic import command
    from sqlalchemy import event, text

    from pgq.migrate import _alembic_config

    server.create_database("pgq_onetx")
    target = server.dsn("pgq_onetx")
    try:
        engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(target),
                               poolclass=NullPool)
        commits: list[object] = []
        with engine.connect() as connection:
            event.listen(connection, "commit", commits.append)
            config = _alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "0010")
            assert len(commits) == 1  # three before: lock, upgrade, unlock
            command.upgrade(config, "head")  # from a schema that exists
            assert len(commits) == 2
            assert connection.execute(text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                "AND pid = pg_backend_pid()")).scalar() == 0
            assert connection.execute(text("SHOW lock_timeout")).scalar() == "0"
        engine.dispose()
        assert pgq.migrate(target) == SCHEMA_VERSION
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE pgq_onetx WITH (FORCE)")


def test_a_migration_behind_a_long_transaction_gives_up_instead_of_stalling_the_queue(server):
    """A DDL statement waiting for its lock behind a long transaction made
    every claim, add and ack queue behind it. Each statement now waits 2 s
    at most; the upgrade rolls back and tries again, then says why."""
    import time

    server.create_database("pgq_locked")
    target = server.dsn("pgq_locked")
    try:
        assert pgq.migrate(target, "0016") == "0016"
        with psycopg.connect(target) as holder:  # its transaction stays open
            holder.execute("LOCK TABLE pgq.jobs IN SHARE MODE")  # 0017 alters pgq.jobs
            began = time.monotonic()
            with pytest.raises(pgq.errors.SchemaNotReadyError, match="long transaction"):
                pgq.migrate(target, lock_wait=3)
            # Tried for 3 s, each try bounded by 2 s: far below the 60 s
            # bound here, where it used to wait as long as the holder.
            assert time.monotonic() - began < 60
            with psycopg.connect(target) as reader:  # rolled back whole
                assert reader.execute(
                    "SELECT version_num FROM pgq.alembic_version").fetchone() == ("0016",)
        assert pgq.migrate(target) == SCHEMA_VERSION  # the holder gone, it goes through
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE pgq_locked WITH (FORCE)")


def test_migrate_refuses_a_pgq_schema_that_is_not_ours(server):
    """Skytools PgQ also names its schema pgq: pgq migrate must stop, say so,
    and touch nothing."""
    server.create_database("pgq_skytools")
    target = server.dsn("pgq_skytools")
    try:
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute("DO $$ BEGIN IF to_regnamespace('pgq') IS NULL THEN CREATE SCHEMA pgq; "
                         "END IF; END $$")
            conn.execute("CREATE TABLE pgq.queue (queue_id serial PRIMARY KEY, queue_name text)")
            conn.execute("CREATE FUNCTION pgq.version() RETURNS text LANGUAGE sql AS $$ SELECT '3.5' $$")
        before = _objects(target)
        with pytest.raises(pgq.errors.SchemaNotReadyError, match="Skytools") as info:
            pgq.migrate(target)
        assert "Nothing was changed" in str(info.value)
        assert _objects(target) == before
        with pytest.raises(pgq.errors.SchemaNotReadyError):
            pgq.Client(target, migrate=True)
        assert _objects(target) == before
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE pgq_skytools WITH (FORCE)")


def _objects(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT relname, relkind::text FROM pg_class WHERE relnamespace = 'pgq'::regnamespace "
            "UNION ALL SELECT proname, 'f' FROM pg_proc WHERE pronamespace = 'pgq'::regnamespace "
            "ORDER BY 1").fetchall()


def test_every_function_and_view_reads_the_clock_through_pgq_now(db):
    """Schema 0008: one clock (functions, views, column defaults, statements), so
    the simulation's virtual time drives all of pgq's SQL."""
    readers = db.execute("""
        SELECT p.proname FROM pg_proc p
        WHERE p.pronamespace = 'pgq'::regnamespace AND p.proname <> 'now'
          AND p.prosrc LIKE '%statement_timestamp()%'
        UNION ALL
        SELECT c.relname FROM pg_class c
        WHERE c.relnamespace = 'pgq'::regnamespace AND c.relkind = 'v'
          AND pg_get_viewdef(c.oid) LIKE '%statement_timestamp()%'
        UNION ALL
        SELECT c.relname FROM pg_attrdef ad JOIN pg_class c ON c.oid = ad.adrelid
        WHERE c.relnamespace = 'pgq'::regnamespace
          AND pg_get_expr(ad.adbin, ad.adrelid) LIKE '%statement_timestamp()%'""").fetchall()
    assert readers == []
    from pgq.cluster import sql as node_sql

    from pgq import statements

    for module in (statements, node_sql):
        texts = [v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)]
        assert not [t for t in texts if "statement_timestamp()" in t and "pgq.now" not in t]


def test_a_session_setting_moves_pgq_now_and_the_leases_it_grants(client, dsn):
    import psycopg

    from pgq.floors import FROM_THE_FRONT

    client.add_job("clock", b"x", retry=60)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ahead = conn.execute("SELECT statement_timestamp() + interval '1 hour'").fetchone()[0]
        conn.execute("SELECT set_config('pgq.now', %s, false)", (ahead.isoformat(),))
        assert conn.execute("SELECT pgq.now()").fetchone()[0] == ahead
        conn.execute(statements_claim(), {"queues": ["clock"], "floors": [FROM_THE_FRONT],
                                          "count": 1}).fetchall()
        due = conn.execute("SELECT requeue_at FROM pgq.jobs WHERE queue = 'clock'").fetchone()[0]
        assert 60 <= (due - ahead).total_seconds() <= 60.25  # the lease: virtual now + retry (+ jitter)
        conn.execute("RESET pgq.now")
        assert conn.execute("SELECT pgq.now() > '2026-01-01' AND pgq.now() < '2030-01-01'").fetchone()[0]


def statements_claim() -> str:
    from pgq import statements

    return statements.CLAIM


def test_a_database_a_newer_pgq_migrated_says_to_upgrade_pgq(dsn, db):
    """Its revision is unknown here: `pgq migrate`, which the error used to
    advise, ended in alembic's own traceback."""
    db.execute("UPDATE pgq.alembic_version SET version_num = '0099'")
    with pytest.raises(pgq.errors.SchemaNotReadyError, match="newer .* upgrade pgq"):
        pgq.Client(dsn, reconnect_timeout=2)
    with pytest.raises(pgq.errors.SchemaNotReadyError, match="upgrade pgq"):
        pgq.migrate(dsn)


def test_a_database_that_refuses_the_migration_gives_an_error_not_a_traceback(server):
    """SQLAlchemy wraps the database's refusal in its own types, which the
    CLI and Client(migrate=True) let through as a traceback. Here the
    database is read-only; a role without CREATE on it is refused the same
    way."""
    server.create_database("pgq_readonly")
    try:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("ALTER DATABASE pgq_readonly SET default_transaction_read_only = on")
        with pytest.raises(pgq.errors.SchemaNotReadyError, match="refused the migration: .*read-only"):
            pgq.migrate(server.dsn("pgq_readonly"))
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE pgq_readonly WITH (FORCE)")
