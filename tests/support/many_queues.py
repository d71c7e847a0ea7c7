"""An application module of its own, with eight queues and no ``import actors``."""

from __future__ import annotations

import os

import dramatiq

import broker
from broker.pg import db

broker.configure()

QUEUES = [f"own-queue-{i}" for i in range(8)]


def _make(queue: str) -> dramatiq.Actor:
    def record(label: str) -> None:
        with db.connection() as conn:
            conn.execute("INSERT INTO test_runs (actor, queue, label, pid, finished_at)"
                         " VALUES ('own', %s, %s, %s, clock_timestamp())", (queue, label, os.getpid()))

    return dramatiq.actor(record, actor_name=f"own.record.{queue}", queue_name=queue, max_retries=0)


ACTORS = {queue: _make(queue) for queue in QUEUES}
