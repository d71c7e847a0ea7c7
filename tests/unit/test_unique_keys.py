"""Whether a batch holds a message with a unique key is answered in one pass, exactly as
each message's own key says."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dramatiq
import pytest

from broker import UniqueBy
from broker.engine.unique import any_unique_key, unique_key_of


@dataclass
class _Actor:
    actor_name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Broker:
    actors: dict[str, _Actor]


BROKER = _Broker({a.actor_name: a for a in (
    _Actor("plain"), _Actor("unique", {"unique": True}), _Actor("by-actor", {"unique": UniqueBy(args=False)}),
    _Actor("not-unique", {"unique": False}), _Actor("unique-none", {"unique": None}))})


def _message(actor: str, **options: Any) -> dramatiq.Message:
    return dramatiq.Message(queue_name="q", actor_name=actor, args=(1,), kwargs={}, options=options)


MESSAGES = [
    _message("plain"), _message("unique"), _message("by-actor"), _message("not-unique"), _message("unique-none"),
    _message("undeclared"), _message("plain", unique_key="k"), _message("plain", unique_key=None),
    _message("plain", unique_period_s=60), _message("plain", unique_period_s=None), _message("plain", priority=3),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: f"{m.actor_name}-{sorted(m.options.items())}")
def test_a_message_has_a_unique_key_in_the_one_pass_exactly_when_its_own_key_is_made(message):
    assert any_unique_key([message], BROKER) is (unique_key_of(message, BROKER) is not None)


def test_a_batch_has_one_when_any_of_its_messages_has_one_however_late():
    plain = [_message("plain") for _ in range(50)]
    assert any_unique_key(plain, BROKER) is False
    assert any_unique_key([*plain, _message("plain", unique_period_s=5)], BROKER) is True
    assert any_unique_key([*plain, _message("unique")], BROKER) is True
    assert any_unique_key([], BROKER) is False
