"""Threads interrupted over and over, as busy worker threads are under load."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def interrupted_over_and_over(worker: Callable[[threading.Event], None], interrupt: Callable[[], object], *,
                              for_s: float, until: Callable[[], bool]) -> list[threading.Thread]:
    """Run ``worker(stop)`` on two threads while ``interrupt()`` is called again and again for
    ``for_s`` seconds (sooner once ``until()``), the interpreter switching threads at nearly
    every check; then set ``stop`` and join them. The threads, to check that they ended."""
    stop = threading.Event()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=worker, args=(stop,), daemon=True) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + for_s
        while not until() and time.monotonic() < deadline:
            interrupt()
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        sys.setswitchinterval(switch)
    return threads
