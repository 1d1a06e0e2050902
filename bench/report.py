"""The bench's report: a Markdown table, a JSON file and PNG charts.

Every goal of the benchmark issue is a row with its measured ratio and a
verdict; a goal not met says so ("missed"), it is never left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .runner import Results

PEERS = ("pgqueuer", "procrastinate")
BATCHED = "burn-down batched (COUNT 100)"
PER_JOB = "burn-down per job (COUNT 1)"
BULK = "bulk add"
SPARK = "Spark ingest (W=1)"
CONTENDERS = ("pgq", "pgqueuer", "procrastinate", "raw SQL floor", "plain COPY", "Spark JDBC floor")


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
    ]
    cluster = results.cluster
    if cluster:
        w1, w3 = cluster.get("W=1 sync", {}), cluster.get("W=3 sync", {})
        rows.append(("cluster: W=3 sync throughput ≥ 0.3× W=1", _ratio(w3.get("rate"), w1.get("rate")), 0.3))
        p50 = w3.get("p50_ms")
        rows.append(("cluster: W=3 p50 add latency ≤ 5 ms (value in ms)", p50, None))
    out = []
    for name, value, target in rows:
        if target is None:  # a bound on a latency: lower is better
            met = value is not None and value <= 5.0
        else:
            met = value is not None and value >= target
        out.append({"goal": name, "measured": value, "met": met})
    return out


def markdown(results: Results) -> str:
    meta = results.meta
    lines = [
        f"# pgq benchmark ({meta.get('mode')} run, {meta.get('date')})",
        "",
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
            if workload.startswith("steady") and rate is not None:
                p50 = results.median(workload, contender, "p50")
                p99 = results.median(workload, contender, "p99")
                text += f" (p50 {_fmt(p50 and p50 * 1000, 1)} / p99 {_fmt(p99 and p99 * 1000, 1)} ms)"
            if workload == "single add" and rate is not None:
                p50 = results.median(workload, contender, "p50")
                p99 = results.median(workload, contender, "p99")
                text = f"p50 {_fmt(p50 and p50 * 1000, 2)} / p99 {_fmt(p99 and p99 * 1000, 2)} ms"
            if errors and rate is None:
                text = f"failed: {errors[0][:60]}"
            cells.append(text)
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    lines += ["", "Rates are jobs/s (adds/s for adds); latencies from enqueue to dequeue "
              "(steady state) or of one add call (single add).", ""]
    if results.cluster:
        lines += ["## Cluster (3 local nodes, pgq only)", "",
                  "| workload | p50 add | p99 add | throughput |", "|---|---:|---:|---:|"]
        for name, row in results.cluster.items():
            lines.append(f"| {name} | {_fmt(row.get('p50_ms'), 2)} ms | {_fmt(row.get('p99_ms'), 2)} ms "
                         f"| {_fmt(row.get('rate'))} /s |".replace("- ms", "-"))
        lines.append("")
    lines += ["## Goals", "", "| goal | measured | verdict |", "|---|---:|---|"]
    for goal in goals(results):
        value = goal["measured"]
        lines.append(f"| {goal['goal']} | {_fmt(value, 2)} | {'met' if goal['met'] else '**missed**'} |")
    return "\n".join(lines) + "\n"


def charts(results: Results, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    bars = [w for w in results.runs if w.startswith("burn-down") or w in ("bulk add", "single add", SPARK)
            or w.startswith("steady")]
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
    made.append(path)
    if results.cluster:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = [n for n in results.cluster if "p50_ms" in results.cluster[n]]
        ax.bar([f"{n}\np50" for n in names], [results.cluster[n]["p50_ms"] for n in names], color="#1f77b4")
        ax.bar([f"{n}\np99" for n in names], [results.cluster[n]["p99_ms"] for n in names], color="#aec7e8")
        ax.set_ylabel("ms per synchronous add")
        ax.set_title("cluster: add latency by replication level")
        fig.tight_layout()
        path = out / "cluster_latency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def write(results: Results, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": results.meta, "runs": results.runs, "cluster": results.cluster,
            "goals": goals(results)}
    (out / "results.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md", *charts(results, out)]
