from __future__ import annotations

from types import SimpleNamespace

from broker.settings import QueueSettings
from middleware.time_limit import resolve_time_limit_ms


class FakeBroker:
    """Only the two lookups resolution needs (no database involved)."""

    def __init__(self, actor_options: dict) -> None:
        self.actor = SimpleNamespace(options=actor_options)

    def get_actor(self, name: str) -> SimpleNamespace:
        return self.actor

    def queue_settings(self, name: str) -> QueueSettings:
        return QueueSettings(name, 8, 15.0)


def _message(options: dict) -> SimpleNamespace:
    return SimpleNamespace(options=options, actor_name="webhook.deliver", queue_name="webhook")


def test_the_message_option_wins_over_the_actor_and_the_queue():
    assert resolve_time_limit_ms(FakeBroker({"time_limit": 30_000}), _message({"time_limit": 1_000})) == 1_000


def test_the_actor_option_wins_over_the_queue_default():
    assert resolve_time_limit_ms(FakeBroker({"time_limit": 30_000}), _message({})) == 30_000


def test_the_queue_default_applies_last():
    assert resolve_time_limit_ms(FakeBroker({}), _message({})) == 15_000
