"""A policy the broker may skip for a run (a callback, a pipeline's next step, an age
limit) still acts whenever Dramatiq's own broker would make it act: on an option the run
gained from an earlier middleware or from the actor's own code, on a configuration set
after the broker was in use, and on a middleware list replaced by another."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.middleware import AgeLimit, CurrentMessage, Middleware

from tests.support.db import query, wait_for

ran: dict[str, threading.Event] = {}


def _ran(label: str) -> threading.Event:
    return ran.setdefault(label, threading.Event())


@dramatiq.actor(actor_name="test.gating.audit", queue_name="index", max_retries=0)
def audit(message: dict[str, Any], result: Any) -> None:
    _ran(f"audit:{message['args'][0]}").set()


@dramatiq.actor(actor_name="test.gating.next_step", queue_name="index", max_retries=0)
def next_step(label: str) -> None:
    _ran(f"next:{label}").set()


@dramatiq.actor(actor_name="test.gating.step", queue_name="index", max_retries=0)
def step(label: str, *, pipe_at_run: bool = False) -> str:
    if pipe_at_run:  # the actor's own code makes the next step (as pipeline() would before the send)
        CurrentMessage.get_current_message().options["pipe_target"] = next_step.message_with_options(
            args=(label,), pipe_ignore=True).asdict()
    _ran(f"step:{label}").set()
    return label


class AuditEveryStep(Middleware):
    """An application's middleware that gives every run of ``step`` a success callback."""

    def before_process_message(self, broker: Any, message: Any) -> None:
        if message.actor_name == "test.gating.step":
            message.options["on_success"] = "test.gating.audit"


class CountSends(Middleware):
    def __init__(self) -> None:
        self.sent: list[str] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.sent.append(message.message_id)


@pytest.fixture
def worker(broker: dramatiq.Broker, start_worker: Any) -> Iterator[dramatiq.Worker]:
    ran.clear()
    yield start_worker(queues=["index"], threads=4)


def _settled(url: str, message_id: str) -> str:
    def state() -> str | None:
        rows = query(url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s", (message_id,))
        return rows[0][0] if rows and rows[0][0] not in ("queued", "consumed") else None

    return wait_for(state, timeout_s=20, what=f"message {message_id} to settle")


def test_a_callback_an_earlier_middleware_gives_the_run_is_called(broker, worker, database_url):
    broker.add_middleware(AuditEveryStep(), before=type(broker.middleware[0]))
    try:
        step.send("given-by-middleware")
        assert _ran("audit:given-by-middleware").wait(20), "the success callback never ran"
    finally:
        broker.middleware[:] = [m for m in broker.middleware if not isinstance(m, AuditEveryStep)]


def test_a_next_step_the_actor_sets_while_it_runs_is_sent(broker, worker, database_url):
    step.send("piped-at-run", pipe_at_run=True)
    assert _ran("step:piped-at-run").wait(20)
    assert _ran("next:piped-at-run").wait(20), "the pipeline's next step was never sent"


def test_an_age_limit_set_on_the_running_broker_skips_a_message_older_than_it(broker, worker, database_url):
    # Given the broker has run jobs with no age limit (its hooks worked out without one)
    warm = step.send("before-the-limit")
    assert _ran("step:before-the-limit").wait(20)
    assert _settled(database_url, warm.message_id) == "done"
    age_limits = [m for m in broker.middleware if type(m) is AgeLimit]
    assert age_limits, "the broker has Dramatiq's AgeLimit"
    # When the operator's code sets one, and an hour-old message arrives
    for m in age_limits:
        m.max_age = 60_000
    try:
        old = step.message("an-hour-old").copy(message_timestamp=int(time.time() * 1000) - 3_600_000)
        broker.enqueue(old)
        # Then it is rejected without running (Dramatiq's AgeLimit fails it)
        assert _settled(database_url, old.message_id) == "rejected"
        assert not _ran("step:an-hour-old").is_set(), "a message older than the age limit ran"
    finally:
        for m in age_limits:
            m.max_age = None


def test_a_middleware_list_replaced_by_a_plain_list_has_its_new_hooks_called(broker, database_url):
    # Given the broker has sent with its configured list (its hooks worked out)
    step.send("with-the-first-list")
    counting = CountSends()
    # When the list is replaced by a plain one holding one more middleware, the old list
    # left to go (a list made after it may take its address)
    broker.middleware = [*broker.middleware, counting]
    try:
        sent = step.send("with-the-second-list")
        # Then the new middleware's hook is called
        assert counting.sent == [sent.message_id]
    finally:
        broker.middleware = [m for m in broker.middleware if m is not counting]


class RecordsHowItIsCalled(Middleware):
    """An application's middleware whose after-hook takes any keywords: what it is given."""

    def __init__(self) -> None:
        self.before: list[tuple[Any, ...]] = []
        self.after: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.custom: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def before_process_message(self, broker: Any, *args: Any, **kwargs: Any) -> None:
        self.before.append((*args, *kwargs.items()))

    def after_process_message(self, broker: Any, *args: Any, **kwargs: Any) -> None:
        self.after.append((args, kwargs))

    def after_custom_signal(self, broker: Any, *args: Any, **kwargs: Any) -> None:
        self.custom.append((args, kwargs))


class TakesOnlyAResult(Middleware):
    """A middleware written for runs that return: its hook has no ``exception`` parameter."""

    def __init__(self) -> None:
        self.results: list[Any] = []

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None) -> None:
        self.results.append(result)


def test_each_hook_is_given_exactly_the_arguments_and_keywords_its_signal_came_with(broker):
    recorder, result_only = RecordsHowItIsCalled(), TakesOnlyAResult()
    broker.add_middleware(recorder)
    broker.add_middleware(result_only)
    message = MessageProxy(step.message("shapes"))
    error = ValueError("boom")
    try:
        # A run's before-signal: the message alone
        broker.emit_before("process_message", message)
        assert recorder.before == [(message,)]
        # A returned run: the message and its result, and no exception keyword
        broker.emit_after("process_message", message, result="done")
        assert recorder.after[-1] == ((message,), {"result": "done"})
        assert result_only.results == ["done"]
        # A failed run: the message and its exception only
        broker._emit_after("process_message", message, exception=error)
        assert recorder.after[-1] == ((message,), {"exception": error})
        # Neither keyword; both; and a signal of an application's own, as given
        broker._emit_after("process_message", message)
        assert recorder.after[-1] == ((message,), {})
        broker._emit_after("process_message", message, result=None, exception=error)
        assert recorder.after[-1] == ((message,), {"result": None, "exception": error})
        broker._emit_after("custom_signal", message, "second", flag=True)
        assert recorder.custom == [((message, "second"), {"flag": True})]
    finally:
        broker.middleware[:] = [m for m in broker.middleware if m not in (recorder, result_only)]
