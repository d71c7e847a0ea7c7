"""Where each thread of a process is, on request: ``kill -USR1 <pid>`` writes every
thread's stack to the process's stderr (its log stream), and the process goes on.

For an operator asking why a process does not stop, or why a queue does not move: the
answer is the line each thread is waiting on. The stacks are written by the interpreter
itself (``faulthandler``), so they come even when every Python thread is stuck, the one
that would handle a signal included."""

from __future__ import annotations

import faulthandler
import io
import signal
import sys

#: The signal that asks a process of the runtime for its threads' stacks.
STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks_on_request() -> bool:
    """From now on, :data:`STACKS_SIGNAL` writes every thread's stack to stderr. Called by
    the process entry points (worker, scheduler, relay, ``run``) once they log to stderr.
    Where stderr is no file the interpreter can write to (redirected to a buffer, closed,
    None under ``pythonw``), nothing is registered and False is returned: the command runs
    all the same."""
    try:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError, io.UnsupportedOperation):
        return False
    return True
