"""Domain actors. Importing this package configures the broker.

So ``dramatiq actors`` consumes every queue, ``dramatiq actors --queues index`` one,
and a module that imports ``actors`` and declares its own actors on our queues runs
under ``dramatiq thatmodule`` with all our middleware.

Actors start no threads: background work is a job, or a periodic job.
"""

from __future__ import annotations

from actors import queues  # noqa: F401  (declares the queues before any actor names one)
from actors import settings as _settings
from broker import configure

configure()
# The application's settings, checked as the process starts: a malformed or out-of-range
# value refuses it here, in one line naming the variable (not later, in a worker's boot).
_settings.current()

from actors import (  # noqa: E402  (declared once the broker exists)
    cli,
    corpus,
    documents,
    jobboards,
    mail,
    routes,
    suppliers,
    webhook_pages,
    webhooks,
)

__all__ = ["cli", "corpus", "documents", "jobboards", "mail", "routes", "suppliers", "webhook_pages", "webhooks"]
