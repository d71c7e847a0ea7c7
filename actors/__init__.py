"""Domain actors.

Our entry points configure the broker where the process starts (``broker.boot``) and
then import this package. Dramatiq's own CLI calls nothing of ours first, so when
nothing has configured a broker yet, importing this package does (``broker.configure()``):
``dramatiq actors`` consumes every queue, ``dramatiq actors --queues index`` one, and a
module that imports ``actors`` and declares its own actors on our queues runs under
``dramatiq thatmodule`` with all our middleware. Under the memory broker
(``broker.testing.memory_broker()`` first), the actors are declared on it.

Actors start no threads: background work is a job, or a periodic job.
"""

from __future__ import annotations

from actors import queues  # noqa: F401  (declares the queues before any actor names one)
from actors import settings as _settings
from broker import app as _app
from broker import configure, services

# The application's tables: its own migrations, applied by `standmeet-jobs migrate` after the runtime's.
_app.migrations(package="actors", folder="migrations")

if services.installed() is None:  # Dramatiq's CLI, or a module importing this package: no boot ran
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
