"""The many-hosts test's application (``standmeet-jobs run tests.support.hostjobs`` on each host).

A module of its own (no ``import actors``): four queues, a keyed-lease actor and one
periodic job, declared through ``broker.app`` as any application would.

Every run appends two lines (``start``, then ``end`` with its outcome) to a file of its
process, ``$HOSTJOBS_DIR/<hostname>-<pid>.jsonl``: the message, its claim number, the
queue, the lease key, the host, pid and worker id, and the time by the machine's
monotonic clock (one kernel for every "host": their runs compare directly; a host whose
wall clock is shifted keeps the true monotonic clock) and by the process's wall clock.
A file, not the database: a partitioned host cannot write to the database, and what it
ran while cut off is precisely what the test must see. A run that never wrote its
``end`` line was cut off with its process (SIGKILL).

Only the periodic job also writes a row (``test_runs``), so that its runs are counted
by the database's clock.

This module is imported by the hosts' processes only: importing it configures a broker
from the environment (``DATABASE_URL``), which the test process must not do.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import dramatiq

import broker
from broker import app
from broker.pg import db
from middleware.keyed_lease import Lease, lease_of

#: Queues and their limits per process (the test asserts the limits from the runs).
SHORT_QUEUE, LONG_QUEUE, KEYED_QUEUE, TICK_QUEUE = "hosts", "hostlong", "hostkeyed", "hosttick"
LIMITS = {SHORT_QUEUE: 4, LONG_QUEUE: 3, KEYED_QUEUE: 2, TICK_QUEUE: 1}
#: The keyed job's hard limit, and its lease (which outlives the limit, as the webhook
#: endpoint's does): HOSTJOBS_KEYED_LIMIT_S / HOSTJOBS_LEASE_S.
KEYED_LIMIT_S = float(os.environ.get("HOSTJOBS_KEYED_LIMIT_S") or 5.0)
LEASE_S = float(os.environ.get("HOSTJOBS_LEASE_S") or 8.0)
BUSY_SNOOZE_S = 0.3
#: The periodic job's interval (HOSTJOBS_TICK_S).
TICK_S = float(os.environ.get("HOSTJOBS_TICK_S") or 4.0)

app.queue(SHORT_QUEUE, max_workers=LIMITS[SHORT_QUEUE], time_limit_s=30)
app.queue(LONG_QUEUE, max_workers=LIMITS[LONG_QUEUE], time_limit_s=120)
app.queue(KEYED_QUEUE, max_workers=LIMITS[KEYED_QUEUE], time_limit_s=KEYED_LIMIT_S)
app.queue(TICK_QUEUE, max_workers=LIMITS[TICK_QUEUE], time_limit_s=30)
app.periodic("hosts-tick", "hosts.tick", interval_s=TICK_S)
broker.configure()

#: The keyed lease, on a table the test makes (``host_leases``: one row per key, a token
#: and an expiry by the database's clock).
TAKE = """
INSERT INTO host_leases AS l (key, token, busy_until)
VALUES (%(key)s, gen_random_uuid(), now() + make_interval(secs => %(lease_s)s))
ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, busy_until = EXCLUDED.busy_until
WHERE l.busy_until IS NULL OR l.busy_until <= now()
RETURNING token::text
"""
RELEASE = """
UPDATE host_leases SET token = NULL, busy_until = NULL WHERE key = %(key)s AND token = %(token)s::uuid
"""

_lock = threading.Lock()
_fd: int | None = None


def _write(record: dict[str, Any]) -> None:
    """One line, one write(2) on an O_APPEND descriptor: whole lines, whatever the thread."""
    global _fd
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    with _lock:
        if _fd is None:
            folder = os.environ.get("HOSTJOBS_DIR") or "."
            path = os.path.join(folder, f"{socket.gethostname()}-{os.getpid()}.jsonl")
            _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(_fd, line)


def _current() -> Any:
    from dramatiq.middleware import CurrentMessage

    return CurrentMessage.get_current_message()


def observed(fn: Callable[..., None]) -> Callable[..., None]:
    """Record the run's start and its end (``ok`` or the exception's type) around ``fn``."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        from broker.engine.queues import claim_of
        from broker.services import current_broker

        message = _current()
        held = lease_of(message) if message is not None else None
        base = {
            "run": uuid.uuid4().hex,
            "m": message.message_id if message is not None else None,
            "claim": claim_of(message) if message is not None else None,
            "q": message.queue_name if message is not None else None,
            "key": str(held.key) if held is not None else None,
            "token": held.token if held is not None else None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "worker": current_broker().worker_id,
        }
        _write({**base, "ev": "start", "mono": time.monotonic(), "wall": time.time()})
        outcome = "ok"
        try:
            fn(*args, **kwargs)
        except BaseException as exc:
            outcome = type(exc).__name__
            raise
        finally:
            _write({**base, "ev": "end", "mono": time.monotonic(), "wall": time.time(), "outcome": outcome})

    return run


def cooperative_sleep(seconds: float) -> None:
    """Sleep in small steps, so an asynchronous exception (time limit, step-down) lands."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.02, max(0.0, end - time.monotonic())))


@dramatiq.actor(actor_name="hosts.short", queue_name=SHORT_QUEUE, max_retries=5)
@observed
def short(ms: float = 5.0) -> None:
    cooperative_sleep(ms / 1000)


@dramatiq.actor(actor_name="hosts.long", queue_name=LONG_QUEUE)
@observed
def long_job(seconds: float, again_s: float) -> None:
    """``seconds`` on its first claim; ``again_s`` when it runs again (rescued, retried)."""
    message = _current()
    from broker.engine.queues import claim_of

    cooperative_sleep(seconds if message is None or claim_of(message) in (None, 1) else again_s)


def _key_of(message: Any) -> str | None:
    return str(message.kwargs.get("key") or (message.args[0] if message.args else "")) or None


KEY_LEASE = Lease(key=_key_of, take=TAKE, release=RELEASE, lease_s=lambda: LEASE_S,
                  busy_snooze_s=lambda: BUSY_SNOOZE_S)


@dramatiq.actor(actor_name="hosts.keyed", queue_name=KEYED_QUEUE, lease=KEY_LEASE)
@observed
def keyed(key: str, seconds: float) -> None:
    """At most one in flight per key, across hosts (the keyed lease)."""
    cooperative_sleep(seconds)


@dramatiq.actor(actor_name="hosts.tick", queue_name=TICK_QUEUE, max_retries=0)
@observed
def tick() -> None:
    """The periodic job: one row per run, stamped by the database's clock."""
    message = _current()
    with db.connection() as conn:
        conn.execute("INSERT INTO test_runs (actor, queue, label, pid, message_id, finished_at)"
                     " VALUES ('hosts.tick', %s, %s, %s, %s, clock_timestamp())",
                     (TICK_QUEUE, socket.gethostname(), os.getpid(),
                      message.message_id if message is not None else None))
