"""The one back-off helper: exponential, capped, with jitter.

Every loop that retries against the database (consumers, the settler, the relay, the
listeners) waits with it, so a recovering server is not hit by every thread at once.
"""

from __future__ import annotations

import random


class Backoff:
    """``next_s()`` doubles from ``start_s`` up to ``cap_s``; each wait is jittered
    into [half, full] of the current step. ``reset()`` after a success."""

    def __init__(self, *, start_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        if not 0 < start_s <= cap_s:
            raise ValueError(f"back-off needs 0 < start_s ({start_s}) <= cap_s ({cap_s})")
        self.start_s = start_s
        self.cap_s = cap_s
        self._step = 0.0
        self._rng = rng or random.Random()

    def next_s(self) -> float:
        """The next wait, in seconds."""
        self._step = self.start_s if self._step == 0 else min(self._step * 2, self.cap_s)
        return self._step * (0.5 + self._rng.random() / 2)

    def reset(self) -> None:
        self._step = 0.0

    @property
    def failing(self) -> bool:
        return self._step > 0
