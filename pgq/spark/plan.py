"""Where each row of a bulk ingestion goes, and what it becomes: no I/O.

An ingestion numbers its rows ``seq = 0 .. total-1`` (in the DataFrame's
order). Row ``seq`` belongs to group ``g = seq mod n`` for ``n`` target
nodes, and group ``g`` is held by the ``W`` nodes ``g, g+1, ... (mod n)``;
the first of them is the job's *origin*: its ID carries that node's prefix,
the job is queued there, and the other holders keep a copy that their
re-queue timer (``retry``) brings back if the origin fails - exactly what
the cluster layer does with a job added with ``replicate=W``.

Invariants:

* Everything here is a function of the ingestion's parameters (ingest id,
  target node list, W, job options) and of ``started_ms`` fixed by the first
  attempt, so any attempt, on any machine, computes the same groups, IDs and
  ``ctime`` values: a re-run recreates nothing that exists.
* Groups spread rows round-robin, so every node gets ``total/n`` rows
  (``W*total/n`` with copies) whatever the DataFrame's partitioning.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..arguments import JobParams
from ..ids import ttl_minutes_field

__all__ = ["IngestPlan"]

# ctime of row seq: the start time in Disque's unit (ms * 10^6) plus seq, so
# rows keep their order and every holder stores the same ctime.
CTIME_PER_MS = 1_000_000


@dataclass(frozen=True)
class IngestPlan:
    ingest_id: str
    queue: str
    node_ids: tuple[str, ...]  # target nodes, in the order the caller gave them
    replicate: int
    params: JobParams

    @property
    def key(self) -> int:
        """32 bits naming this ingestion inside its job IDs."""
        return int.from_bytes(hashlib.sha256(self.ingest_id.encode()).digest()[:4], "big")

    @property
    def staging_table(self) -> str:
        """The staging table's name in schema ``pgq_staging``."""
        return "ingest_" + hashlib.sha256(self.ingest_id.encode()).hexdigest()[:24]

    @property
    def ttl_field(self) -> str:
        return ttl_minutes_field(self.params.ttl, self.params.retry)

    @property
    def groups(self) -> int:
        return len(self.node_ids)

    def holders(self, group: int) -> list[int]:
        """Node indexes holding group ``group``; the first is the origin."""
        return [(group + k) % self.groups for k in range(self.replicate)]

    def groups_of(self, node: int) -> list[int]:
        """Groups node ``node`` holds a copy of."""
        return [g for g in range(self.groups) if node in self.holders(g)]

    def rows_of_group(self, group: int, total: int) -> int:
        """How many of ``total`` rows fall in ``group`` (seq mod groups)."""
        return max(0, (total - group + self.groups - 1) // self.groups)

    def expected_rows(self, node: int, total: int) -> int:
        """Rows node ``node`` must hold once merged."""
        return sum(self.rows_of_group(g, total) for g in self.groups_of(node))

    def base_ctime(self, started_ms: int) -> int:
        return started_ms * CTIME_PER_MS

    def merge_params(self, node: int, started_ms: int) -> dict[str, object]:
        """Parameters of the merge statement on node ``node``."""
        groups = self.groups_of(node)
        return {
            "groups": groups,
            "holders": [",".join(self.node_ids[h] for h in self.holders(g)) for g in groups],
            "origin": [self.holders(g)[0] == node for g in groups],
            "queue": self.queue,
            "base_ctime": self.base_ctime(started_ms),
            "repl": self.replicate,
            "retry": self.params.retry,
            "delay": self.params.delay,
            "ttl": self.params.ttl,
        }

    def fingerprint(self) -> str:
        """What a re-run must repeat exactly (stored in ``pgq.ingests.params``)."""
        return json.dumps({
            "nodes": list(self.node_ids), "replicate": self.replicate,
            "retry": self.params.retry, "ttl": self.params.ttl, "delay": self.params.delay,
        }, sort_keys=True)
