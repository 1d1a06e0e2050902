"""OpenTelemetry spans (pgq.tracing), recorded by the SDK's in-memory
exporter: add, get and ack spans with their jobs, and a task's worker span
linked to the span that deferred it."""

from __future__ import annotations

import pytest

import pgq
import pgq.tracing
from pgq.testing import run_jobs

from .conftest import wait_until

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
export = pytest.importorskip("opentelemetry.sdk.trace.export")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")


@pytest.fixture(scope="module")
def spans():
    exporter = in_memory.InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process, as OpenTelemetry allows
    # pgq asks again whether a provider is set at most once a second (pgq.tracing)
    wait_until(pgq.tracing.enabled, 5, every=0.05, message="pgq to see the tracer provider")
    yield exporter
    provider.shutdown()


def test_add_get_and_ack_are_spans_naming_their_jobs(client, spans):
    spans.clear()
    job = client.add_job("traced", b"x", retry=30)
    got = client.get_job("traced")
    client.ack_job(*got)
    by_name = {s.name: s for s in spans.get_finished_spans()}
    add = by_name["pgq add traced"]
    assert add.kind == trace.SpanKind.PRODUCER
    assert add.attributes["messaging.system"] == "pgq"
    assert add.attributes["messaging.destination.name"] == "traced"
    assert add.attributes["messaging.message.id"] == job
    assert by_name["pgq get"].attributes["messaging.message.id"] == job
    assert by_name["pgq ack"].attributes["messaging.message.id"] == job


def test_a_tasks_worker_span_links_to_the_span_that_deferred_it(client, spans):
    spans.clear()
    app = pgq.Tasks(client)

    @app.task(queue="traced-tasks", retry=30)
    def greet(name: str) -> str:
        return f"hello {name}"

    tracer = trace.get_tracer("the-app")
    with tracer.start_as_current_span("signup") as signup:
        greet.defer(name="ada")
    run_jobs(app.worker())
    process = next(s for s in spans.get_finished_spans() if s.name == "pgq process traced-tasks")
    assert process.kind == trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in process.links] == [signup.get_span_context().span_id]
    assert process.status.is_ok


def test_a_failing_handlers_span_records_the_error(client, spans):
    spans.clear()
    client.add_job("traced-fail", b"x", retry=30)

    def handler(job):
        raise ValueError("boom")

    run_jobs(pgq.Worker(client, queues=["traced-fail"], handler=handler, max_deliveries=1))
    process = next(s for s in spans.get_finished_spans() if s.name == "pgq process traced-fail")
    assert not process.status.is_ok
