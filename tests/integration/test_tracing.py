"""Traces (the [otel] extra): spans named and attributed as the OpenTelemetry messaging
conventions say, one trace from emit to the webhook delivery, the W3C context carried in
message options through outbox → relay → fan-out → delivery and sent on the POST, a run
linked to the send of its message; recorded by the SDK's in-memory exporter."""

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

from broker.observability import tracing  # noqa: E402
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
    # the broker's own Tracing when it has one (a second would take over the first's spans)
    middleware = None if any(isinstance(m, Tracing) for m in broker.middleware) else Tracing()
    if middleware is not None:
        broker.add_middleware(middleware, before=Retries)
    try:
        yield exporter
    finally:
        if middleware is not None:
            broker.middleware.remove(middleware)
        tracing.set_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
def spans(broker) -> Iterator[InMemorySpanExporter]:
    """Spans of this test, recorded in memory."""
    with traced(broker) as exporter:
        yield exporter


def _one(spans: list, name: str, kind: SpanKind, actor: str | None = None) -> object:
    found = [s for s in spans if s.name == name and s.kind == kind
             and (actor is None or s.attributes.get("messaging.dramatiq.actor") == actor)]
    assert len(found) == 1, [(s.name, s.kind, dict(s.attributes)) for s in spans]
    return found[0]


def _emitted(spans: list, topic: str) -> object:
    """The producer span of an emit to ``topic`` (found by its destination)."""
    found = [s for s in spans if s.kind == SpanKind.PRODUCER and s.attributes.get("messaging.system") == "standmeet.outbox"
             and s.attributes.get("messaging.destination.name") == topic]
    assert len(found) == 1, [(s.name, dict(s.attributes)) for s in spans]
    assert found[0].name == f"send {topic}"
    assert found[0].attributes["messaging.operation.name"] == found[0].attributes["messaging.operation.type"] == "send"
    return found[0]


def _processed(spans: list, actor: str) -> list:
    return [s for s in spans if s.kind == SpanKind.CONSUMER and s.attributes.get("messaging.dramatiq.actor") == actor]


def test_one_trace_runs_from_emit_through_the_relay_and_fanout_to_the_webhook_post(
        broker, database_url, start_worker, spans):
    from actors import webhooks

    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",)))
    with http_server() as (url, server):
        webhooks.add_endpoint(url, ["order.paid"])
        start_worker(queues=["webhook"], threads=4)
        tracer = tracing.tracer()
        with tracer.start_as_current_span("checkout request") as request:
            with psycopg.connect(database_url) as conn, conn.transaction():
                webhooks.emit_event(conn, "order.paid", {"order": 42})
        wait_for(lambda: server.received, timeout_s=15, what="the delivery")
        wait_for(lambda: _processed(spans.get_finished_spans(), "webhook.deliver"),
                 timeout_s=5, what="the delivery's span to end")

    trace_id = request.get_span_context().trace_id
    finished = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    emitted = _emitted(finished, "webhook.event")
    fanout = _one(finished, "process webhook", SpanKind.CONSUMER, "webhook.fanout")
    sent = _one(finished, "send webhook", SpanKind.PRODUCER, "webhook.deliver")
    delivered = _one(finished, "process webhook", SpanKind.CONSUMER, "webhook.deliver")
    # each step is the child of the one before
    assert emitted.parent.span_id == request.get_span_context().span_id
    assert fanout.parent.span_id == emitted.context.span_id
    assert sent.parent.span_id == fanout.context.span_id
    assert delivered.parent.span_id == sent.context.span_id
    # and each run links to the send of its message
    assert [link.context.span_id for link in fanout.links] == [emitted.context.span_id]
    assert [link.context.span_id for link in delivered.links] == [sent.context.span_id]
    # and the endpoint was told, so it can join the trace
    traceparent = server.headers[0]["traceparent"]
    assert traceparent.split("-")[1] == f"{trace_id:032x}"
    told = int(traceparent.split("-")[2], 16)  # the delivery's span, or its HTTP client span
    assert told == delivered.context.span_id or any(
        s.context.span_id == told and s.parent.span_id == delivered.context.span_id for s in finished)


def test_a_retried_job_keeps_its_trace_and_its_failed_run_is_an_error(broker, database_url, start_worker, spans):
    start_worker(queues=["index"], threads=2)
    message = raise_once.send("traced-retry")
    wait_for(lambda: scalar(database_url, "SELECT state FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=15, what="the retried job")
    wait_for(lambda: len(_processed(spans.get_finished_spans(), "test.raise_once")) == 2,
             timeout_s=5, what="both runs' spans")
    sent = _one(spans.get_finished_spans(), "send index", SpanKind.PRODUCER, "test.raise_once")
    runs = sorted(_processed(spans.get_finished_spans(), "test.raise_once"), key=lambda s: s.start_time)
    assert {r.parent.span_id for r in runs} == {sent.context.span_id}
    assert [[link.context.span_id for link in r.links] for r in runs] == [[sent.context.span_id]] * 2
    # the failed run is an error naming the exception's type; the retry is not
    assert [r.status.status_code.name for r in runs] == ["ERROR", "UNSET"]
    assert runs[0].attributes["error.type"] == "RuntimeError" and "error.type" not in runs[1].attributes


def test_send_and_process_spans_follow_the_messaging_conventions(broker, database_url, start_worker, spans):
    from tests.support.jobs import mark

    # Given a worker on the index queue
    start_worker(queues=["index"], threads=2)
    # When a message is sent and processed
    message = mark.send("conventions")
    wait_for(lambda: _processed(spans.get_finished_spans(), "test.mark"), timeout_s=15, what="the run's span")
    sent = _one(spans.get_finished_spans(), "send index", SpanKind.PRODUCER, "test.mark")
    run = _one(spans.get_finished_spans(), "process index", SpanKind.CONSUMER, "test.mark")
    # Then both are named "<operation> <queue>" and carry the conventions' attributes
    common = {"messaging.system": "dramatiq", "messaging.destination.name": "index",
              "messaging.message.id": message.message_id}
    assert dict(sent.attributes) == {**common, "messaging.operation.name": "send", "messaging.operation.type": "send",
                                     "messaging.dramatiq.actor": "test.mark"}
    assert dict(run.attributes) == {**common, "messaging.operation.name": "process",
                                    "messaging.operation.type": "process", "messaging.dramatiq.actor": "test.mark"}
    # And the run links to the send's span context (and is its child: one message, one run)
    assert [(link.context.trace_id, link.context.span_id) for link in run.links] == [
        (sent.context.trace_id, sent.context.span_id)]
    assert run.parent.span_id == sent.context.span_id and run.status.status_code.name == "UNSET"


def test_a_failed_run_has_the_qualified_error_type_and_an_error_status():
    class Refused(Exception):
        pass

    # Given a run's span whose message carries a producer's context
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    try:
        carrier = tracing.produced("send index", tracing.messaging_attributes("send", "index"))
        run = tracing.Consumed("process index", carrier, tracing.messaging_attributes("process", "index"))
        # When it ends with an exception
        run.end(Refused("no"))
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()
    (ended,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CONSUMER]
    # Then error.type is the exception's qualified type, the status an error, the exception recorded
    assert ended.attributes["error.type"] == f"{__name__}.test_a_failed_run_has_the_qualified_error_type_and_an_error_status.<locals>.Refused"
    assert ended.status.status_code.name == "ERROR" and "Refused: no" in ended.status.description
    assert [event.name for event in ended.events] == ["exception"]


@pytest.mark.parametrize("garbage", ["garbage", 5, ["x"], {"traceparent": 123}, {"traceparent": {"a": 1}}, {}],
                         ids=["text", "a number", "a list", "a number inside", "a mapping inside", "empty"])
def test_a_trace_context_that_is_no_mapping_of_text_is_taken_for_none(garbage):
    # Given a message whose trace_context option was written around the runtime
    # When its run's span is made and ended
    run = tracing.Consumed("process index", garbage, tracing.messaging_attributes("process", "index"))
    run.end()
    # Then nothing raised, and the carrier was read as none
    assert tracing.carried(garbage) is None


def test_a_run_whose_exception_cannot_be_turned_into_text_still_ends_its_span_and_its_context():
    from opentelemetry import context as otel_context

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    before = otel_context.get_current()
    try:
        carrier = tracing.produced("send index", tracing.messaging_attributes("send", "index"))
        run = tracing.Consumed("process index", carrier, tracing.messaging_attributes("process", "index"))
        # When it ends with an exception whose text raises
        run.end(Unprintable())
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()
    # Then its span ended, as an error, and the thread's context is what it was before the run
    (ended,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CONSUMER]
    assert ended.status.status_code.name == "ERROR" and "Unprintable" in ended.status.description
    assert otel_context.get_current() == before


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
    sent = _one(exporter.get_finished_spans(), "send index", SpanKind.PRODUCER, "test.noop")
    emitted = _emitted(exporter.get_finished_spans(), "test.ping")
    # the untraced event's message got the relay's producer span; the traced one kept its emit's
    assert options[untraced][tracing.OPTION]["traceparent"].split("-")[2] == f"{sent.context.span_id:016x}"
    assert options[traced_event][tracing.OPTION]["traceparent"].split("-")[2] == f"{emitted.context.span_id:016x}"


def test_a_batch_enqueued_under_a_span_carries_its_trace_on_every_message(broker, database_url, spans):
    from broker import enqueue_many
    from tests.support.jobs import mark

    # Given a current span (a request being served)
    with tracing.tracer().start_as_current_span("batch request") as request:
        trace_id = format(request.get_span_context().trace_id, "032x")
        # When a batch is enqueued
        messages = enqueue_many([mark.message(f"traced-{i}") for i in range(3)])
    # Then every stored message carries that trace
    carried = [scalar(database_url, "SELECT message->'options'->'trace_context'->>'traceparent'"
                                    " FROM dramatiq.queue WHERE message_id = %s", (m.message_id,)) for m in messages]
    assert [c.split("-")[1] for c in carried] == [trace_id] * 3
    for m in messages:
        scalar(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s RETURNING 1", (m.message_id,))
