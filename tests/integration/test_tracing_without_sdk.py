"""Without an OpenTelemetry SDK, a run records nothing, yet the trace context a message
carries still reaches what the run sends (its caller's SDK may record it)."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry", reason="the [otel] extra is not installed")

from opentelemetry import trace  # noqa: E402

from broker.observability import tracing  # noqa: E402
from middleware.retries import Retries  # noqa: E402
from middleware.tracing import Tracing  # noqa: E402
from tests.support.db import scalar  # noqa: E402
from tests.support.jobs import mark  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CARRIER = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}


@pytest.fixture
def untraced(broker):
    """The API without an SDK: OpenTelemetry's global provider hands out non-recording spans."""
    assert isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
    tracing.set_tracer_provider(None)
    middleware = Tracing()
    broker.add_middleware(middleware, before=Retries)
    yield middleware
    broker.middleware.remove(middleware)


def test_without_an_sdk_a_run_with_no_incoming_context_starts_no_span(broker, untraced):
    # Given a message that carries no trace context, and no SDK
    message = mark.message("untraced")
    proxy = type("Proxy", (), {"options": message.options, "queue_name": message.queue_name,
                               "message_id": message.message_id, "actor_name": message.actor_name})()
    # When its run starts
    untraced.before_process_message(broker, proxy)
    # Then nothing is recorded and nothing is made current
    assert proxy.standmeet_span is None
    assert not trace.get_current_span().get_span_context().is_valid
    assert not tracing.recording()


def test_without_an_sdk_the_context_a_message_carries_reaches_the_messages_its_run_sends(
        broker, database_url, untraced):
    # Given a message carrying a caller's trace context, and no SDK in this process
    message = mark.message("traced-upstream")
    message.options[tracing.OPTION] = dict(CARRIER)
    proxy = type("Proxy", (), {"options": message.options, "queue_name": message.queue_name,
                               "message_id": message.message_id, "actor_name": message.actor_name})()
    untraced.before_process_message(broker, proxy)
    try:
        # When the run sends a message
        sent = mark.send("downstream")
    finally:
        untraced.after_process_message(broker, proxy)
    # Then the sent message carries the same trace
    carried = scalar(database_url, "SELECT message->'options'->'trace_context'->>'traceparent' FROM dramatiq.queue"
                                   " WHERE message_id = %s", (sent.message_id,))
    assert carried is not None and carried.split("-")[1] == TRACE_ID
    # And once the run has ended, nothing of it stays current
    assert not trace.get_current_span().get_span_context().is_valid


def test_the_runtime_imports_no_opentelemetry_sdk():
    """[otel] is the API only: loading the runtime and the application, middleware
    included, imports nothing of the SDK (the application brings its own)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    probe = ("import sys, broker, broker.observability.tracing, middleware, middleware.tracing, periodic, actors; "
             "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=root,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root),
                                 "DATABASE_URL": "postgresql://no-sdk.invalid/none"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
