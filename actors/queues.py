"""This application's queues, their limits, and the timing rule its webhooks need.

Declared through the runtime's registration API, the same way any module declares its
own; ``STANDMEET_QUEUE_<NAME>_MAX_WORKERS`` / ``_TIME_LIMIT_S`` override the limits.
"""

from __future__ import annotations

from typing import Any

from actors import settings as _settings  # noqa: F401  (declares the application's settings)
from broker import app
from broker.errors import StartupRefused

#: The queues, in the order they are documented: (max workers, time limit s, awaited).
QUEUES: dict[str, tuple[int, float, bool]] = {
    "index": (4, 30.0, True),  # a request waits for its write to be indexed
    "notify": (2, 30.0, True),  # and for its mail to be sent
    "webhook": (8, 15.0, False),
    "maintenance": (1, 600.0, False),
    "fetch": (3, 60.0, False),
}
QUEUE_NAMES: tuple[str, ...] = tuple(QUEUES)

for _name, (_workers, _limit_s, _awaited) in QUEUES.items():
    app.queue(_name, max_workers=_workers, time_limit_s=_limit_s, awaited=_awaited)


@app.startup_check
def webhook_timings_nest(settings: Any) -> None:
    """HTTP timeout < webhook job limit < endpoint lease: a slow endpoint gives a clear
    timeout, not a killed job, and a dead worker's lease expires by itself."""
    from actors import settings as app_settings

    mine = app_settings.current()
    webhook_limit = settings.queue("webhook").time_limit_s
    if not mine.webhook_http_timeout_s < webhook_limit < mine.webhook_lease_s:
        raise StartupRefused(
            "refusing to start: webhook timings must be HTTP timeout < job limit < endpoint lease "
            f"(STANDMEET_WEBHOOK_HTTP_TIMEOUT_S={mine.webhook_http_timeout_s:g} < "
            f"STANDMEET_QUEUE_WEBHOOK_TIME_LIMIT_S={webhook_limit:g} < STANDMEET_WEBHOOK_LEASE_S="
            f"{mine.webhook_lease_s:g}), so a slow endpoint times out before its job is killed "
            "and a dead worker's lease expires by itself"
        )
