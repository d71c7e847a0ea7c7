"""The broker calls, for a run, only the hooks of the policies that apply to it."""

from __future__ import annotations

from typing import Any

from dramatiq.middleware import AgeLimit, Callbacks, Middleware, Pipelines, ShutdownNotifications

from broker.engine.hooks import HookTable, MiddlewareList, applies


class Counting(Middleware):
    """A policy of an application that acts only on runs with a ``budget`` option."""

    runs_only_with_options = frozenset({"budget"})

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        pass


class Always(Middleware):
    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        pass


def _called(table: HookTable, middleware: MiddlewareList, name: str, message_options: dict[str, Any],
            actor_options: dict[str, Any] | None = None) -> list[str]:
    """The policies whose ``name`` hook a run with these options calls."""
    return [type(m).__name__ for m, _, gate in table.for_run(middleware, name)
            if applies(gate, m, message_options, actor_options or {})]


def test_a_policy_gated_on_options_is_called_only_for_runs_that_set_one():
    table = HookTable()
    middleware = MiddlewareList([Pipelines(), Callbacks(), Counting(), Always()])
    # A run that sets none of the gating options calls only the ungated policy
    assert _called(table, middleware, "after_process_message", {}) == ["Always"]
    # A pipeline's step, an actor with a callback, a run with the application's option
    assert _called(table, middleware, "after_process_message", {"pipe_target": {}}) == ["Pipelines", "Always"]
    assert _called(table, middleware, "after_process_message", {}, {"on_success": "done_cb"}) == ["Callbacks", "Always"]
    assert _called(table, middleware, "after_process_message", {"budget": 3}) == ["Counting", "Always"]


def test_a_policy_configured_to_act_on_every_run_is_never_skipped():
    table = HookTable()
    middleware = MiddlewareList([AgeLimit(max_age=60_000), ShutdownNotifications(notify_shutdown=True),
                                 AgeLimit(), ShutdownNotifications()])
    assert _called(table, middleware, "before_process_message", {}) == ["AgeLimit", "ShutdownNotifications"]


def test_a_policy_configured_after_the_hooks_were_worked_out_is_judged_as_configured_now():
    table = HookTable()
    age_limit = AgeLimit()
    middleware = MiddlewareList([age_limit])
    assert _called(table, middleware, "before_process_message", {}) == []
    age_limit.max_age = 1  # the list did not change: the table is the one worked out above
    assert _called(table, middleware, "before_process_message", {}) == ["AgeLimit"]


def test_the_hooks_follow_changes_of_the_middleware_list():
    table = HookTable()
    middleware = MiddlewareList([Always()])
    assert _called(table, middleware, "after_process_message", {"budget": 1}) == ["Always"]
    middleware.append(Counting())
    assert _called(table, middleware, "after_process_message", {"budget": 1}) == ["Always", "Counting"]


def test_a_list_made_in_place_of_another_is_never_taken_for_it():
    # Given a table worked out for a list, which then goes (its address free for another)
    table = HookTable()
    first = MiddlewareList([Always()])
    assert _called(table, first, "after_process_message", {}) == ["Always"]
    serial = first.serial
    del first
    # When a new list of other middleware is made, at the same version (0)
    second = MiddlewareList([Counting()])
    # Then it has a serial of its own and the table works its hooks out again
    assert second.serial != serial and second.version == 0
    assert _called(table, second, "after_process_message", {"budget": 1}) == ["Counting"]


class Disarms(Middleware):
    def __init__(self) -> None:
        self.disarmed = 0

    def disarm(self) -> None:
        self.disarmed += 1


def test_the_bare_hooks_of_a_signal_follow_changes_of_the_middleware_list():
    table = HookTable()
    first, second = Disarms(), Disarms()
    middleware = MiddlewareList([first, Always()])
    assert [hook.__self__ for hook in table.bound(middleware, "disarm")] == [first]
    assert table.bound(middleware, "disarm") is table.bound(middleware, "disarm")  # worked out once
    middleware.append(second)
    hooks = table.bound(middleware, "disarm")
    assert [hook.__self__ for hook in hooks] == [first, second]
    for hook in hooks:
        hook()
    assert (first.disarmed, second.disarmed) == (1, 1)
    middleware.remove(first)
    assert [hook.__self__ for hook in table.bound(middleware, "disarm")] == [second]
