"""Results: Dramatiq's result storage, never for a run that is going to run again, and
never a result that cannot be kept.

* Dramatiq's ``Results`` stores ``None`` for every skipped message that was not failed.
  Here a snoozed job is reported as skipped (so no retry is counted), yet it runs again
  later: storing ``None`` would hand a waiter a result that does not exist yet. Nothing
  is stored for a message the snooze policy has put back in its queue.
* A result the backend's encoder cannot write (a ``set``, an object) is refused before
  any after-hook sees it (the broker's ``refuse_result`` hook): the job fails for good
  with the reason on its row, and that failure is what a waiter reads, at once.
* Dramatiq's worker warns that "you haven't added the Results middleware" unless one of
  the broker's middleware is exactly ``dramatiq.results.Results`` (not a subclass): so
  :func:`results_middleware` returns Dramatiq's own class, with these two policies bound
  to the instance.
"""

from __future__ import annotations

import types
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.results import ResultBackend
from dramatiq.results import Results as DramatiqResults


def requeued(message: MessageProxy) -> bool:
    """Whether this run's after-hooks put the message back in its queue (a snooze)."""
    context = getattr(message, "standmeet_settle", None)
    return context is not None and context.requeue_delay_ms is not None


def _after_skip_message(self: DramatiqResults, broker: Any, message: MessageProxy) -> None:
    if not requeued(message):
        DramatiqResults.after_skip_message(self, broker, message)


def _refuse_result(self: DramatiqResults, broker: Any, message: MessageProxy, result: Any) -> str | None:
    """Why ``result`` cannot be stored for ``message`` (None when it can, or is not kept)."""
    store_results, _ = self._lookup_options(broker, message)
    if not store_results:
        return None
    try:
        self.backend.encoder.encode(result)
    except (TypeError, ValueError, RecursionError) as exc:
        return (f"the result of {message.actor_name!r} cannot be stored: {type(result).__name__} is not JSON "
                f"({type(exc).__name__}: {str(exc)[:200]})")
    return None


def results_middleware(*, backend: ResultBackend, store_results: bool = False,
                       result_ttl_ms: int | None = None) -> DramatiqResults:
    """Dramatiq's ``Results`` (the very class its worker looks for), with our policies."""
    results = DramatiqResults(backend=backend, store_results=store_results, result_ttl=result_ttl_ms)
    results.after_skip_message = types.MethodType(_after_skip_message, results)  # type: ignore[method-assign]
    results.refuse_result = types.MethodType(_refuse_result, results)  # type: ignore[attr-defined]
    return results


#: The name this policy had as a subclass; it builds the same middleware.
Results = results_middleware
