"""Which middleware hooks a signal calls, worked out once instead of on every signal.

Dramatiq calls every middleware's method for every signal, several per message, most
of them the base class's no-ops. The broker calls only:

* **the hooks a middleware really has** (:meth:`HookTable.of`): a method that is not the
  ``Middleware`` base class's no-op;
* **for a run, the hooks of the policies that apply to it** (:meth:`HookTable.for_run`):
  a policy that acts on a run only when an option names it (a pipeline's next step, a
  callback, a group's completion, an age limit, a keyed lease) declares those options
  (:func:`options_gate`), and costs a run nothing unless its message or its actor sets
  one of them. Whether it does is looked at just before each of its hooks would be
  called, on the message's and the actor's options as they are then (the dictionaries
  themselves, looked up once per signal): an option that an earlier middleware, or the
  actor's own code, gave the run is seen by the hooks that follow, as Dramatiq, which
  calls them all, would let them see it. A Dramatiq policy skipped
  only under its own configuration (``AgeLimit`` without a ``max_age``) is looked at
  as it is configured then, too.

The table is rebuilt when the middleware list changes (:class:`MiddlewareList` counts
its changes, and each list has a serial number of its own). A middleware of an
application declares its own gate with a ``runs_only_with_options`` attribute (a set of
option names); one without is called for every run, as Dramatiq would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    GroupCallbacks,
    Middleware,
    Pipelines,
    ShutdownNotifications,
)

#: A middleware and one of its bound hook methods.
Hook = tuple[Any, Callable[..., Any]]
#: When a policy may be skipped: the options without which it does nothing, and the test
#: of its own configuration under which that holds (None: always).
Gate = tuple[frozenset[str], "Callable[[Any], bool] | None"]
#: A hook of a run's signal with its policy's gate (None: called for every run).
RunHook = tuple[Any, Callable[..., Any], "Gate | None"]

#: The signals of a run whose hooks a gate can skip.
RUN_SIGNALS = frozenset({"before_process_message", "after_process_message", "after_skip_message"})

#: Dramatiq's policies that act on a run only when one of these options is set (on the
#: message or its actor), given the middleware's own configuration. Only these exact
#: classes: a subclass may do more.
DRAMATIQ_GATES: dict[type, Gate] = {
    Pipelines: (frozenset({"pipe_target"}), None),
    Callbacks: (frozenset({"on_success", "on_failure"}), None),
    GroupCallbacks: (frozenset({"group_completion_uuid"}), None),
    AgeLimit: (frozenset({"max_age"}), lambda m: m.max_age is None),
    ShutdownNotifications: (frozenset({"notify_shutdown"}), lambda m: not m.notify_shutdown),
}


def options_gate(middleware: Any) -> Gate | None:
    """When ``middleware`` does nothing to a run (None: it may act on every run): without
    one of the gate's options, while its configuration passes the gate's test."""
    declared = getattr(middleware, "runs_only_with_options", None)
    if declared is not None:
        return frozenset(declared), None
    return DRAMATIQ_GATES.get(type(middleware))


def applies(gate: Gate | None, middleware: Any, message_options: Mapping[str, Any],
            actor_options: Mapping[str, Any]) -> bool:
    """Whether the policy ``middleware`` of ``gate`` may act on a run whose message and
    actor have these options now."""
    if gate is None:
        return True
    options, configured_to_skip = gate
    if configured_to_skip is not None and not configured_to_skip(middleware):
        return True
    return not (options.isdisjoint(message_options) and options.isdisjoint(actor_options))


class MiddlewareList(list):  # type: ignore[type-arg]
    """The broker's middleware list, with a count of its changes and a serial number of
    its own (a list made in place of another may live at the address the other had): the
    hooks are worked out again when it moves, not checked against a copy of the list on
    every signal."""

    version = 0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.serial = next(_serials)
        #: replaced at every change: a table worked out for this list at this version holds
        #: the one it saw, so one identity test tells it whether the list moved since
        self.stamp = object()


_serials = itertools.count(1)


def _counting(name: str) -> Callable[..., Any]:
    original = getattr(list, name)

    def mutate(self: MiddlewareList, *args: Any, **kwargs: Any) -> Any:
        self.version += 1
        self.stamp = object()
        return original(self, *args, **kwargs)

    mutate.__name__ = name
    return mutate


for _mutator in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert",
                 "pop", "remove", "clear", "sort", "reverse"):
    setattr(MiddlewareList, _mutator, _counting(_mutator))


class HookTable:
    """The hooks of one middleware list, by signal, with the gates of a run's signals."""

    def __init__(self) -> None:
        self._stamp: object = None
        self._hooks: dict[str, list[Hook]] = {}
        self._runs: dict[str, list[RunHook]] = {}
        self._calls: dict[str, tuple[RunHook, ...]] = {}
        self._bound: dict[str, tuple[Callable[..., Any], ...]] = {}

    def _current(self, middleware: MiddlewareList) -> None:
        if self._stamp is not middleware.stamp:
            self._stamp, self._hooks, self._runs, self._calls, self._bound = middleware.stamp, {}, {}, {}, {}

    def bound(self, middleware: MiddlewareList, name: str) -> tuple[Callable[..., Any], ...]:
        """The hook methods :meth:`calls` gives for ``name`` (in its order), alone: for a
        signal the broker calls without gates (``disarm``, ``refuse_result``)."""
        if self._stamp is not middleware.stamp:
            self._current(middleware)
        found = self._bound.get(name)
        if found is None:
            found = self._bound[name] = tuple(hook for _, hook, _ in self.calls(middleware, name))
        return found

    def calls(self, middleware: MiddlewareList, name: str) -> tuple[RunHook, ...]:
        """What emitting ``name`` calls, in calling order (an ``after_*`` signal's hooks
        backwards, as Dramatiq calls them), each hook with its policy's gate if ``name``
        is a run's signal (None: always called). Worked out once per version of the list:
        the signal path is one identity test and one lookup."""
        if self._stamp is not middleware.stamp:
            self._current(middleware)
        found = self._calls.get(name)
        if found is None:
            planned = (self.for_run(middleware, name) if name in RUN_SIGNALS
                       else [(m, hook, None) for m, hook in self.of(middleware, name)])
            found = self._calls[name] = tuple(reversed(planned) if name.startswith("after_") else planned)
        return found

    def of(self, middleware: MiddlewareList, name: str) -> list[Hook]:
        """The middleware methods that really handle ``name`` (``before_enqueue`` …), in order."""
        self._current(middleware)
        hooks = self._hooks.get(name)
        if hooks is None:
            base = getattr(Middleware, name, None)
            hooks = [(m, getattr(m, name)) for m in middleware
                     if getattr(type(m), name, None) is not base or name in vars(m)]
            self._hooks[name] = hooks
        return hooks

    def for_run(self, middleware: MiddlewareList, name: str) -> list[RunHook]:
        """The hooks of ``name`` (a run's signal), each with its policy's gate: call one
        only if :func:`applies` says so for the run as it is at that moment."""
        self._current(middleware)
        planned = self._runs.get(name)
        if planned is None:
            planned = self._runs[name] = [(m, hook, options_gate(m)) for m, hook in self.of(middleware, name)]
        return planned
