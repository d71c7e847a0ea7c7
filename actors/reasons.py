"""A job that fails for good says why: the exception's type and message on the message.

Dramatiq's retry policy keeps a traceback only for failures it retries; an exception
listed in an actor's ``throws`` rejects the message at once with nothing recorded, so
the broker stored the bare word ``failed``. :func:`keeps_reason` wraps an actor's
function: when it raises, the exception's type and message are put in the message's
``error`` option, which the broker writes into the rejected row's ``error`` column.
(A retried failure's traceback, when there is one, still wins.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from dramatiq.middleware import CurrentMessage

F = TypeVar("F", bound=Callable[..., Any])

#: The longest reason kept (the broker keeps the last 4000 characters of an error).
MAX_REASON = 2000


def keeps_reason(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            message = CurrentMessage.get_current_message()
            if message is not None:
                message.options["error"] = f"{type(exc).__name__}: {exc}"[:MAX_REASON]
            raise

    return wrapper  # type: ignore[return-value]
