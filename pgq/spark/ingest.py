"""Bulk ingestion: a Spark DataFrame becomes pgq jobs (:func:`write_jobs`).

The protocol, per target node (see also :mod:`.plan` and docs/spark.md)::

    begin    record the ingestion in pgq.ingests (state 'staging', start time
             fixed by the first attempt); create an UNLOGGED staging table
    stage    Spark writes the node's rows into it through its JDBC data
             source (batched inserts, each batch its own transaction)
    merge    one transaction: lock the pgq.ingests row; if 'merged', stop;
             INSERT the staged rows into pgq.jobs; check the count; mark
             'merged'; drop the staging table; wake blocked consumers

Why it is safe:

* Nothing is visible to GETJOB before the merge commits, and the merge is
  one transaction: a node has all of its rows or none.
* Spark commits per batch, so a failed or retried task may leave rows
  staged twice: job IDs are a function of the row number, so duplicates
  collapse (ON CONFLICT DO NOTHING), and a row count check refuses input
  that changed between passes instead of half-ingesting it.
* A re-run with the same ``ingest_id`` skips nodes that merged (at most one
  merge per node) and stages the others afresh; rows whose job was already
  acknowledged (tombstone) are not recreated.
* With ``replicate=W`` every row is merged on W nodes under one ID before
  :func:`write_jobs` returns, so a job it reports added survives W-1 node
  failures, as with ``add_job(replicate=W)``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg

from .. import arguments as args
from ..dsn import libpq_url
from ..errors import (
    IngestError,
    InvalidArgumentError,
    InvalidTypeError,
    LeavingError,
    NoReplError,
    PausedError,
    PgqError,
    SchemaNotReadyError,
    first_line,
)
from ..ids import SORTABLE_BASE64, STANDARD_BASE64
from ..migrate import SCHEMA_VERSION
from . import sql
from .environment import check_session
from .jdbc import WRITE_STATEMENT_TIMEOUT_MS, JdbcTarget, jdbc_target
from .plan import IngestPlan

__all__ = ["write_jobs", "IngestResult", "Ingestion", "resolve_nodes"]

Progress = Callable[[str], None]
DEFAULT_REPLICATION = 3
# The connections that hold an ingestion (Ingestion._hold) sit idle while
# Spark runs: libpq keepalives, so a dead one is noticed by both ends.
HOLD_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
                   "keepalives_count": 3}
WRITE_BATCH_SIZE = 10_000
# An executor holds a whole JDBC batch: 10,000 bodies of 1 MiB would be
# about 10 GiB per task, where a default executor heap is 1 GiB.
WRITE_BATCH_BYTES = 64 * 1024 * 1024


def batch_rows(largest: int) -> int:
    """Rows per JDBC batch for bodies of at most ``largest`` bytes."""
    return max(1, min(WRITE_BATCH_SIZE, WRITE_BATCH_BYTES // max(largest, 1)))


@dataclass(frozen=True)
class IngestResult:
    """What :func:`write_jobs` did."""

    ingest_id: str
    queue: str
    jobs: int  # jobs created by this call (0 when an earlier run did it all)
    replicate: int
    copies_by_node: dict[str, int] = field(default_factory=dict)  # node name -> rows merged now
    already_done: bool = False
    seconds: float = 0.0


@dataclass
class _Node:
    dsn: str
    node_id: str
    name: str
    active: bool
    jdbc: JdbcTarget
    connected: str = ""  # the DSN of what the check connected to (libpq's environment applied)
    reachable: int = 1  # nodes of its cluster it reaches, itself included (1: alone)


def resolve_nodes(nodes: str | Sequence[str] | None) -> list[str]:
    """Target DSNs: the given ones, else ``$PGQ_DSN``, else the embedded server."""
    if nodes is None:
        import os

        env = os.environ.get("PGQ_DSN")
        if env:
            return [libpq_url(env)]
        from .. import embedded
        from ..migrate import migrate

        dsn = embedded.ensure_running().dsn
        migrate(dsn)
        return [dsn]
    if isinstance(nodes, str):
        nodes = [nodes]
    if not isinstance(nodes, (list, tuple)) or not nodes or not all(isinstance(n, str) for n in nodes):
        raise InvalidTypeError("nodes must be a DSN or a non-empty list of DSNs")
    dsns = [libpq_url(n) for n in nodes]
    if len(set(dsns)) != len(dsns):
        raise InvalidArgumentError("nodes lists the same database twice")
    return dsns


def _connect(dsn: str, **options: Any) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10, **options)
    except psycopg.OperationalError as exc:
        raise IngestError(f"cannot reach node database {_safe(dsn)}: {_safe(str(exc))}".strip()) \
            from exc


def _safe(dsn: str) -> str:
    """A DSN without its password, for messages (URL or key=value form:
    only the URL's was masked)."""
    from ..dsn import redact

    return redact(dsn)


def _describe(dsn: str) -> _Node:
    jdbc_target(dsn, statement_timeout_ms=WRITE_STATEMENT_TIMEOUT_MS)  # checks the DSN first
    with _connect(dsn) as conn:
        # Spark's JDBC driver reads none of libpq's environment (PGPORT,
        # PGUSER, PGPASSWORD, ~/.pgpass): it is given what this connection
        # used, or it reached port 5432 of database "postgres" as user "".
        connected = _as_connected(conn)
        target = jdbc_target(connected, statement_timeout_ms=WRITE_STATEMENT_TIMEOUT_MS)
        try:
            version = conn.execute("SELECT version_num FROM pgq.alembic_version").fetchone()
        except psycopg.errors.UndefinedTable:
            version = None
        if version is None or version[0] < SCHEMA_VERSION:
            raise SchemaNotReadyError(
                f"{_safe(dsn)} has no pgq schema {SCHEMA_VERSION} yet: run `pgq migrate --dsn DSN`")
        node_id, name, active, reachable = conn.execute(sql.NODE).fetchone()  # type: ignore[misc]
    # host:port/database when the node has no name (several databases may share a server)
    fallback = target.url.split("//", 1)[1].split("?", 1)[0]
    return _Node(dsn, node_id, name or fallback, bool(active), target, connected, int(reachable or 1))


def _as_connected(conn: psycopg.Connection[Any]) -> str:
    """The DSN of what ``conn`` connected to, its password included."""
    from psycopg.conninfo import make_conninfo

    params = dict(conn.info.get_parameters())
    params.update(host=conn.info.host, port=str(conn.info.port), dbname=conn.info.dbname,
                  user=conn.info.user)
    if conn.info.password:
        params["password"] = conn.info.password
    return make_conninfo("", **params)


def _replication(params: args.JobParams, nodes: list[_Node]) -> int:
    """W: ``replicate``, or by default ADDJOB's: min(3, the nodes the
    targets' cluster reaches), 1 for at-most-once jobs or a node alone.
    Counted from the listed targets, the default was 1 for one DSN of a
    3-node cluster (`pgq spark ingest` with $PGQ_DSN), and 1 when a target's
    node process was down: fewer copies than promised, without a word
    (found by a read-only review). Now such an ingestion is refused."""
    clustered = len(nodes) > 1 and all(n.active for n in nodes)
    wanted = params.replicate
    if wanted is None:
        reachable = max(n.reachable for n in nodes)
        wanted = 1 if params.retry == 0 else min(DEFAULT_REPLICATION, reachable)
        if wanted > len(nodes):
            raise NoReplError(
                f"{nodes[0].name} is a node of a cluster of {reachable}: its "
                f"jobs get {wanted} copies by default, as ADDJOB's, and {len(nodes)} target node(s) "
                f"were given: list {wanted} nodes (nodes=[...], or --node for each), or ask for "
                f"replicate={len(nodes)}")
    if wanted > len(nodes):
        raise NoReplError(
            f"replicate={wanted} needs at least {wanted} target nodes, {len(nodes)} given: "
            "list more nodes= or ask for fewer copies")
    if wanted > 1:
        if not clustered:
            raise InvalidArgumentError(
                f"replicate={wanted} needs target nodes of one running cluster (a node process "
                "serving each database): start them with `pgq node start`, or use replicate=1")
        with _connect(nodes[0].dsn) as conn:
            members = {r[0] for r in conn.execute(sql.CLUSTER_MEMBERS)}
        strangers = [n.name for n in nodes if n.node_id not in members]
        if strangers:
            raise InvalidArgumentError(
                f"nodes {', '.join(strangers)} are not alive members of {nodes[0].name}'s cluster: "
                "join them first (`pgq cluster meet`)")
    return wanted


class Ingestion:
    """One bulk ingestion: begin, stage, merge (see the module doc)."""

    def __init__(self, spark: Any, df: Any, queue: object, *, nodes: str | Sequence[str] | None,
                 replicate: object, delay: object, retry: object, ttl: object, body_col: str,
                 ingest_id: str | None, partitions: int | None, progress: Progress | None) -> None:
        self.spark = spark
        name = args.queue_name(queue)
        params = args.job_params(replicate=replicate, delay=delay, retry=retry, ttl=ttl,
                                 maxlen=None, asynchronous=False, timeout=None)
        if ingest_id is None:
            ingest_id = uuid.uuid4().hex
        if not isinstance(ingest_id, str) or not 1 <= len(ingest_id) <= 200:
            raise InvalidArgumentError("ingest_id must be a str of 1 to 200 characters")
        # Stored as text: a NUL was psycopg's DataError, a lone surrogate (an
        # --ingest-id of bytes that are not UTF-8) a UnicodeEncodeError, both
        # from deep inside (found by a read-only review).
        args.text("ingest_id", ingest_id, max_chars=200)
        if partitions is not None and (not isinstance(partitions, int) or partitions < 1):
            raise InvalidArgumentError("partitions must be a positive int")
        self.body_col = _check_body_column(df, body_col)
        self.df = df
        self.partitions = partitions
        self.progress = progress or (lambda _message: None)
        self.nodes = [_describe(dsn) for dsn in resolve_nodes(nodes)]
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            # Two spellings of one database (localhost and 127.0.0.1): they
            # shared one staging table, the first merge took only its own
            # rows and dropped it, and the second found the ingestion merged.
            raise InvalidArgumentError(
                "nodes lists the same database twice (two DSNs, one node id "
                f"{next(i for i in ids if ids.count(i) > 1)}): name each node once")
        w = _replication(params, self.nodes)
        self.plan = IngestPlan(ingest_id, name, tuple(n.node_id for n in self.nodes), w, params)
        self.started_ms = 0
        self.merged: set[int] = set()
        self.total = 0
        self.largest = 0  # bytes of the largest body (prepare counts it)
        self._holding: list[psycopg.Connection[Any]] = []  # the run's hold on its ID (_hold)

    # ------------------------------------------------------------ begin

    def begin(self) -> None:
        """Check the targets and how far earlier runs got (no change yet),
        holding the ingestion on every target until :meth:`finish`."""
        try:
            self._hold()
            self._check_targets()
        except BaseException:
            self._release()
            raise

    def _hold(self) -> None:
        """One run of an ingestion at a time: a session advisory lock on
        its ID on every target, held by a connection of this run until
        :meth:`finish`. Two runs of one ID at once each recreated the shared
        staging table under the other, and could merge the nodes under two
        sets of IDs (every job twice), or the second reported the first's
        jobs as its own (found by a read-only review)."""
        for node in self.nodes:
            # Idle for the whole Spark run: keepalives, or a NAT or a load
            # balancer that dropped it left the lock to a session the server
            # kept for hours, and every re-run was refused meanwhile.
            conn = _connect(node.dsn, **HOLD_KEEPALIVES)
            self._holding.append(conn)
            try:
                held = conn.execute(sql.HOLD_INGEST, {"ingest_id": self.plan.ingest_id}).fetchone()[0]  # type: ignore[index]
            except psycopg.Error as exc:
                raise IngestError(f"cannot hold ingestion {self.plan.ingest_id!r} on {node.name}: "
                                  f"{_safe(str(exc))}".strip()) from exc
            if not held:
                raise IngestError(
                    f"ingestion {self.plan.ingest_id!r} is running now (another run holds it on "
                    f"{node.name}): wait for it to end, then run it again (nodes merged are "
                    "skipped), or give this one another ingest_id")

    def _release(self) -> None:
        for conn in self._holding:
            with contextlib.suppress(psycopg.Error):
                # (the session's lock goes with its connection too, unless a
                # pooler in front keeps the server session)
                conn.execute(sql.RELEASE_INGEST, {"ingest_id": self.plan.ingest_id})
            with contextlib.suppress(psycopg.Error):
                conn.close()
        self._holding = []

    def _still_held(self) -> None:
        """Before the merges: the hold of every target is still there (a
        connection lost during the Spark run took its lock with it, and
        another run of the ingestion may have begun)."""
        for node, conn in zip(self.nodes, self._holding, strict=True):
            try:
                conn.execute("SELECT 1")
            except psycopg.Error as exc:
                raise IngestError(
                    f"ingestion {self.plan.ingest_id!r} lost its hold on {node.name} "
                    f"({_safe(str(exc)).strip()}): nothing was merged there; run it again with "
                    f"ingest_id={self.plan.ingest_id!r}") from exc

    def _check_targets(self) -> None:
        plan, states = self.plan, []
        for node in self.nodes:
            with _connect(node.dsn) as conn:
                if conn.execute(sql.QUEUE_PAUSED_IN, {"queue": plan.queue}).fetchone()[0]:  # type: ignore[index]
                    raise PausedError(f"queue {plan.queue!r} is paused for input on {node.name}: "
                                      "unpause it (pgq pause QUEUE none) and run again")
                state = conn.execute(sql.INGEST_STATE, {"ingest_id": plan.ingest_id}).fetchone()
                if state is None or state[1] != "merged":  # a merged node takes nothing more
                    _refuse_leaving(conn, node, "")
                states.append(state)
        for node, state in zip(self.nodes, states, strict=True):
            if state is not None and (state[0] != plan.queue or state[3] != plan.fingerprint()):
                raise InvalidArgumentError(
                    f"ingestion {plan.ingest_id!r} was started on {node.name} with other options "
                    f"(queue {state[0]!r}, {state[3]}): re-run it with the same ones, or use a new ingest_id")
        known = [s[2] for s in states if s is not None]
        self.started_ms = min(known) if known else time.time_ns() // 1_000_000
        self.merged = {i for i, s in enumerate(states) if s is not None and s[1] == "merged"}

    def open_staging(self) -> None:
        """Record the ingestion where it is not merged, with a fresh staging table."""
        plan = self.plan
        for i in self.pending:
            with _connect(self.nodes[i].dsn) as conn, conn.transaction():
                conn.execute(sql.RECORD_INGEST, {"ingest_id": plan.ingest_id, "queue": plan.queue,
                                                 "started_ms": self.started_ms,
                                                 "params": plan.fingerprint()})
                conn.execute(sql.staging(sql.DROP_STAGING, plan.staging_table))
                conn.execute(sql.staging(sql.CREATE_STAGING, plan.staging_table))

    @property
    def pending(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i not in self.merged]

    # ------------------------------------------------------------ stage

    def number_rows(self) -> None:
        """Persist the input with a row number source and check every body
        (one Spark pass; nothing is written anywhere yet)."""
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        body = F.col(self.body_col)
        if _is_string(self.df, self.body_col):
            body = F.encode(body, "UTF-8")
        source = self.df.select(body.alias("body"))
        if self.partitions is not None:
            source = source.repartition(self.partitions)
        # Persisted, so that every later pass sees the same partitions and rows.
        self._base = source.select(
            "body", F.spark_partition_id().alias("pid"), F.monotonically_increasing_id().alias("mid"),
        ).persist(StorageLevel.MEMORY_AND_DISK)
        self.progress("counting rows")
        stats = (self._base.groupBy("pid")
                 .agg(F.count(F.lit(1)).alias("n"),
                      F.sum(F.when(F.col("body").isNull(), 1).otherwise(0)).alias("nulls"),
                      F.max(F.length("body")).alias("largest"))
                 .collect())
        nulls = sum(r["nulls"] for r in stats)
        if nulls:
            raise InvalidArgumentError(
                f"column {self.body_col!r} has {nulls} null value(s): a job needs a body "
                "(filter them out or fill them in)")
        largest = max((r["largest"] or 0 for r in stats), default=0)
        self.largest = largest
        if largest > args.DEFAULT_MAX_BODY_SIZE:
            raise InvalidArgumentError(
                f"a body in column {self.body_col!r} has {largest} bytes, more than the "
                f"{args.DEFAULT_MAX_BODY_SIZE} a job may carry")
        self._offsets, total = {}, 0
        for row in sorted(stats, key=lambda r: r["pid"]):
            self._offsets[row["pid"]] = total
            total += row["n"]
        self.total = total

    def with_ids(self) -> Any:
        """The rows to stage: (seq, grp, id, body); None for an empty input."""
        from pyspark.sql import functions as F

        if not self.total:
            return None
        offsets = self._offsets
        # seq: dense row number in DataFrame order (the partition's offset
        # plus the row's index in it, which monotonically_increasing_id keeps
        # in its low 33 bits).
        offset_of = F.element_at(F.array(*[F.lit(offsets.get(p, 0)) for p in range(max(offsets) + 1)]),
                                 F.col("pid") + 1)
        seq = (offset_of + (F.col("mid") - F.shiftleft(F.col("pid").cast("long"), 33))).cast("long")
        plan = self.plan
        head = f"{self.started_ms:012x}{plan.key:08x}"
        prefixes = F.array(*[F.lit(node_id[:8]) for node_id in plan.node_ids])
        grp = F.pmod(seq, F.lit(plan.groups)).cast("int")
        job_id = F.concat(
            F.lit("D-"), F.element_at(prefixes, grp + 1), F.lit("-"),
            F.translate(F.base64(F.unhex(F.concat(F.lit(head), F.lpad(F.hex(seq), 16, "0")))),
                        STANDARD_BASE64, SORTABLE_BASE64),
            F.lit("-" + plan.ttl_field))
        return (self._base.withColumn("seq", seq).withColumn("grp", grp)
                .select("seq", "grp", job_id.alias("id"), "body"))

    def prepare(self) -> Any:
        """number_rows, open_staging and with_ids: ready to stage."""
        self.number_rows()
        self.open_staging()
        return self.with_ids()

    def stage(self, prepared: Any, node: int) -> None:
        """Spark writes node ``node``'s rows into its staging table (JDBC)."""
        from pyspark.sql import functions as F

        target = self.nodes[node]
        rows = prepared.filter(F.col("grp").isin(self.plan.groups_of(node)))
        self.progress(f"writing {self.plan.expected_rows(node, self.total):,} rows to {target.name}")
        (rows.write.format("jdbc")
         .options(**target.jdbc.options())
         .option("dbtable", f"pgq_staging.{self.plan.staging_table}")
         .option("batchsize", str(batch_rows(self.largest)))
         # Each batch commits on its own: one transaction per partition held
         # a snapshot, and with it VACUUM of the hot job table, for as long
         # as a partition took. The staging table is not seen by consumers,
         # and rows a retried Spark task stages twice are merged once.
         .option("isolationLevel", "NONE")
         .mode("append")
         .save())

    # ------------------------------------------------------------ merge

    def merge(self, node: int) -> int:
        """Move node ``node``'s staged rows into pgq.jobs in one transaction."""
        plan, target = self.plan, self.nodes[node]
        expected = plan.expected_rows(node, self.total)
        self.progress(f"merging {expected:,} jobs on {target.name}")
        with _connect(target.dsn) as conn, conn.transaction():
            state = conn.execute(sql.LOCK_INGEST, {"ingest_id": plan.ingest_id}).fetchone()
            if state is None:
                raise IngestError(f"ingestion {plan.ingest_id!r} vanished from {target.name}: run it again")
            if state[0] == "merged":  # a concurrent run finished it
                conn.execute(sql.staging(sql.DROP_STAGING, plan.staging_table))  # ours, if any
                self.merged.add(node)
                return 0
            again = f" (then run the ingestion again with ingest_id={plan.ingest_id!r})"
            if conn.execute(sql.QUEUE_PAUSED_IN, {"queue": plan.queue}).fetchone()[0]:  # type: ignore[index]
                raise PausedError(f"queue {plan.queue!r} was paused for input on {target.name} "
                                  f"during the ingestion: unpause it{again}")
            _refuse_leaving(conn, target, again)
            tombstoned = conn.execute(sql.staging(sql.TOMBSTONED, plan.staging_table)).fetchone()[0]  # type: ignore[index]
            inserted, present = self._insert_staged(conn, node, skip_acked=tombstoned > 0)
            if inserted + tombstoned + present != expected:
                raise IngestError(
                    f"{target.name} received {inserted + tombstoned + present} distinct rows of "
                    f"ingestion {plan.ingest_id!r}, {expected} expected: the DataFrame changed "
                    "between Spark's passes (non-deterministic input?); nothing was merged there. "
                    "Make the input deterministic (a file, or sort it) and run again")
            conn.execute(sql.MARK_MERGED, {"ingest_id": plan.ingest_id, "jobs": inserted})
            conn.execute(sql.staging(sql.DROP_STAGING, plan.staging_table))
            conn.execute(sql.NOTIFY_QUEUE, {"queue": plan.queue})
        self.merged.add(node)
        return inserted

    def _insert_staged(self, conn: psycopg.Connection[Any], node: int, *,
                       skip_acked: bool) -> tuple[int, int]:
        """The rows inserted, and those whose job was here already."""
        params = self.plan.merge_params(node, self.started_ms)
        table = self.plan.staging_table
        try:
            with conn.transaction():  # a savepoint: the fast form may fail on a duplicate
                fast = sql.staging(sql.merge_staged(deduplicate=False, skip_acked=skip_acked), table)
                return conn.execute(fast, params).rowcount, 0
        except psycopg.errors.UniqueViolation:
            # Rows staged twice (a retried Spark task): keep one of each. Or
            # a job here already under a row's ID (federation brought it):
            # it counts as merged, where the count check refused every run
            # of the ingestion for as long as that job lived (found by a
            # read-only review).
            present = conn.execute(sql.staging(sql.PRESENT, table)).fetchone()[0]  # type: ignore[index]
            careful = sql.staging(sql.merge_staged(deduplicate=True, skip_acked=skip_acked), table)
            return conn.execute(careful, params).rowcount, int(present)

    @contextlib.contextmanager
    def _failing(self, step: str) -> Iterator[None]:
        """A failure of Spark or of a node's database as an IngestError that
        names the ingestion to run again (a Py4JJavaError with a page of
        Java stack came out as it was, and the default ingest id was never
        shown, so the run could not be resumed)."""
        try:
            yield
        except PgqError:
            raise
        except Exception as exc:
            first = first_line(exc)[:500].rstrip(".")
            raise IngestError(
                f"ingestion {self.plan.ingest_id!r} failed while {step}: {first}. Fix the cause "
                f"and run it again with ingest_id={self.plan.ingest_id!r}: nodes that merged "
                "already are skipped, and no job is added twice") from exc

    def finish(self) -> None:
        self._release()
        base = getattr(self, "_base", None)
        if base is not None:
            base.unpersist()

    def run(self) -> IngestResult:
        started = time.perf_counter()
        self.begin()
        pending = self.pending
        try:
            if not pending:
                return IngestResult(self.plan.ingest_id, self.plan.queue, 0, self.plan.replicate,
                                    already_done=True, seconds=time.perf_counter() - started)
            # Spark's failures and the nodes' come out as an IngestError naming
            # the ingestion here too: a file of another format in the input, or
            # a failing expression, gave a page of Java stack from the count.
            with self._failing("counting the rows"):
                self.number_rows()
            if not self.total:
                # Nothing to add, and nothing recorded: an empty input marked
                # the ingest ID done with 0 jobs, and data arriving later under
                # that ID was dropped as "already done" (found by a review).
                return IngestResult(self.plan.ingest_id, self.plan.queue, 0, self.plan.replicate,
                                    seconds=time.perf_counter() - started)
            with self._failing("opening the staging tables"):
                self.open_staging()
            prepared = self.with_ids()
            if prepared is not None:
                # One Spark job per node, run side by side (Spark schedules
                # concurrent jobs from threads); then the merges, also in parallel.
                with ThreadPoolExecutor(max_workers=len(pending)) as pool, \
                        self._failing("writing the rows to the nodes"):
                    list(pool.map(lambda i: self.stage(prepared, i), pending))
            self._still_held()
            with ThreadPoolExecutor(max_workers=len(pending)) as pool, \
                    self._failing("merging the rows into the jobs"):
                counts = list(pool.map(self.merge, pending))
        finally:
            self.finish()
        # A job is created where its origin merges; elsewhere it gets copies.
        created = sum(self.plan.rows_of_group(g, self.total) for g in range(self.plan.groups)
                      if self.plan.holders(g)[0] in pending)
        return IngestResult(self.plan.ingest_id, self.plan.queue, created, self.plan.replicate,
                            {self.nodes[i].name: c for i, c in zip(pending, counts, strict=True)},
                            False, time.perf_counter() - started)


def _refuse_leaving(conn: psycopg.Connection[Any], node: _Node, again: str) -> None:
    """A node leaving its cluster takes no new job nor copy, as ADDJOB's;
    an ingestion stored them there, counted as one of the W holders, on a
    node about to be removed (found by a read-only review)."""
    if conn.execute(sql.NODE_LEAVING).fetchone()[0]:  # type: ignore[index]
        raise LeavingError(f"{node.name} is leaving its cluster and takes no new jobs: "
                           f"`pgq cluster leaving no` there{again}, or ingest into other nodes "
                           "under a new ingest id")


def _check_body_column(df: Any, body_col: str) -> str:
    if not hasattr(df, "schema") or not hasattr(df, "sparkSession"):
        raise InvalidTypeError(f"df must be a pyspark.sql.DataFrame, not {type(df).__name__}")
    if not isinstance(body_col, str) or body_col not in df.columns:
        raise InvalidArgumentError(
            f"the DataFrame has no column {body_col!r} (it has {', '.join(df.columns) or 'none'}): "
            "pass body_col=")
    kind = df.schema[body_col].dataType.typeName()
    if kind not in ("string", "binary"):
        raise InvalidArgumentError(
            f"column {body_col!r} is {kind}: a body must be a string or binary column "
            "(serialise it first, e.g. F.to_json(F.struct(...)))")
    return body_col


def _is_string(df: Any, column: str) -> bool:
    return bool(df.schema[column].dataType.typeName() == "string")


def write_jobs(df: Any, queue: str, *, nodes: str | Sequence[str] | None = None,
               replicate: int | None = None, delay: float = 0, retry: float | None = None,
               ttl: float | None = None, body_col: str = "body", ingest_id: str | None = None,
               partitions: int | None = None, progress: Progress | None = None) -> IngestResult:
    """Turn every row of ``df`` into a job of ``queue`` (Disque's ADDJOB options).

    ``nodes``: target node DSNs (default ``$PGQ_DSN``, else the embedded
    server); rows are spread evenly over them, each job on ``replicate``
    of them (default: ADDJOB's, min(3, the nodes the cluster reaches), so
    list that many nodes of a cluster; 1 on a node alone, or with retry=0). ``body_col``:
    a string (stored as UTF-8) or binary column. ``ingest_id``: name the
    ingestion to make re-runs idempotent (a re-run with the same id finishes
    a failed run and never adds a job twice); default: a fresh id.
    ``partitions``: repartition the input first (default: as it is; each
    partition is one JDBC connection per node). Jobs keep the DataFrame's
    order (ctime). Returns an :class:`IngestResult`; raises
    :class:`~pgq.errors.IngestError` when a node could not be completed
    (re-run with the same ``ingest_id``).
    """
    _check_body_column(df, body_col)
    check_session(df.sparkSession)
    ingestion = Ingestion(df.sparkSession, df, queue, nodes=nodes, replicate=replicate, delay=delay,
                          retry=retry, ttl=ttl, body_col=body_col, ingest_id=ingest_id,
                          partitions=partitions, progress=progress)
    return ingestion.run()
