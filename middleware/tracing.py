"""Traces (the ``[otel]`` extra): a producer span per enqueue, a consumer span per run,
named and attributed as the OpenTelemetry messaging conventions say (``send <queue>``,
``process <queue>``; see :mod:`broker.observability.tracing`).

``before_enqueue`` records a producer span and carries its W3C context in the
message's options (``trace_context``); a message that already carries one (a retry,
a snooze, a relayed event's message) keeps it. ``before_process_message`` starts the
run's consumer span, linked to and parented by that context, and makes it current, so
what the job enqueues or emits, and the ``traceparent`` of what it sends, continue the
same trace. Placed first after the connection budget, so its span covers the other
middleware. Without the OpenTelemetry API installed, a run costs this policy nothing: it
has no run hooks then.
"""

from __future__ import annotations

from typing import Any

from dramatiq import Middleware

from broker.observability import tracing


def _attributes(operation: str, message: Any) -> dict[str, Any]:
    return tracing.messaging_attributes(operation, message.queue_name, message_id=message.message_id,
                                        **{"messaging.dramatiq.actor": message.actor_name})


class Tracing(Middleware):
    @tracing.carrier_only
    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        if tracing.OPTION in message.options:
            return
        carrier = tracing.produced(tracing.span_name(tracing.SEND, message.queue_name),
                                   _attributes(tracing.SEND, message))
        if carrier:
            message.options[tracing.OPTION] = carrier

    # Without the OpenTelemetry API no run can be traced (there is nothing to record with,
    # nor a context to make current): the policy then has no run hooks at all, so the
    # broker calls none and a run costs it nothing (Dramatiq's own brokers, which call
    # every middleware's methods, call the base class's no-ops). The API is there or not
    # for the whole life of the process (it is imported once).
    if tracing.enabled():
        def before_process_message(self, broker: Any, message: Any) -> None:
            carrier = message.options.get(tracing.OPTION)
            message.standmeet_span = (
                tracing.Consumed(tracing.span_name(tracing.PROCESS, message.queue_name), carrier,
                                 _attributes(tracing.PROCESS, message))
                if tracing.worth_a_span(carrier) else None)

        def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                                  exception: BaseException | None = None) -> None:
            self._end(message, exception)

        def after_skip_message(self, broker: Any, message: Any) -> None:
            self._end(message, None, outcome="skipped")

    def _end(self, message: Any, exception: BaseException | None, *, outcome: str | None = None) -> None:
        span = getattr(message, "standmeet_span", None)
        if span is not None:
            message.standmeet_span = None
            span.end(exception, outcome=outcome)
