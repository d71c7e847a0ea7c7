"""The broker calls, for a run, only the hooks of the policies that apply to it."""

from __future__ import annotations

from typing import Any

from dramatiq.middleware import AgeLimit, Callbacks, Middleware, Pipelines, ShutdownNotifications

from broker.engine.hooks import HookTable, MiddlewareList


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


def _names(hooks: list[Any]) -> list[str]:
    return [type(middleware).__name__ for middleware, _ in hooks]


def test_a_policy_gated_on_options_is_called_only_for_runs_that_set_one():
    table = HookTable()
    middleware = MiddlewareList([Pipelines(), Callbacks(), Counting(), Always()])
    # A run that sets none of the gating options calls only the ungated policy
    none = table.gating_options(middleware, {}, {})
    assert _names(table.for_run(middleware, "after_process_message", none)) == ["Always"]
    # A pipeline's step, an actor with a callback, a run with the application's option
    piped = table.gating_options(middleware, {"pipe_target": {}}, {})
    assert _names(table.for_run(middleware, "after_process_message", piped)) == ["Pipelines", "Always"]
    called_back = table.gating_options(middleware, {}, {"on_success": "done_cb"})
    assert _names(table.for_run(middleware, "after_process_message", called_back)) == ["Callbacks", "Always"]
    budgeted = table.gating_options(middleware, {"budget": 3}, {})
    assert _names(table.for_run(middleware, "after_process_message", budgeted)) == ["Counting", "Always"]


def test_a_policy_configured_to_act_on_every_run_is_never_skipped():
    table = HookTable()
    middleware = MiddlewareList([AgeLimit(max_age=60_000), ShutdownNotifications(notify_shutdown=True),
                                 AgeLimit(), ShutdownNotifications()])
    none = table.gating_options(middleware, {}, {})
    hooks = table.for_run(middleware, "before_process_message", none)
    assert [m for m, _ in hooks] == middleware[:2]


def test_the_hooks_follow_changes_of_the_middleware_list():
    table = HookTable()
    middleware = MiddlewareList([Always()])
    assert _names(table.for_run(middleware, "after_process_message", frozenset())) == ["Always"]
    middleware.append(Counting())
    present = table.gating_options(middleware, {"budget": 1}, {})
    assert present == frozenset({"budget"})
    assert _names(table.for_run(middleware, "after_process_message", present)) == ["Always", "Counting"]
