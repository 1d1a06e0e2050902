"""Producers and consumers of a chaos run, as a user's programs would be.

Each producer adds unique values (``p<i>-<n>``) one at a time through a
``pgq.Client`` given every node's DSN (its own node first), with default
options and the default ``replicate``; each consumer takes batches with
GETJOB and acknowledges them. Both record every call in the history: an
add that raised is ``info`` (it may have been stored: a timeout, a NOREPL
whose copies survive, a connection lost after the commit), never ``fail``.

Jobs use ``retry=RETRY`` seconds, so a job whose consumer lost its ack is
queued again quickly during the drain.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pgq
from pgq.dsn import host_and_port

from .history import History

__all__ = ["Workload", "RETRY"]

RETRY = 5  # seconds
QUEUE = "chaos"


class Workload:
    def __init__(self, dsns: Callable[[], list[str]], history: History, producers: int = 3,
                 consumers: int = 3, rate: float = 40.0) -> None:
        self.dsns = dsns
        self.history = history
        self.producers = producers
        self.consumers = consumers
        self.interval = 1.0 / rate  # per producer
        self.adding = threading.Event()
        self.consuming = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Workload:
        self.adding.set()
        self.consuming.set()
        for i in range(self.producers):
            self._spawn(self._produce, f"producer-{i + 1}", i)
        for i in range(self.consumers):
            self._spawn(self._consume, f"consumer-{i + 1}", i)
        return self

    def stop_adding(self) -> None:
        self.adding.clear()

    def stop(self) -> None:
        self.adding.clear()
        self.consuming.clear()
        for thread in self._threads:
            thread.join(120)

    def _spawn(self, target: Callable[[str, int], None], name: str, index: int) -> None:
        thread = threading.Thread(target=target, args=(name, index), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _client(self, index: int) -> pgq.Client | None:
        dsns = self.dsns()
        first = index % len(dsns)
        try:
            return pgq.Client(dsns[first:] + dsns[:first])
        except Exception:  # no node answers right now: try again
            return None

    def _produce(self, name: str, index: int) -> None:
        client: pgq.Client | None = None
        pause = threading.Event()  # never set: paces the loop
        n = 0
        while self.adding.is_set():
            if client is None:
                client = self._client(index)
                if client is None:
                    pause.wait(0.5)
                    continue
            value = f"p{index + 1}-{n}"
            n += 1
            self.history.record(name, "invoke", "add", value)
            try:
                client.add_job(QUEUE, value.encode(), retry=RETRY)
            except Exception as exc:
                self.history.record(name, "info", "add", value, error=_describe(exc))
                client = _drop(client, exc)
            else:
                self.history.record(name, "ok", "add", value, node=_node(client))
            pause.wait(self.interval)
        _close(client)

    def _consume(self, name: str, index: int) -> None:
        client: pgq.Client | None = None
        pause = threading.Event()
        while self.consuming.is_set():
            if client is None:
                client = self._client(index)
                if client is None:
                    pause.wait(0.5)
                    continue
            try:
                jobs = client.get_job(QUEUE, count=20, timeout=1)
            except Exception as exc:
                self.history.record(name, "info", "dequeue", error=_describe(exc))
                client = _drop(client, exc)
                continue
            if not jobs:
                continue
            self.history.record(name, "ok", "dequeue", [bytes(j.body).decode() for j in jobs],
                                node=_node(client))
            try:
                client.ack_job(*(j.id for j in jobs))
            except Exception as exc:
                self.history.record(name, "info", "ack", [j.id for j in jobs], error=_describe(exc))
                client = _drop(client, exc)
        _close(client)


def _node(client: pgq.Client) -> str:
    host, port = host_and_port(client.dsn)
    return f"{host}:{port}"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _drop(client: pgq.Client, exc: BaseException) -> pgq.Client | None:
    """Keep the client after a pgq error it reported cleanly; after anything
    else (a node unreachable for long), start again from fresh DSNs."""
    if isinstance(exc, pgq.errors.PgqError) and not isinstance(
            exc, pgq.errors.DatabaseUnavailableError):
        return client
    _close(client)
    return None


def _close(client: pgq.Client | None) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:
            pass
