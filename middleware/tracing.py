"""Traces (the ``[otel]`` extra): a producer span per enqueue, a consumer span per run.

``before_enqueue`` records a producer span and carries its W3C context in the
message's options (``trace_context``); a message that already carries one (a retry,
a snooze, a relayed event's message) keeps it. ``before_process_message`` starts the
run's consumer span under that context and makes it current, so what the job enqueues
or emits, and the webhook POST's ``traceparent``, continue the same trace. Placed
first after the connection budget, so its span covers the other middleware.
"""

from __future__ import annotations

from typing import Any

from dramatiq import Middleware

from broker import tracing


def _attributes(message: Any) -> dict[str, Any]:
    return {"messaging.system": "dramatiq", "messaging.destination.name": message.queue_name,
            "messaging.message.id": message.message_id, "dramatiq.actor": message.actor_name}


class Tracing(Middleware):
    @tracing.carrier_only
    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        if tracing.OPTION in message.options:
            return
        carrier = tracing.produced(f"{message.actor_name} send", _attributes(message))
        if carrier:
            message.options[tracing.OPTION] = carrier

    def before_process_message(self, broker: Any, message: Any) -> None:
        carrier = message.options.get(tracing.OPTION)
        message.standmeet_span = (tracing.Consumed(f"{message.actor_name} process", carrier, _attributes(message))
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
