"""Whether runs are traced by OpenTelemetry's global provider is looked up at most once
a ``GLOBAL_LOOK_S``, not on every run; an SDK installed globally is seen within that
time and remembered (the global provider can be set only once)."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry", reason="the [otel] extra is not installed")

from opentelemetry import trace  # noqa: E402

from broker.observability import tracing  # noqa: E402


class _SdkLikeProvider:
    """Stands for an SDK's provider: anything but the API's proxy or no-op one."""


@pytest.fixture
def lookups(monkeypatch):
    """Each lookup of the global provider, and what it returns (the API's proxy until set)."""
    calls: list[object] = []
    answer = {"provider": trace.ProxyTracerProvider()}

    def get_tracer_provider():
        calls.append(answer["provider"])
        return answer["provider"]

    monkeypatch.setattr(tracing.trace, "get_tracer_provider", get_tracer_provider)
    monkeypatch.setattr(tracing, "_provider", None)
    monkeypatch.setattr(tracing, "_global_seen", False)
    monkeypatch.setattr(tracing, "_global_look_at", 0.0)
    return calls, answer


def test_a_run_does_not_look_up_the_global_provider_each_time(lookups):
    calls, _ = lookups
    assert not any(tracing.worth_a_span(None) for _ in range(1_000))
    assert len(calls) == 1


def test_an_sdk_installed_globally_is_seen_once_the_look_is_due_and_then_remembered(lookups, monkeypatch):
    calls, answer = lookups
    # Given no SDK, looked up once
    assert not tracing.recording()
    # When an SDK becomes the global provider
    answer["provider"] = _SdkLikeProvider()
    # Then it is seen at the next look (due at once here), and kept without looking again
    monkeypatch.setattr(tracing, "_global_look_at", 0.0)
    assert tracing.recording()
    answer["provider"] = trace.ProxyTracerProvider()
    assert tracing.recording() and tracing.worth_a_span(None)
    assert len(calls) == 2


def test_a_provider_set_here_is_used_at_once(lookups, monkeypatch):
    assert not tracing.recording()
    monkeypatch.setattr(tracing, "_provider", _SdkLikeProvider())
    assert tracing.recording()
