"""Another application beside ``actors``, loaded by processes of their own: the ``reports``
queue, its actor and its topic, declared through the same registration API and with no
``import actors`` (``python -m broker.worker tests.support.reports``).

Events of ``report.requested`` run ``reports.record`` (one row in ``test_runs`` per run,
with the event's label), so a test sees which process ran each event's job, and how often.
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq

import broker
from broker import app
from broker.engine.broker import StandmeetBroker
from broker.outbox import route
from broker.pg import db

QUEUE = "reports"
TOPIC = "report.requested"

app.queue(QUEUE, max_workers=4, time_limit_s=30)
if not isinstance(dramatiq.broker.global_broker, StandmeetBroker):
    broker.configure()

RECORD = """
INSERT INTO test_runs (actor, queue, label, pid, message_id, finished_at)
VALUES ('reports.record', %(queue)s, %(label)s, %(pid)s, %(message_id)s, clock_timestamp())
"""


@dramatiq.actor(actor_name="reports.record", queue_name=QUEUE, max_retries=0)
def record(label: str) -> None:
    from dramatiq.middleware import CurrentMessage

    message = CurrentMessage.get_current_message()
    with db.connection() as conn:
        conn.execute(RECORD, {"queue": QUEUE, "label": label, "pid": os.getpid(),
                              "message_id": message.message_id if message is not None else None})


def _label(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (str(payload["label"]),), {}


route(TOPIC, "reports.record", _label)
