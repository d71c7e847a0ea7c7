"""Hide the arguments of the messages a message carries inside its options.

A message's own ``args``/``kwargs`` are shown or hidden by whoever displays it; its
options can carry whole other messages with theirs: Dramatiq's ``pipe_target`` (the next
step of a pipeline), a group's ``group_completion_callbacks`` (a list of messages), and
whatever a middleware stores the same way. :func:`hidden_options` returns the options
with the ``args`` and ``kwargs`` of every such nested message replaced by
:data:`HIDDEN`, at any depth, and everything else (actor names, queue names, ids, eta,
retries) kept, so an operator still sees what will run next without seeing its data.
"""

from __future__ import annotations

from typing import Any

#: What stands in place of a nested message's arguments.
HIDDEN = "(hidden)"

#: The keys of a message dict that carry its arguments.
ARGUMENT_KEYS = ("args", "kwargs")

#: How deep the options are walked; anything deeper is replaced by :data:`HIDDEN` whole,
#: so a hostile or corrupt options document neither leaks nor exhausts the stack.
MAX_DEPTH = 64


def hidden_options(options: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` in which every nested dict that carries ``args`` or
    ``kwargs`` (a message: ``pipe_target``, each of ``group_completion_callbacks``, any
    other) has those values replaced by :data:`HIDDEN`, at any depth. The top level is
    the options themselves, not a message: an option literally named ``args`` or
    ``kwargs`` there is hidden too, since it can only be a message's data. ``options`` is
    not modified. Non-dict input gives an empty dict."""
    if not isinstance(options, dict):
        return {}
    hidden = _hide(options, 0)
    assert isinstance(hidden, dict)
    return hidden


def _hide(value: Any, depth: int) -> Any:
    if depth >= MAX_DEPTH:
        return HIDDEN if isinstance(value, (dict, list, tuple)) else value
    if isinstance(value, dict):
        return {key: (HIDDEN if key in ARGUMENT_KEYS else _hide(item, depth + 1))
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_hide(item, depth + 1) for item in value]
    return value
