"""Without the OpenTelemetry API installed, tracing costs a run nothing: the policy has
no run hooks, so the broker calls none of it; a trace context a message carries is still
kept on it (a later process with the API continues the trace)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.procs import ROOT

#: Run in a fresh interpreter in which ``opentelemetry`` cannot be imported.
WITHOUT_API = r"""
import sys
sys.modules["opentelemetry"] = None  # what `import opentelemetry` meets when the extra is absent
from broker.engine.hooks import HookTable, MiddlewareList
from broker.observability import tracing
from broker.testing import memory_broker
from middleware.tracing import Tracing
import dramatiq

assert not tracing.enabled()
broker = memory_broker()
policy = next(m for m in broker.middleware if type(m) is Tracing)
# the hooks the Postgres broker calls: a middleware's own methods, not the base class's no-ops
table, listed = HookTable(), MiddlewareList(broker.middleware)
for signal in ("before_process_message", "after_process_message", "after_skip_message"):
    called = [type(m).__name__ for m, _ in table.of(listed, signal)]
    assert "Tracing" not in called, (signal, called)
assert [m for m, _ in table.of(listed, "before_enqueue")] == [policy]

from dramatiq.middleware import CurrentMessage

ran = []

@dramatiq.actor(queue_name="traced", actor_name="test.traced")
def traced(n):
    ran.append((n, CurrentMessage.get_current_message().options.get("trace_context")))

carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
message = traced.message_with_options(args=(1,), trace_context=carrier)
broker.enqueue(message)
assert broker.drain() == 1 and ran == [(1, carrier)]  # the context it carries stays on it
print("ok")
"""


def test_without_the_opentelemetry_api_a_run_calls_no_hook_of_the_tracing_policy():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", WITHOUT_API], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
