"""OpenTelemetry traces, when the ``[otel]`` extra (``opentelemetry-api``) is installed;
a no-op otherwise. Nothing here imports the SDK: the application installs one, with its
exporter, as OpenTelemetry's global tracer provider.

Spans follow the OpenTelemetry messaging semantic conventions: a producer span
``send <destination>`` per enqueue or emit and a consumer span ``process <destination>``
per run (the destination is the queue, or the outbox topic), with ``messaging.system``,
``messaging.destination.name``, ``messaging.operation.name`` and
``messaging.operation.type`` (``send`` / ``process``), ``messaging.message.id``, and on
failure ``error.type`` (the exception's qualified type) and an error status.

The W3C trace context travels in the message's options (``trace_context``:
``traceparent`` and ``tracestate``) through outbox → relay → the jobs it makes, and on
to what those jobs send (an application's outgoing HTTP request may carry it as
``traceparent``). A run's span has a link to the span of the
send that produced its message (what the conventions require of a consumer span), and
is also that span's child: a run processes one message, for which the conventions allow
the producer's context as parent, so the trace reads as one tree from the request that
enqueued the work down to what the run sends in turn.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    _NO_OP_PROVIDERS: tuple[type, ...] = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
except ImportError:  # the [otel] extra is not installed
    trace = None  # type: ignore[assignment]

#: Where a message carries its trace context.
OPTION = "trace_context"
#: Where an outbox event carries it (beside the payload; the relay moves it to its messages).
OUTBOX_KEY = "_trace"
TRACER_NAME = "standmeet-jobs"

#: ``messaging.system`` of the runtime's queues, and of the outbox.
SYSTEM = "dramatiq"
OUTBOX_SYSTEM = "standmeet.outbox"
SEND = "send"
PROCESS = "process"


def span_name(operation: str, destination: str) -> str:
    """``<operation> <destination>``, as the conventions name a messaging span."""
    return f"{operation} {destination}"


def messaging_attributes(operation: str, destination: str, *, system: str = SYSTEM,
                         message_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """The conventions' attributes of a ``send`` or ``process`` span (plus ``extra``)."""
    attributes: dict[str, Any] = {"messaging.system": system, "messaging.destination.name": destination,
                                  "messaging.operation.name": operation, "messaging.operation.type": operation}
    if message_id is not None:
        attributes["messaging.message.id"] = message_id
    attributes.update(extra)
    return attributes


def error_type(exception: BaseException) -> str:
    """The exception's qualified type, as ``error.type`` takes it: ``module.QualName``, the
    builtins' bare (``ValueError``)."""
    kind = type(exception)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"

_provider: Any = None


def enabled() -> bool:
    """Whether ``opentelemetry-api`` is installed."""
    return trace is not None


def set_tracer_provider(provider: Any) -> None:
    """Use ``provider`` rather than OpenTelemetry's global one (tests; None: the global)."""
    global _provider
    _provider = provider


def tracer() -> Any:
    """The tracer of this library's spans (the provider set here, else the global one)."""
    provider = _provider if _provider is not None else trace.get_tracer_provider()
    return provider.get_tracer(TRACER_NAME)


#: Set on an enqueue hook that only adds a trace carrier to a message that has none: a
#: message that carries one, or any message when there is nothing to carry, leaves it
#: unchanged, so a bulk writer (the relay) may skip it for such messages.
CARRIER_ONLY = "standmeet_carrier_only"


def carrier_only(hook: Any) -> Any:
    """Declare ``hook`` (a ``before_enqueue``) as adding a trace carrier and nothing else."""
    setattr(hook, CARRIER_ONLY, True)
    return hook


def is_carrier_only(hook: Any) -> bool:
    """Whether a (bound) enqueue hook was declared with :func:`carrier_only`."""
    return bool(getattr(getattr(hook, "__func__", hook), CARRIER_ONLY, False))


def nothing_to_carry() -> bool:
    """True when a producer span could carry nothing: no ``[otel]`` extra, or no tracer
    provider of ours, the API's global one still its proxy (or a no-op) and no valid
    span current. The API's no-op tracer would then hand back the current, invalid span
    and inject nothing, at some microseconds a message (the relay's main cost after
    the SQL)."""
    if trace is None:
        return True
    return not recording() and not trace.get_current_span().get_span_context().is_valid


def produced(name: str, attributes: Mapping[str, Any]) -> dict[str, str] | None:
    """A producer span (child of the current one), ended at once; returns the W3C
    context to carry, or None when there is nothing to carry (no SDK, no recording).
    Its operation is ``send`` unless ``attributes`` say otherwise; when they name a
    destination, the span is named as the conventions say (``send <destination>``)
    whatever ``name`` the caller gave."""
    if nothing_to_carry():
        return None
    attributes = {"messaging.operation.name": SEND, "messaging.operation.type": SEND, **attributes}
    if "messaging.destination.name" in attributes:
        name = span_name(str(attributes["messaging.operation.name"]), str(attributes["messaging.destination.name"]))
    span = tracer().start_span(name, kind=SpanKind.PRODUCER, attributes=attributes)
    try:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier or None
    finally:
        span.end()


def carried(value: Any) -> dict[str, str] | None:
    """The trace context a message's option holds, when it is one (a mapping of text to
    text, as :func:`produced` makes it); anything else (a string, a number, a mapping of
    other things, written around the runtime) is no context: the run is traced as one
    that carries none, rather than failing its hook at every run."""
    if not isinstance(value, Mapping) or not value:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return None
    return dict(value)


class Consumed:
    """A consumer span for one run, current (attached) until :meth:`end`: the child of the
    context the message carries, with a link to it (the producer's span)."""

    def __init__(self, name: str, carrier: Any, attributes: Mapping[str, Any]) -> None:
        parent = propagate.extract(carried(carrier) or {})
        producer = trace.get_current_span(parent).get_span_context()
        links = [Link(producer)] if producer.is_valid else []
        self.span = tracer().start_span(name, context=parent, kind=SpanKind.CONSUMER,
                                         attributes=dict(attributes), links=links)
        self.token = otel_context.attach(trace.set_span_in_context(self.span, parent))

    def end(self, exception: BaseException | None = None, *, outcome: str | None = None) -> None:
        """End the span: an error (``error.type``, the exception recorded, status ERROR) when
        ``exception`` is given."""
        try:
            if outcome is not None:
                self.span.set_attribute("standmeet.outcome", outcome)
            if exception is not None:
                self.span.set_attribute("error.type", error_type(exception))
                self.span.set_status(Status(StatusCode.ERROR, f"{type(exception).__name__}: {_text(exception)}"))
                try:
                    self.span.record_exception(exception)
                except Exception:  # its text cannot be read: its type and status are recorded
                    pass
        finally:  # whatever the exception's text does, the span ends and the run's context goes
            self.span.end()
            otel_context.detach(self.token)


#: How long "no provider is named by the environment" is taken as still true before the
#: API is asked again: its lookup reads the environment (``OTEL_PYTHON_TRACER_PROVIDER``),
#: which a job would otherwise pay on every run. A provider installed in code is seen at
#: once; the global provider can be set only once, so one seen installed is remembered.
GLOBAL_LOOK_S = 1.0
_global_seen = False
_global_look_at = 0.0
_UNKNOWN = object()


def recording() -> bool:
    """Whether spans are recorded: a provider set here, or an SDK's installed as
    OpenTelemetry's global one (the API alone hands out non-recording spans)."""
    global _global_seen, _global_look_at
    if trace is None:
        return False
    if _provider is not None or _global_seen:
        return True
    # The API's own record of a provider set in code (read where the API keeps it: with
    # none set, only the environment can name one, and that is looked at once a second).
    if getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is None:
        now = time.monotonic()
        if now < _global_look_at:
            return False
        _global_look_at = now + GLOBAL_LOOK_S
    _global_seen = not isinstance(trace.get_tracer_provider(), _NO_OP_PROVIDERS)
    return _global_seen


def _text(exception: BaseException) -> str:
    """``str(exception)``, or what can be said when that raises."""
    try:
        return str(exception)
    except Exception:
        return f"(its text could not be read: {type(exception).__name__}.__str__ raised)"


def worth_a_span(carrier: Any) -> bool:
    """Whether a run whose message carries ``carrier`` needs a consumer span: something
    records it, or it has a context to pass on to what it sends."""
    return trace is not None and ((carrier is not None and carried(carrier) is not None) or recording())


def consumed(name: str, carrier: Any, attributes: Mapping[str, Any]) -> Consumed | None:
    """The run's consumer span; None when it is not :func:`worth_a_span` (no SDK, and a
    message that carries no trace context): a run then costs no span."""
    return Consumed(name, carrier, attributes) if worth_a_span(carrier) else None


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    """Add ``traceparent`` (and ``tracestate``) of the current span to HTTP headers."""
    if trace is not None:
        propagate.inject(headers)
    return headers
