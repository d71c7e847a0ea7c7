"""The one helper that owns a thread (the seed's ``detach.Go``).

Infrastructure that must have a thread of its own (the relay loop, the LISTEN
connection, the heartbeat) starts it here and nowhere else: the thread is named,
any exception the function raises is logged and absorbed (the process stays up),
and the owner can stop it and join it with a timeout. Domain code never starts a
thread: it enqueues a job or declares a periodic job (see scripts/check_no_bare_threads.py).

A looping function takes the :class:`threading.Event` it is given and returns when
the event is set; :meth:`Detached.stop` sets it. The event is a :class:`StopEvent`: a
loop that waits on sockets waits on its ``fileno()`` beside them, and needs no timeout
to notice it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(f"standmeet.{__name__}")


class StopEvent(threading.Event):
    """A one-shot stop event whose ``fileno()`` turns readable once it is set: a loop
    waiting on sockets (``poll``) waits on it too, instead of waking every so often to
    look at the event (an idle relay did ten times a second)."""

    def __init__(self) -> None:
        super().__init__()
        self._pipe: tuple[int, int] | None = None
        self._pipe_lock = threading.Lock()

    def fileno(self) -> int:
        """A descriptor that is readable once the event is set (made on first use)."""
        with self._pipe_lock:
            if self._pipe is None:
                read_end, write_end = os.pipe()
                os.set_blocking(write_end, False)
                self._pipe = (read_end, write_end)
                if self.is_set():
                    os.write(write_end, b"x")
            return self._pipe[0]

    def set(self) -> None:
        super().set()
        with self._pipe_lock:
            if self._pipe is not None:
                try:
                    os.write(self._pipe[1], b"x")
                except OSError:  # full: readable already
                    pass

    def __del__(self) -> None:
        pipe = getattr(self, "_pipe", None)
        if pipe is not None:
            for fd in pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass


class Detached:
    """A named background thread whose failures are logged, never raised."""

    def __init__(self, name: str, fn: Callable[[threading.Event], object]) -> None:
        self.name = name
        self.stop_event = StopEvent()
        self.error: BaseException | None = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self._fn(self.stop_event)
        except BaseException as exc:  # absorbed on purpose: a helper thread never kills the process
            self.error = exc
            logger.exception("background thread %r failed; it has stopped", self.name)

    def start(self) -> Detached:
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> bool:
        """Ask the function to return, wait up to ``timeout_s``; True if it has stopped."""
        self.stop_event.set()
        return self.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> bool:
        if self._thread.ident is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def go(name: str, fn: Callable[[threading.Event], object]) -> Detached:
    """Start ``fn(stop_event)`` on a named thread that absorbs its exceptions."""
    return Detached(name, fn).start()


def every(
    name: str, interval_s: float, once: Callable[[], object], *, on_error_s: float | None = None
) -> Detached:
    """Run ``once()`` every ``interval_s`` seconds until stopped; errors are logged, not fatal."""

    def loop(stop: threading.Event) -> None:
        failing = False
        while not stop.is_set():
            try:
                once()
                if failing:
                    logger.info("%s: recovered", name)
                failing = False
                wait = interval_s
            except Exception as exc:
                if not failing:  # one line per outage, not one per tick
                    logger.warning("%s: %s (retrying)", name, exc)
                failing = True
                wait = on_error_s if on_error_s is not None else interval_s
            stop.wait(wait)

    return go(name, loop)
