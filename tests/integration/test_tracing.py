"""Traces (the [otel] extra): one trace from emit to the webhook delivery, the W3C
context carried in message options through outbox → relay → fan-out → delivery and
sent on the POST, recorded by the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from actors import settings as app_settings
from broker.settings import replace

pytest.importorskip("opentelemetry.sdk", reason="the [otel] extra is not installed")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from broker import tracing  # noqa: E402
from middleware.retries import Retries  # noqa: E402
from middleware.tracing import Tracing  # noqa: E402
from tests.support.db import scalar, wait_for  # noqa: E402
from tests.support.http import http_server  # noqa: E402
from tests.support.jobs import raise_once  # noqa: E402


@contextmanager
def traced(broker) -> Iterator[InMemorySpanExporter]:
    """Spans recorded in memory while inside; the broker traces as default_middleware is to make it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    middleware = Tracing()
    broker.add_middleware(middleware, before=Retries)
    try:
        yield exporter
    finally:
        broker.middleware.remove(middleware)
        tracing.set_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
def spans(broker) -> Iterator[InMemorySpanExporter]:
    """Spans of this test, recorded in memory."""
    with traced(broker) as exporter:
        yield exporter


def _one(spans: list, name: str, kind: SpanKind) -> object:
    found = [s for s in spans if s.name == name and s.kind == kind]
    assert len(found) == 1, [(s.name, s.kind) for s in spans]
    return found[0]


def test_one_trace_runs_from_emit_through_the_relay_and_fanout_to_the_webhook_post(
        broker, database_url, start_worker, spans):
    from actors import webhooks

    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",)))
    with http_server() as (url, server):
        webhooks.add_endpoint(url, ["order.paid"])
        start_worker(queues=["webhook"], threads=4)
        tracer = tracing._tracer()
        with tracer.start_as_current_span("checkout request") as request:
            with psycopg.connect(database_url) as conn, conn.transaction():
                webhooks.emit_event(conn, "order.paid", {"order": 42})
        wait_for(lambda: server.received, timeout_s=15, what="the delivery")
        wait_for(lambda: any(s.name == "webhook.deliver process" for s in spans.get_finished_spans()),
                 timeout_s=5, what="the delivery's span to end")

    trace_id = request.get_span_context().trace_id
    finished = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    emitted = _one(finished, "webhook.event emit", SpanKind.PRODUCER)
    fanout = _one(finished, "webhook.fanout process", SpanKind.CONSUMER)
    sent = _one(finished, "webhook.deliver send", SpanKind.PRODUCER)
    delivered = _one(finished, "webhook.deliver process", SpanKind.CONSUMER)
    # each step is the child of the one before
    assert emitted.parent.span_id == request.get_span_context().span_id
    assert fanout.parent.span_id == emitted.context.span_id
    assert sent.parent.span_id == fanout.context.span_id
    assert delivered.parent.span_id == sent.context.span_id
    # and the endpoint was told, so it can join the trace
    traceparent = server.headers[0]["traceparent"]
    assert traceparent.split("-")[1] == f"{trace_id:032x}"
    assert traceparent.split("-")[2] == f"{delivered.context.span_id:016x}"


def test_a_retried_job_keeps_its_trace_and_its_failed_run_is_an_error(broker, database_url, start_worker, spans):
    start_worker(queues=["index"], threads=2)
    message = raise_once.send("traced-retry")
    wait_for(lambda: scalar(database_url, "SELECT state FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=15, what="the retried job")
    wait_for(lambda: len([s for s in spans.get_finished_spans() if s.name == "test.raise_once process"]) == 2,
             timeout_s=5, what="both runs' spans")
    sent = _one(spans.get_finished_spans(), "test.raise_once send", SpanKind.PRODUCER)
    runs = [s for s in spans.get_finished_spans() if s.name == "test.raise_once process"]
    assert {r.parent.span_id for r in runs} == {sent.context.span_id}
    assert sorted(r.status.status_code.name for r in runs) == ["ERROR", "UNSET"]


def test_without_a_tracer_provider_nothing_is_carried_but_a_current_remote_context_is():
    """The cheap path taken when no tracer is configured changes nothing: no carrier
    without a trace, and a trace context made current by the application (extracted
    from a request, say) still travels on, as the API's no-op tracer passes it."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    assert tracing.produced("x send", {}) is None
    remote = SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=True, trace_flags=TraceFlags(1))
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(remote)))
    try:
        carrier = tracing.produced("x send", {})
    finally:
        otel_context.detach(token)
    assert carrier is not None
    assert carrier["traceparent"] == f"00-{0x1234:032x}-{0x5678:016x}-01"
    assert tracing.produced("x send", {}) is None


def test_the_tracing_enqueue_hook_is_declared_carrier_only_and_an_override_is_not():
    """The relay writes a message without the broker's enqueue hooks only when every hook
    there is declared to add a trace carrier and nothing else."""
    assert tracing.is_carrier_only(Tracing().before_enqueue)
    assert not tracing.is_carrier_only(Tracing().before_process_message)

    class Own(Tracing):
        def before_enqueue(self, broker, message, delay):
            message.options["own"] = True

    assert not tracing.is_carrier_only(Own().before_enqueue)


def test_a_relayed_event_that_brought_no_trace_gets_one_when_tracing_is_on(broker, database_url):
    import json
    import uuid

    from broker import emit
    from broker.outbox import MESSAGE_NAMESPACE, relay_once

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM standmeet.outbox")
        with conn.transaction():  # written while no tracer is configured: no carrier
            untraced = emit(conn, "test.ping", {"label": "untraced"})
        with traced(broker) as exporter:
            with conn.transaction():
                traced_event = emit(conn, "test.ping", {"label": "traced"})
            relay_once(conn, limit=200)
    options = {event_id: json.loads(scalar(database_url, "SELECT message::text FROM dramatiq.queue WHERE message_id = %s",
                                           (str(uuid.uuid5(MESSAGE_NAMESPACE, f"{event_id}/0")),)))["options"]
               for event_id in (untraced, traced_event)}
    sent = _one(exporter.get_finished_spans(), "test.noop send", SpanKind.PRODUCER)
    emitted = _one(exporter.get_finished_spans(), "test.ping emit", SpanKind.PRODUCER)
    # the untraced event's message got the relay's producer span; the traced one kept its emit's
    assert options[untraced][tracing.OPTION]["traceparent"].split("-")[2] == f"{sent.context.span_id:016x}"
    assert options[traced_event][tracing.OPTION]["traceparent"].split("-")[2] == f"{emitted.context.span_id:016x}"


def test_a_batch_enqueued_under_a_span_carries_its_trace_on_every_message(broker, database_url, spans):
    from broker import enqueue_many
    from tests.support.jobs import mark

    # Given a current span (a request being served)
    with tracing._tracer().start_as_current_span("batch request") as request:
        trace_id = format(request.get_span_context().trace_id, "032x")
        # When a batch is enqueued
        messages = enqueue_many([mark.message(f"traced-{i}") for i in range(3)])
    # Then every stored message carries that trace
    carried = [scalar(database_url, "SELECT message->'options'->'trace_context'->>'traceparent'"
                                    " FROM dramatiq.queue WHERE message_id = %s", (m.message_id,)) for m in messages]
    assert [c.split("-")[1] for c in carried] == [trace_id] * 3
    for m in messages:
        scalar(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s RETURNING 1", (m.message_id,))
