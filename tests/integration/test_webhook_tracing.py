"""A webhook POST is an OpenTelemetry HTTP client span, a child of its job's process span,
recorded by the SDK's in-memory exporter (the runtime code uses the API only)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from actors import settings as app_settings
from actors import webhooks
from broker.settings import replace
from tests.support.db import wait_for
from tests.support.http import http_server
from tests.support.rawhttp import raw_server

pytest.importorskip("opentelemetry.sdk", reason="the [otel] extra is not installed")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from broker.observability import tracing  # noqa: E402
from middleware.retries import Retries  # noqa: E402
from middleware.tracing import Tracing  # noqa: E402


@pytest.fixture
def spans(broker) -> Iterator[InMemorySpanExporter]:
    """Spans recorded in memory, the broker tracing as ``default_middleware`` makes it;
    loopback endpoints allowed."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    middleware = Tracing()
    broker.add_middleware(middleware, before=Retries)
    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",)))
    try:
        yield exporter
    finally:
        app_settings.use(original)
        broker.middleware.remove(middleware)
        tracing.set_tracer_provider(None)
        provider.shutdown()


def _is_delivery_run(span) -> bool:
    """The consumer span of a ``webhook.deliver`` run (named as the messaging conventions
    say, ``process webhook``, or as before, ``webhook.deliver process``)."""
    return span.kind == SpanKind.CONSUMER and (
        span.name == "webhook.deliver process" or span.attributes.get("messaging.dramatiq.actor") == "webhook.deliver")


def _deliver_once(database_url: str, url: str, start_worker, spans: InMemorySpanExporter) -> tuple:
    """Deliver one event to ``url`` (an endpoint of its own event type); the POST's client
    span and its job's process span."""
    event_type = f"traced.{url}"
    webhooks.add_endpoint(url, [event_type])
    with psycopg.connect(database_url) as conn, conn.transaction():
        webhooks.emit_event(conn, event_type, {"order": 42})
    start_worker(queues=["webhook"], threads=2)
    wait_for(lambda: any(_is_delivery_run(s) for s in spans.get_finished_spans()),
             timeout_s=15, what="the delivery's process span to end")
    finished = spans.get_finished_spans()
    clients = [s for s in finished if s.kind == SpanKind.CLIENT]
    [process] = [s for s in finished if _is_delivery_run(s)]
    assert len(clients) == 1, [(s.name, s.kind) for s in finished]
    return clients[0], process


def test_a_webhook_post_is_a_client_span_child_of_its_process_span_with_the_http_attributes(
        broker, database_url, start_worker, spans):
    with http_server() as (url, server):
        post, process = _deliver_once(database_url, url + "?token=s3cret&x=1", start_worker, spans)
        port = int(url.split(":")[2].split("/")[0])
    assert post.name == "POST"
    assert post.parent is not None and post.parent.span_id == process.context.span_id
    assert post.context.trace_id == process.context.trace_id
    assert dict(post.attributes) == {
        "http.request.method": "POST", "url.full": f"http://127.0.0.1:{port}/hook", "server.address": "127.0.0.1",
        "server.port": port, "network.peer.address": "127.0.0.1", "network.protocol.name": "http",
        "network.protocol.version": "1.0", "http.response.status_code": 200}  # http.server answers in 1.0
    assert post.status.status_code == StatusCode.UNSET
    # the endpoint sees the client span's context: its server span would be the POST's child
    traceparent = server.headers[0]["traceparent"]
    assert traceparent.split("-")[1:3] == [f"{post.context.trace_id:032x}", f"{post.context.span_id:016x}"]


def test_a_post_that_fails_is_a_client_span_in_error_with_its_error_type(
        broker, database_url, start_worker, spans):
    answer = b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n"
    with raw_server(lambda n: (answer, True)) as (port, _):
        post, process = _deliver_once(database_url, f"http://127.0.0.1:{port}/hook", start_worker, spans)
    assert post.parent is not None and post.parent.span_id == process.context.span_id
    assert post.attributes["error.type"] == "httpx.RemoteProtocolError"
    assert "http.response.status_code" not in post.attributes
    assert post.status.status_code == StatusCode.ERROR


def test_an_error_status_is_a_client_span_in_error_typed_by_its_code(broker, database_url, start_worker, spans):
    with http_server(status=503) as (url, _):
        post, _ = _deliver_once(database_url, url, start_worker, spans)
    assert post.attributes["http.response.status_code"] == 503
    assert post.attributes["error.type"] == "503"
    assert post.status.status_code == StatusCode.ERROR
