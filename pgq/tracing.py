"""OpenTelemetry spans for pgq (optional: ``pip install 'pgq-disque[otel]'``).

When ``opentelemetry-api`` is installed, pgq emits spans through the global
tracer provider (configured by the application, as OpenTelemetry wants):

* ``pgq add <queue>`` (PRODUCER) around ``add_job`` / ``add_jobs``, with
  the job IDs;
* ``pgq get`` (CONSUMER) around ``get_job``, and ``pgq ack`` around
  ``ack_job``;
* ``pgq process <queue>`` (CONSUMER) around a worker's handler, **linked**
  to the span that deferred the job when the job carries its trace
  context. A job body is the user's bytes, so pgq cannot add a header to
  every job: a :class:`pgq.Tasks` call carries it in its JSON (``"trace"``),
  and any producer may pass it to a worker through ``trace_context``.

Attributes follow OpenTelemetry's messaging conventions
(``messaging.system = "pgq"``, ``messaging.destination.name``,
``messaging.message.id``). Without the package every function here is a
no-op costing one attribute lookup.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["span", "inject", "extract_link", "enabled"]

try:  # optional dependency
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - exercised where the extra is absent
    trace = None  # type: ignore[assignment]
    propagate = None  # type: ignore[assignment]


_tracer: Any = None
# Providers that record nothing: the proxy in place until the application
# sets one, and the explicit no-op one.
_NOBODY: tuple[type, ...] = (trace.ProxyTracerProvider, trace.NoOpTracerProvider) if trace else ()


# Asking OpenTelemetry for the provider reads the environment each time
# (about 2.5 µs, twice per job in a worker: a tenth of its thread at 20k
# jobs/s). A provider, once set, stays set (OpenTelemetry refuses a second
# one), so a yes is kept; a no is asked again at most once a second.
_RECHECK = 1.0
_known: list[Any] = [False, -_RECHECK]  # [enabled, when a no was last checked]


def enabled() -> bool:
    """Whether spans are recorded: OpenTelemetry is installed and the
    application set a tracer provider (until then nothing would record; a
    provider set later is seen within a second)."""
    if trace is None:
        return False
    if _known[0]:
        return True
    now = time.monotonic()
    if now - _known[1] < _RECHECK:
        return False
    _known[0] = not isinstance(trace.get_tracer_provider(), _NOBODY)
    _known[1] = now
    return bool(_known[0])


def span(name: str, kind: str = "INTERNAL", queue: str | None = None,
         links: list[Any] | None = None, **attributes: Any) -> AbstractContextManager[Any]:
    """A span (or nothing, without OpenTelemetry); errors are recorded on it.
    Nothing to record: a shared context manager that does nothing (the
    generator-based one cost about 2 us per call, on every add, get and
    ack, which no one traced)."""
    if not enabled():
        return _NO_SPAN
    return _span(name, kind, queue, links, attributes)


_NO_SPAN: AbstractContextManager[Any] = contextlib.nullcontext(None)


@contextlib.contextmanager
def _span(name: str, kind: str, queue: str | None, links: list[Any] | None,
          attributes: dict[str, Any]) -> Iterator[Any]:
    global _tracer
    if _tracer is None:  # a proxy: it follows a provider the application sets later
        _tracer = trace.get_tracer("pgq")
    with _tracer.start_as_current_span(name, kind=getattr(trace.SpanKind, kind),
                                       links=links or ()) as current:
        if current.is_recording():  # attributes only for spans someone records
            current.set_attribute("messaging.system", "pgq")
            if queue is not None:
                current.set_attribute("messaging.destination.name", queue)
            for key, value in attributes.items():
                if value is not None:
                    current.set_attribute(key.replace("__", "."), value)
        yield current


def set_ids(current: Any, ids: list[str]) -> None:
    """Name the jobs a span touched (one ID, or how many)."""
    if current is None or not ids or not current.is_recording():
        return
    if len(ids) == 1:
        current.set_attribute("messaging.message.id", ids[0])
    current.set_attribute("messaging.batch.message_count", len(ids))


def inject() -> dict[str, str]:
    """The current trace context, to carry inside a job (W3C traceparent)."""
    carrier: dict[str, str] = {}
    if propagate is not None:
        propagate.inject(carrier)
    return carrier


def extract_link(carrier: Mapping[str, str] | None) -> list[Any]:
    """A link to the span whose context a job carried (none without one)."""
    if trace is None or not carrier:
        return []
    try:
        context = trace.get_current_span(propagate.extract(dict(carrier))).get_span_context()
    except Exception:  # a carrier a producer got wrong ({"traceparent": 5}): no link
        return []
    return [trace.Link(context)] if context.is_valid else []
