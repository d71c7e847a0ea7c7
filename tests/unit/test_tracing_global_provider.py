"""Whether runs are traced by OpenTelemetry's global provider costs a run next to
nothing: a provider installed in code is seen at once, one named by the environment
within ``GLOBAL_LOOK_S`` (the API's lookup reads the environment, which is not done on
every run), and once seen it is remembered (the global provider can be set only once)."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry", reason="the [otel] extra is not installed")

from opentelemetry import trace  # noqa: E402

from broker.observability import tracing  # noqa: E402


class _SdkLikeProvider:
    """Stands for an SDK's provider: anything but the API's proxy or no-op one."""


@pytest.fixture
def api(monkeypatch):
    """OpenTelemetry's API as this process sees it, with no provider set in code and each
    lookup of the global provider recorded (the API's proxy, unless the environment names
    one: ``answer["provider"]``)."""
    calls: list[object] = []
    answer = {"provider": trace.ProxyTracerProvider()}

    def get_tracer_provider():
        calls.append(answer["provider"])
        return trace._TRACER_PROVIDER if trace._TRACER_PROVIDER is not None else answer["provider"]

    monkeypatch.setattr(tracing.trace, "get_tracer_provider", get_tracer_provider)
    monkeypatch.setattr(tracing.trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(tracing, "_provider", None)
    monkeypatch.setattr(tracing, "_global_seen", False)
    monkeypatch.setattr(tracing, "_global_look_at", 0.0)
    return calls, answer


def test_a_run_does_not_look_up_the_environments_provider_each_time(api):
    calls, _ = api
    assert not any(tracing.worth_a_span(None) for _ in range(1_000))
    assert len(calls) == 1


def test_a_provider_installed_in_code_is_seen_at_once_even_after_runs_that_found_none(api, monkeypatch):
    # Given runs (or sends) before the application installed its SDK
    assert not tracing.recording()
    # When it installs one as the global provider
    monkeypatch.setattr(tracing.trace, "_TRACER_PROVIDER", _SdkLikeProvider())
    # Then the next run is traced, and it is remembered
    assert tracing.recording() and tracing.worth_a_span(None)


def test_a_provider_the_environment_names_is_seen_once_the_look_is_due_and_then_remembered(api, monkeypatch):
    calls, answer = api
    assert not tracing.recording()
    answer["provider"] = _SdkLikeProvider()
    assert not tracing.recording()  # not looked at again within the second
    monkeypatch.setattr(tracing, "_global_look_at", 0.0)  # the look is due
    assert tracing.recording()
    answer["provider"] = trace.ProxyTracerProvider()
    assert tracing.recording() and tracing.worth_a_span(None)
    assert len(calls) == 2


def test_a_provider_set_here_is_used_at_once(api, monkeypatch):
    assert not tracing.recording()
    monkeypatch.setattr(tracing, "_provider", _SdkLikeProvider())
    assert tracing.recording()
