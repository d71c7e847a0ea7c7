"""Which middleware hooks a signal calls, worked out once instead of on every signal.

Dramatiq calls every middleware's method for every signal, several per message, most
of them the base class's no-ops. The broker calls only:

* **the hooks a middleware really has** (:meth:`HookTable.of`): a method that is not the
  ``Middleware`` base class's no-op;
* **for a run, the hooks of the policies that apply to it** (:meth:`HookTable.for_run`):
  a policy that acts on a run only when an option names it (a pipeline's next step, a
  callback, a group's completion, an age limit, a keyed lease) declares those options
  (:func:`options_gate`), and costs a run nothing unless its message or its actor sets
  one of them. Which of the gating options a run has is read once, when it starts, so
  its before- and after-hooks are the same policies' (:func:`gating_options`).

Both are rebuilt when the middleware list changes (:class:`MiddlewareList` counts its
changes). A middleware of an application declares its own gate with a
``runs_only_with_options`` attribute (a set of option names); one without is called
for every run, as Dramatiq would.
"""

from __future__ import annotations

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

#: The signals of a run whose hooks a gate can skip.
RUN_SIGNALS = frozenset({"before_process_message", "after_process_message", "after_skip_message"})

#: Dramatiq's policies that act on a run only when one of these options is set (on the
#: message or its actor), given the middleware's own configuration. Only these exact
#: classes: a subclass may do more.
DRAMATIQ_GATES: dict[type, tuple[frozenset[str], Callable[[Any], bool]]] = {
    Pipelines: (frozenset({"pipe_target"}), lambda m: True),
    Callbacks: (frozenset({"on_success", "on_failure"}), lambda m: True),
    GroupCallbacks: (frozenset({"group_completion_uuid"}), lambda m: True),
    AgeLimit: (frozenset({"max_age"}), lambda m: m.max_age is None),
    ShutdownNotifications: (frozenset({"notify_shutdown"}), lambda m: not m.notify_shutdown),
}


def options_gate(middleware: Any) -> frozenset[str] | None:
    """The options without which ``middleware`` does nothing to a run (None: it acts on
    every run)."""
    declared = getattr(middleware, "runs_only_with_options", None)
    if declared is not None:
        return frozenset(declared)
    gate = DRAMATIQ_GATES.get(type(middleware))
    if gate is not None and gate[1](middleware):
        return gate[0]
    return None


class MiddlewareList(list):  # type: ignore[type-arg]
    """The broker's middleware list, with a count of its changes: the hooks are worked
    out again when it moves, not checked against a copy of the list on every signal."""

    version = 0


def _counting(name: str) -> Callable[..., Any]:
    original = getattr(list, name)

    def mutate(self: MiddlewareList, *args: Any, **kwargs: Any) -> Any:
        self.version += 1
        return original(self, *args, **kwargs)

    mutate.__name__ = name
    return mutate


for _mutator in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert",
                 "pop", "remove", "clear", "sort", "reverse"):
    setattr(MiddlewareList, _mutator, _counting(_mutator))


class HookTable:
    """The hooks of one middleware list, by signal and, for a run, by its gating options."""

    def __init__(self) -> None:
        self._version: tuple[int, int] = (0, -1)
        self._hooks: dict[str, list[Hook]] = {}
        self._runs: dict[tuple[str, frozenset[str]], list[Hook]] = {}
        self._gates: dict[int, frozenset[str] | None] = {}
        #: every option some gate names
        self.gating: frozenset[str] = frozenset()

    def _current(self, middleware: MiddlewareList) -> None:
        version = (id(middleware), middleware.version)
        if self._version != version:
            self._version, self._hooks, self._runs = version, {}, {}
            self._gates = {id(m): options_gate(m) for m in middleware}
            self.gating = frozenset().union(*(g for g in self._gates.values() if g is not None))

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

    def for_run(self, middleware: MiddlewareList, name: str, present: frozenset[str]) -> list[Hook]:
        """The hooks of ``name`` (a run's signal) for a run whose gating options are ``present``."""
        if self._version != (id(middleware), middleware.version):
            self._current(middleware)
        key = (name, present)
        planned = self._runs.get(key)
        if planned is None:
            hooks = self.of(middleware, name)
            gates = self._gates
            planned = [(m, hook) for m, hook in hooks
                       if (gate := gates.get(id(m))) is None or not gate.isdisjoint(present)]
            self._runs[key] = planned
        return planned

    def gating_options(self, middleware: MiddlewareList, message_options: Mapping[str, Any],
                       actor_options: Mapping[str, Any]) -> frozenset[str]:
        """Which of the options some gate names a run has (on its message or its actor)."""
        self._current(middleware)
        if not self.gating:
            return frozenset()
        return frozenset(option for option in self.gating if option in message_options or option in actor_options)
