"""The bench's report: a Markdown table, a JSON file and PNG charts.

Every goal of the benchmark issue is a row with its measured ratio and a
verdict; a goal not met says so ("missed"), it is never left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .runner import REPEATS, RESP_CONNECTIONS, Results, closed_loop_key, http_key, resp_key

PEERS = ("pgqueuer", "procrastinate")
BATCHED = "burn-down batched (COUNT 100)"
PER_JOB = "burn-down per job (COUNT 1)"
BULK = "bulk add"
SPARK = "Spark ingest (W=1)"
WORKER = "burn-down batched, pgq.Worker"
STEADY = "steady state (4 producers, 4 consumers)"
CONTENDERS = ("pgq", "pgqueuer", "procrastinate", "raw SQL floor", "plain COPY", "indexed COPY",
              "Spark JDBC floor")

# Durable Disque (appendfsync always), closed loop, on this machine: the
# external bar of issue "Speed that scales" (medians of 3 rounds of 5 s,
# 2026-11-23; see bench/README.md). Not re-measured by this bench.
DISQUE_DURABLE = {
    ("add", 1): 3_301, ("add", 10): 15_130, ("add", 50): 35_309,
    ("get+ack", 1): 2_774, ("get+ack", 10): 8_992, ("get+ack", 50): 18_684,
}
# The same, replicated: ADDJOB ... REPLICATE 3 on a 3-node Disque cluster,
# and GETJOB + ACKJOB of jobs with 3 copies, by clients (issue "Any
# language" sets the RESP rows' bar at 10 and 50).
REPLICATED = "add, replicate 3"
DISQUE_REPLICATED = {1: 1_779, 10: 6_052, 50: 15_529}
REPLICATED_GET_ACK = "get+ack of 3-copy jobs"
DISQUE_REPLICATED_GET_ACK = {1: 2_129, 10: 5_231, 50: 10_095}
REPEATED = f"burn-down x{REPEATS} on one database"
HELD = REPEATED + ", horizon held"


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goals(results: Results) -> list[dict[str, Any]]:
    m = results.median
    best_batched = max((m(BATCHED, p) or 0 for p in PEERS), default=0) or None
    best_per_job = max((m(PER_JOB, p) or 0 for p in PEERS), default=0) or None
    rows = [
        ("burn-down batched: pgq ≥ 2× the better peer", _ratio(m(BATCHED, "pgq"), best_batched), 2.0),
        ("burn-down batched: pgq ≥ 0.6× the raw-SQL floor",
         _ratio(m(BATCHED, "pgq"), m(BATCHED, "raw SQL floor")), 0.6),
        ("burn-down per job: pgq ≥ 1.5× the better peer", _ratio(m(PER_JOB, "pgq"), best_per_job), 1.5),
        ("bulk add: pgq ≥ 0.5× plain COPY", _ratio(m(BULK, "pgq"), m(BULK, "plain COPY")), 0.5),
        ("Spark ingest (W=1): pgq ≥ 0.5× plain COPY", _ratio(m(SPARK, "pgq"), m(SPARK, "plain COPY")), 0.5),
        # issue "Speed that scales": beside a COPY into a table with the job table's indexes
        ("bulk add: pgq ≥ 0.7× indexed COPY", _ratio(m(BULK, "pgq"), m(BULK, "indexed COPY")), 0.7),
        ("Spark ingest (W=1): pgq ≥ 0.7× indexed COPY",
         _ratio(m(SPARK, "pgq"), m(SPARK, "indexed COPY")), 0.7),
        # issue "Speed that scales": the worker, and the steady state
        ("pgq.Worker burn-down ≥ 0.8× the bare client's batched burn-down",
         _ratio(m(WORKER, "pgq"), m(BATCHED, "pgq")), 0.8),
        ("steady state: pgq ≥ 2× the better peer",
         _ratio(m(STEADY, "pgq"), max((m(STEADY, p) or 0 for p in PEERS), default=0) or None), 2.0),
        ("steady state: pgq ≥ 0.6× the raw-SQL floor",
         _ratio(m(STEADY, "pgq"), m(STEADY, "raw SQL floor")), 0.6),
    ]
    for (what, clients), disque in DISQUE_DURABLE.items():
        for shared in (True, False):
            key = closed_loop_key(what, clients, shared)
            rows.append((f"{key}: pgq ≥ 0.5× durable Disque ({disque:,}/s)",
                         _ratio(m(key, "pgq"), disque), 0.5))
    rows += resp_goals(results)
    for what in ("add", "get+ack"):
        for shared in (True, False):  # the label says which row: per thread is the slower one
            key = closed_loop_key(what, 50, shared)
            p99 = m(key, "pgq", "p99")
            rows.append((f"{key}: p99 ≤ 10 ms (value in ms)", p99 and p99 * 1000, ("≤", 10.0)))
    for key in (REPEATED, HELD):
        rows.append((f"{key}: the last run ≥ 0.8× the first",
                     _ratio(m(key, "pgq", "last"), m(key, "pgq", "first")), 0.8))
        # The bar is the floor's first run with no horizon held, for both: the
        # held floor's first run has already collapsed (dead rows pile up
        # during it), and against it the held goal read 0.65 met where the
        # unheld bar gives 0.23 (found by a review of the bench).
        rows.append((f"{key}: the last run ≥ 0.6× the raw-SQL floor's first (no horizon held)",
                     _ratio(m(key, "pgq", "last"), m(REPEATED, "raw SQL floor", "first")), 0.6))
    cluster = results.cluster
    if cluster:
        w1, w3 = cluster.get("W=1 sync", {}), cluster.get("W=3 sync", {})
        rows.append(("cluster: W=3 sync throughput ≥ 0.3× W=1", _ratio(w3.get("rate"), w1.get("rate")), 0.3))
        p50 = w3.get("p50_ms")
        rows.append(("cluster: W=3 p50 add latency ≤ 5 ms (value in ms)", p50, ("≤", 5.0)))
        rows += replicated_goals(results)
        p50 = cluster.get(closed_loop_key(REPLICATED, 1, True), {}).get("p50_ms")
        rows.append((f"cluster: {REPLICATED}, 1 client: p50 ≤ 1.5 ms (value in ms)", p50, ("≤", 1.5)))
        rows += resp_cluster_goals(results)
    out = []
    for name, value, target in rows:
        if isinstance(target, tuple):  # a bound on a latency: lower is better
            met = value is not None and value <= target[1]
        else:
            met = value is not None and value >= target
        out.append({"goal": name, "measured": value, "met": met})
    return out


def resp_goals(results: Results) -> list[tuple[str, float | None, float]]:
    """Issue "Any language": through the RESP port, add and get+ack at 10
    and 50 connections at least as fast as durable Disque (ratio ≥ 1)."""
    rows = []
    for (what, clients), disque in DISQUE_DURABLE.items():
        if clients in RESP_CONNECTIONS:
            key = resp_key(what, clients)
            rows.append((f"{key}: pgq ≥ durable Disque ({disque:,}/s)",
                         _ratio(results.median(key, "pgq"), disque), 1.0))
    return rows


def replicated_goals(results: Results) -> list[tuple[str, float | None, float]]:
    """Issue "Speed that scales" on the 3-node cluster: replicated add and
    get+ack of 3-copy jobs through one shared Client at least half as fast
    as durable Disque's 3-node cluster."""
    rows = []
    for what, bar in ((REPLICATED, DISQUE_REPLICATED), (REPLICATED_GET_ACK, DISQUE_REPLICATED_GET_ACK)):
        for clients, disque in bar.items():
            key = closed_loop_key(what, clients, True)
            rows.append((f"cluster: {key}: pgq ≥ 0.5× durable Disque, 3 nodes ({disque:,}/s)",
                         _ratio(results.cluster.get(key, {}).get("rate"), disque), 0.5))
    return rows


def resp_cluster_goals(results: Results) -> list[tuple[str, float | None, float]]:
    """The same for ADDJOB ... REPLICATE 3 on the 3-node cluster."""
    rows = []
    for clients in RESP_CONNECTIONS:
        key, disque = resp_key(REPLICATED, clients), DISQUE_REPLICATED[clients]
        rows.append((f"cluster: {key}: pgq ≥ durable Disque, 3 nodes ({disque:,}/s)",
                     _ratio(results.cluster.get(key, {}).get("rate"), disque), 1.0))
    return rows


def _verdict(goal: dict[str, Any], results: Results) -> str:
    """met, **missed**, or (a partial run's row it did not measure) not run."""
    if goal["met"]:
        return "met"
    if goal["measured"] is None and results.meta.get("only"):
        return "not run (--only)"
    return "**missed**"


def markdown(results: Results) -> str:
    meta = results.meta
    lines = [
        f"# pgq benchmark ({meta.get('mode')} run, {meta.get('date')})",
        "",
        *([f"Only the rows whose name contains one of: {', '.join(repr(o) for o in meta['only'])}.",
           ""] if meta.get("only") else []),
        f"Machine: {meta.get('cpus')} CPUs, {meta.get('memory_gib')} GiB, {meta.get('platform')}; "
        f"Python {meta.get('python')}; PostgreSQL {meta.get('postgresql')} "
        f"({', '.join(f'{k}={v}' for k, v in sorted(meta.get('postgresql_settings', {}).items()))}).",
        f"Versions: {', '.join(f'{k} {v}' for k, v in meta.get('versions', {}).items())}.",
        f"Median of {meta.get('rounds')} interleaved rounds; every run on a fresh database of the "
        "same server; 16-byte bodies.",
        "",
        "| workload | " + " | ".join(CONTENDERS) + " |",
        "|---|" + "---:|" * len(CONTENDERS),
    ]
    for workload, by_contender in results.runs.items():
        cells = []
        for contender in CONTENDERS:
            runs = by_contender.get(contender)
            if not runs:
                cells.append("")
                continue
            errors = [r["error"] for r in runs if "error" in r]
            rate = results.median(workload, contender)
            text = _fmt(rate)
            if workload.startswith(("steady", "add,", "get+ack,")) and rate is not None:
                p50 = results.median(workload, contender, "p50")
                p99 = results.median(workload, contender, "p99")
                text += f" (p50 {_fmt(p50 and p50 * 1000, 1)} / p99 {_fmt(p99 and p99 * 1000, 1)} ms)"
            if workload == "single add" and rate is not None:
                p50 = results.median(workload, contender, "p50")
                p99 = results.median(workload, contender, "p99")
                text = f"p50 {_fmt(p50 and p50 * 1000, 2)} / p99 {_fmt(p99 and p99 * 1000, 2)} ms"
            if workload.startswith("burn-down x") and rate is not None:
                first = results.median(workload, contender, "first")
                text = f"{_fmt(first)} → {_fmt(results.median(workload, contender, 'last'))}"
            if errors and rate is None:
                text = f"failed: {errors[0][:60]}"
            cells.append(text)
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    lines += ["", "Rates are jobs/s (adds/s for adds); latencies from enqueue to dequeue "
              "(steady state) or of one add call (single add).", ""]
    if results.cluster:
        lines += ["## Cluster (3 local nodes, pgq only)", "",
                  "| workload | p50 of one call | p99 of one call | throughput |", "|---|---:|---:|---:|"]
        for name, row in results.cluster.items():
            lines.append(f"| {name} | {_fmt(row.get('p50_ms'), 2)} ms | {_fmt(row.get('p99_ms'), 2)} ms "
                         f"| {_fmt(row.get('rate'))} /s |".replace("- ms", "-"))
        lines.append("")
    lines += closed_loop_table(results) + repeated_table(results)
    lines += ["## Goals", "", "| goal | measured | verdict |", "|---|---:|---|"]
    for goal in goals(results):
        value = goal["measured"]
        lines.append(f"| {goal['goal']} | {_fmt(value, 2)} | {_verdict(goal, results)} |")
    return "\n".join(lines) + "\n"


def closed_loop_table(results: Results) -> list[str]:
    """pgq beside durable Disque and the raw floor, one request in flight per
    client: through the Python client and through the RESP port, on one node
    and (replicated) on the 3-node cluster."""
    if not any(k.startswith(("add,", "get+ack,", REPLICATED_GET_ACK)) for k in (*results.runs, *results.cluster)):
        return []
    lines = ["## Closed loop beside durable Disque", "",
             "One request in flight per client thread (per connection through the RESP port and "
             "the HTTP API); "
             "durable (fsync, synchronous commit; Disque with appendfsync always, measured on this "
             "machine on 2026-11-23). ops/s, and pgq's latency of one call (of GETJOB + ACKJOB "
             "for get+ack over RESP, of lease + ack over HTTP).", "",
             "| workload | clients | durable Disque | pgq, one shared Client | pgq, a Client per thread "
             "| raw psycopg floor | pgq, RESP port | pgq, HTTP API | shared / Disque | RESP / Disque |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    m = results.median
    for (what, clients), disque in DISQUE_DURABLE.items():
        shared, own = closed_loop_key(what, clients, True), closed_loop_key(what, clients, False)
        resp = resp_key(what, clients)
        lines.append(f"| {what} | {clients} | {disque:,} | {_cell(results, shared, 'pgq')} "
                     f"| {_cell(results, own, 'pgq')} | {_cell(results, shared, 'raw SQL floor')} "
                     f"| {_cell(results, resp, 'pgq')} | {_cell(results, http_key(what, clients), 'pgq')} "
                     f"| {_fmt(_ratio(m(shared, 'pgq'), disque), 2)} "
                     f"| {_fmt(_ratio(m(resp, 'pgq'), disque), 2)} |")
    for what, bar in ((REPLICATED, DISQUE_REPLICATED), (REPLICATED_GET_ACK, DISQUE_REPLICATED_GET_ACK)):
        for clients, disque in bar.items():
            shared = results.cluster.get(closed_loop_key(what, clients, True), {})
            resp = results.cluster.get(resp_key(what, clients), {})
            lines.append(f"| {what} (3 nodes) | {clients} | {disque:,} | {_cluster_cell(shared)} | - | - "
                         f"| {_cluster_cell(resp)} | - | {_fmt(_ratio(shared.get('rate'), disque), 2)} "
                         f"| {_fmt(_ratio(resp.get('rate'), disque), 2)} |")
    return lines + [""] + _resp_cpu(results)


def _resp_cpu(results: Results) -> list[str]:
    """How busy the RESP rows' client (one process) and server were: a
    client near one core would be measuring itself."""
    lines = []
    for key in results.runs:
        if key.endswith(("(RESP)", "(HTTP)")) and results.median(key, "pgq", "client_cpu") is not None:
            lines.append(f"* {key}: the client used {_fmt(results.median(key, 'pgq', 'client_cpu'), 2)} "
                         f"of a core, `pgq serve` {_fmt(results.median(key, 'pgq', 'server_cpu'), 2)}")
    for key, row in results.cluster.items():
        if key.endswith("(RESP)") and row.get("client_cpu") is not None:
            lines.append(f"* {key}: the client used {_fmt(row['client_cpu'], 2)} of a core, "
                         f"node 1's process {_fmt(row.get('server_cpu'), 2)}")
    return lines + [""] if lines else []


def _cell(results: Results, key: str, contender: str) -> str:
    """A closed-loop row's rate and latency, for one contender."""
    rate = results.median(key, contender)
    if rate is None:
        return "-"
    p50, p99 = results.median(key, contender, "p50"), results.median(key, contender, "p99")
    return f"{_fmt(rate)} (p50 {_fmt(p50 and p50 * 1000, 2)} / p99 {_fmt(p99 and p99 * 1000, 2)} ms)"


def _cluster_cell(row: dict[str, Any]) -> str:
    if row.get("rate") is None:
        return "-"
    return (f"{_fmt(row['rate'])} (p50 {_fmt(row.get('p50_ms'), 2)} / p99 "
            f"{_fmt(row.get('p99_ms'), 2)} ms)")


def repeated_table(results: Results) -> list[str]:
    """Each round of the repeated burn-downs (median over the bench's rounds)."""
    lines = []
    for key in results.runs:
        if not key.startswith("burn-down x"):
            continue
        if not lines:
            lines = ["## Repeated burn-downs (jobs/s, round by round)", ""]
        for contender, runs in results.runs[key].items():
            series = [r["rates"] for r in runs if "rates" in r]
            if not series:
                continue
            medians = [sorted(col)[len(col) // 2] for col in zip(*series, strict=False)]
            lines.append(f"* {key}, {contender}: " + " → ".join(_fmt(r) for r in medians))
    return lines + [""] if lines else []


def charts(results: Results, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    bars = [w for w in results.runs if w.startswith("burn-down") or w in ("bulk add", "single add", SPARK)
            or w.startswith("steady")]
    if bars:  # none with --only on other rows
        made.append(_throughput_chart(results, bars, out, plt))
    if results.cluster:
        made.append(_cluster_chart(results, out, plt))
    return made


def _throughput_chart(results: Results, bars: list[str], out: Path, plt: Any) -> Path:
    fig, axes = plt.subplots(1, len(bars), figsize=(4 * len(bars), 4), squeeze=False)
    for ax, workload in zip(axes[0], bars, strict=True):
        names = [c for c in results.runs[workload] if results.median(workload, c) is not None]
        values = [results.median(workload, c) for c in names]
        colors = ["#1f77b4" if n == "pgq" else "#999999" for n in names]
        ax.bar(names, values, color=colors)
        ax.set_title(workload, fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.set_ylabel("adds/s" if "add" in workload else "jobs/s")
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cluster_chart(results: Results, out: Path, plt: Any) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    # one synchronous add at a time: the closed-loop rows (RESP, one shared Client) are not
    names = [n for n in results.cluster if "p50_ms" in results.cluster[n]
             and not n.endswith(("(RESP)", "(one shared Client)"))]
    ax.bar([f"{n}\np50" for n in names], [results.cluster[n]["p50_ms"] for n in names], color="#1f77b4")
    ax.bar([f"{n}\np99" for n in names], [results.cluster[n]["p99_ms"] for n in names], color="#aec7e8")
    ax.set_ylabel("ms per synchronous add")
    ax.set_title("cluster: add latency by replication level")
    fig.tight_layout()
    path = out / "cluster_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: Results, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": results.meta, "runs": results.runs, "cluster": results.cluster,
            "goals": goals(results)}
    (out / "results.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md", *charts(results, out)]
