"""``async def`` actors, declared as an application would: no middleware added by hand.

Each writes what it saw into the test database (``test_runs``, ``test_counters``), so the
tests assert from rows what the coroutines did.
"""

from __future__ import annotations

import asyncio
import os

import dramatiq
import httpx

from broker import app, deadline
from broker.pg import db
from middleware import Lease, Snooze
from tests.support.jobs import bump, record_finish, record_start  # noqa: F401  (declares the test actors)

QUEUE = "asyncq"
app.queue(QUEUE, max_workers=2, time_limit_s=5)

LEASES = """
CREATE TABLE IF NOT EXISTS async_leases (key text PRIMARY KEY, token uuid, busy_until timestamptz)
"""
TAKE = """
INSERT INTO async_leases AS l (key, token, busy_until)
VALUES (%(key)s, gen_random_uuid(), now() + make_interval(secs => %(lease_s)s))
ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, busy_until = EXCLUDED.busy_until
WHERE l.busy_until IS NULL OR l.busy_until <= now()
RETURNING token::text
"""
RELEASE = "UPDATE async_leases SET token = NULL, busy_until = NULL WHERE key = %(key)s AND token = %(token)s::uuid"
SEEN = "INSERT INTO test_counters (key, value) VALUES (%(key)s, %(value)s) ON CONFLICT (key) DO UPDATE SET value = %(value)s"


def _seen(key: str, value: int) -> None:
    with db.connection() as conn:
        conn.execute(SEEN, {"key": key, "value": value})


@dramatiq.actor(actor_name="async.sleep", queue_name=QUEUE, max_retries=0)
async def sleep(label: str, ms: int) -> None:
    """Awaits ``ms``; its run is a row with a start and a finish."""
    run = record_start("async.sleep", QUEUE, label)
    await asyncio.sleep(ms / 1000)
    record_finish(run)


@dramatiq.actor(actor_name="async.overrun", queue_name=QUEUE, max_retries=0, time_limit=300)
async def overrun(label: str) -> None:
    """Awaits far past its 300 ms limit; says in a row whether the coroutine was cancelled."""
    run = record_start("async.overrun", QUEUE, label)
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        # Its deadline is past (that is why it is cancelled): the record that it saw the
        # cancellation is written without it, in this coroutine's own context.
        deadline.clear()
        bump(f"{label}:cancelled")
        raise
    record_finish(run)


@dramatiq.actor(actor_name="async.snooze_once", queue_name=QUEUE, max_retries=0)
async def snooze_once(key: str) -> None:
    """Snoozes on its first run, succeeds on the next."""
    run = record_start("async.snooze_once", QUEUE, key)
    if bump(key) == 1:
        raise Snooze(0.05, reason=f"{key} not ready")
    record_finish(run)


def _key_of(message: dramatiq.Message) -> str | None:
    return str(message.args[0]) if message.args else None


@dramatiq.actor(actor_name="async.keyed", queue_name=QUEUE, max_retries=0,
                lease=Lease(key=_key_of, take=TAKE, release=RELEASE, lease_s=lambda: 10.0,
                            busy_snooze_s=lambda: 0.05))
async def keyed(key: str, label: str, ms: int) -> None:
    """At most one in flight per key."""
    run = record_start("async.keyed", QUEUE, label)
    await asyncio.sleep(ms / 1000)
    record_finish(run)


@dramatiq.actor(actor_name="async.add", queue_name=QUEUE, store_results=True, max_retries=0)
async def add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@dramatiq.actor(actor_name="async.deadline", queue_name=QUEUE, max_retries=0, time_limit=2_000)
async def sees_deadline(key: str, url: str) -> None:
    """Records the deadline its coroutine sees, and the HTTP timeout capped to it."""
    left = deadline.remaining_s()
    _seen(f"{key}:left_ms", -1 if left is None else int(left * 1000))
    async with httpx.AsyncClient() as client:
        response = await client.get(url, timeout=deadline.cap_timeout(60.0))
    _seen(f"{key}:status", response.status_code)
    _seen(f"{key}:timeout_ms", int(deadline.cap_timeout(60.0) * 1000))
    async with db.aconnection() as conn:
        cursor = await conn.execute("SELECT setting::int FROM pg_settings WHERE name = 'statement_timeout'")
        row = await cursor.fetchone()
    _seen(f"{key}:statement_timeout_ms", row[0] if row else -1)


@dramatiq.actor(actor_name="async.slow_query", queue_name=QUEUE, max_retries=0, time_limit=60_000)
async def slow_query(key: str) -> None:
    """A statement longer than its 300 ms budget, which only statement_timeout stops."""
    run = record_start("async.slow_query", QUEUE, key)
    try:
        async with db.aconnection(timeout_s=0.3) as conn:
            await conn.execute("SELECT pg_sleep(30)")
    except Exception as exc:
        bump(f"{key}:{type(exc).__name__}")
        raise
    record_finish(run)


@dramatiq.actor(actor_name="async.until_cancelled", queue_name=QUEUE, max_retries=0, time_limit=20_000)
async def until_cancelled(key: str) -> None:
    """Checks between steps, as long async jobs do, until an operator cancels it."""
    run = record_start("async.until_cancelled", QUEUE, key)
    for _ in range(1000):
        deadline.check()
        await asyncio.sleep(0.02)
    record_finish(run)


__all__ = ["LEASES", "QUEUE", "add", "keyed", "os", "overrun", "sees_deadline", "sleep", "snooze_once",
           "until_cancelled"]
