"""Webhooks: endpoints, fan-out, and signed delivery, one at a time per endpoint.

An event is stored (``standmeet.webhook_events``) and emitted through the outbox;
``webhook.fanout`` makes one delivery per enabled endpoint subscribed to its type (a
disabled one gets a *skipped* delivery, replayable later) and a ``webhook.deliver``
job for each, whose message id the delivery records. The endpoint lease is taken and released around ``webhook.deliver`` by
the keyed-lease middleware (``middleware/keyed_lease.py``), as this module's
``ENDPOINT_LEASE`` declares; the actor only reads (connection returned), POSTs
holding no connection, and records.

Deliveries are signed per the Standard Webhooks specification (``webhook-id``,
``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256 of
id.timestamp.body>``) with every active secret, with a fresh timestamp per attempt.
Only 2xx is success. Retries follow :data:`SCHEDULE` with jitter, honouring
``Retry-After`` within bounds; 410 disables the endpoint.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import math
import random
import secrets as secrets_module
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import dramatiq
import httpx
import psycopg
from dramatiq.errors import Retry
from dramatiq.middleware import CurrentMessage
from dramatiq.middleware.time_limit import TimeLimitExceeded

from actors import secretbox
from actors import settings as app_settings
from actors.http import guarded_request, request_budget
from actors.netguard import UrlRefused, UrlUnresolved, check_url
from actors.reasons import MAX_REASON
from actors.webhook_views import PING_MOST
from broker import app, deadline
from broker.engine.enqueue import (
    FINISH_ONE_QUEUED,
    RECEIPT_OF_FINISHED,
    build_message,
    enqueue_messages,
    finish_one_params,
)
from broker.errors import DeadlineExceeded, StandmeetError
from broker.outbox import check_payload, emit
from broker.pg import db
from middleware.keyed_lease import Lease, given_back, lease_of, read_without_lease
from middleware.snooze import LEASE_BUSY, Snooze

logger = logging.getLogger(f"standmeet.{__name__}")

#: Delay before each retry, in seconds (then the delivery fails): 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h.
SCHEDULE = (5, 300, 1800, 7200, 18000, 36000, 36000)
#: A Retry-After is honoured between these bounds (seconds).
RETRY_AFTER_BOUNDS = (1, 36000)
#: Random bytes in a generated signing secret, and the fewest a given one may hold.
SECRET_BYTES = 32
MIN_SECRET_BYTES = 24
#: Response bodies are kept up to this size.
BODY_CAP = 16 * 1024
#: The POST ends this long before the job's own time limit, so its attempt is recorded.
RECORD_MARGIN_S = 1.0


class WebhookError(StandmeetError):
    """A webhook operation was refused (bad URL, unknown endpoint…)."""


class DeliveryFailed(StandmeetError):
    """A delivery failed for good (blocked by the request-forgery guard, 410 Gone, or
    out of retries): its job ends rejected with this reason, not done."""


# -- signing --------------------------------------------------------------------------


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets_module.token_bytes(SECRET_BYTES)).decode()


def _key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_`` secret. Errors never quote the secret."""
    if not isinstance(secret, str) or not secret.startswith("whsec_"):
        raise WebhookError("a signing secret looks like whsec_<base64>")
    try:
        return base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except ValueError:
        raise WebhookError("a signing secret looks like whsec_<base64>") from None


def check_new_secret(secret: str) -> None:
    """Refuse a secret to be stored that is malformed or under MIN_SECRET_BYTES bytes.
    (Secrets stored before the minimum existed still sign: refusing them at delivery
    would stop an endpoint without its owner knowing.)"""
    key = _key(secret)
    if len(key) < MIN_SECRET_BYTES:
        raise WebhookError(f"a signing secret must hold at least {MIN_SECRET_BYTES} random bytes "
                           f"(this one holds {len(key)}); omit it to have one generated")


def open_secrets(stored: list[str]) -> list[str]:
    """The signing secrets of an endpoint, decrypted."""
    return [secretbox.unseal(s) for s in stored]


def sign(secrets: list[str], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: one ``v1,<sig>`` per active secret."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(_key(s), signed, hashlib.sha256).digest()).decode() for s in secrets
    )


# -- the operator's API -----------------------------------------------------------------

ADD_ENDPOINT = "INSERT INTO standmeet.webhook_endpoints (url, event_types, secrets) VALUES (%s, %s, %s) RETURNING id"
ROTATE_SECRET = """
UPDATE standmeet.webhook_endpoints SET secrets = CASE WHEN %s THEN secrets || %s::text ELSE ARRAY[%s::text] END
WHERE id = %s RETURNING id
"""


def add_endpoint(url: str, event_types: list[str], *, secret: str | None = None) -> tuple[int, str]:
    """Register an endpoint; returns (id, secret). A refused URL raises UrlRefused."""
    check_url(url, allowed_networks=app_settings.current().allowed_networks)
    secret = secret or new_secret()
    check_new_secret(secret)
    if not event_types:
        raise WebhookError("an endpoint needs at least one event type (or '*')")
    sealed = secretbox.seal(secret)
    with db.connection() as conn:
        row = conn.execute(ADD_ENDPOINT, (url, event_types, [sealed])).fetchone()
    assert row is not None
    return int(row[0]), secret


#: Turn an endpoint on (its failure streak and disabled reason forgotten) or off (with the reason).
SET_ENABLED = """
UPDATE standmeet.webhook_endpoints
SET enabled = %(enabled)s,
    disabled_reason = CASE WHEN %(enabled)s THEN NULL ELSE %(reason)s END,
    failing_since = CASE WHEN %(enabled)s THEN NULL ELSE failing_since END
WHERE id = %(id)s
RETURNING id
"""


def set_enabled_in(conn: psycopg.Connection[Any], endpoint_id: int, enabled: bool, *,
                   reason: str | None = None) -> bool:
    """Enable or disable an endpoint in the caller's connection; False when there is no such endpoint."""
    row = conn.execute(SET_ENABLED, {"id": endpoint_id, "enabled": enabled,
                                     "reason": reason or "disabled by an operator"}).fetchone()
    return row is not None


def set_enabled(endpoint_id: int, enabled: bool, reason: str | None = None) -> None:
    """Enable or disable an endpoint; a WebhookError when there is no such endpoint."""
    with db.connection() as conn:
        found = set_enabled_in(conn, endpoint_id, enabled, reason=reason)
    if not found:
        raise WebhookError(f"no webhook endpoint {endpoint_id}")


def rotate_secret(endpoint_id: int, new: str | None = None, *, keep_old: bool = True) -> str:
    """Add a secret (both sign during the rotation); drop the old ones with keep_old=False."""
    new = new or new_secret()
    check_new_secret(new)
    sealed = secretbox.seal(new)
    with db.connection() as conn:
        found = conn.execute(ROTATE_SECRET, (keep_old, sealed, sealed, endpoint_id)).fetchone()
    if found is None:
        raise WebhookError(f"no webhook endpoint {endpoint_id}")
    return new


STORE_EVENT = "INSERT INTO standmeet.webhook_events (type, payload) VALUES (%s, %s::jsonb) RETURNING id"


def emit_event(conn: psycopg.Connection[Any], event_type: str, payload: dict[str, Any]) -> int:
    """Store an event and emit it through the outbox, in the caller's transaction.

    A payload jsonb would refuse (NaN, an infinity, ``\\u0000``, a lone surrogate, a
    value that is not JSON) raises :class:`broker.outbox.InvalidPayload` before any
    statement runs, so the caller's transaction is left as it was and can still commit.
    """
    check_payload(event_type, payload)
    row = conn.execute(STORE_EVENT, (event_type, json.dumps(payload, allow_nan=False))).fetchone()
    assert row is not None
    emit(conn, "webhook.event", {"event_id": int(row[0])})
    return int(row[0])


def ping(endpoint_id: int, count: int = 1) -> list[int]:
    """Emit ``count`` webhook.ping events for one endpoint (outbox → fanout → deliver)."""
    if not 1 <= count <= PING_MOST:
        raise WebhookError(f"a ping is 1 to {PING_MOST} events, not {count}")
    with db.connection() as conn, conn.transaction():
        if conn.execute("SELECT 1 FROM standmeet.webhook_endpoints WHERE id = %s", (endpoint_id,)).fetchone() is None:
            raise WebhookError(f"no webhook endpoint {endpoint_id}")
        return [emit_event(conn, "webhook.ping", {"endpoint_id": endpoint_id, "n": n}) for n in range(1, count + 1)]


#: A delivery back to pending, due now (its retry schedule's next attempt forgotten).
MAKE_PENDING = """
UPDATE standmeet.webhook_deliveries SET state = 'pending', next_attempt_at = NULL, updated_at = now()
WHERE id = %s RETURNING id
"""


def replay_in(conn: psycopg.Connection[Any], delivery_id: int) -> str | None:
    """Deliver ``delivery_id`` again, in the caller's transaction: what a replay means,
    from the command line (``webhooks replay``) and the dashboard's button alike.

    The delivery, whatever its state, goes back to *pending* and due now, and a **new**
    ``webhook.deliver`` message is enqueued for it (recorded on the delivery); its
    attempts so far are kept and counted on. A message of the delivery still queued or
    running is left as it is: the endpoint's lease lets one job at a time deliver, and a
    job that finds the delivery made ends without posting. Returns the new message's
    id; None when there is no such delivery (nothing is written)."""
    if conn.execute(MAKE_PENDING, (delivery_id,)).fetchone() is None:
        return None
    return enqueue_deliveries(conn, [delivery_id])[0]


def replay(delivery_id: int) -> str:
    """:func:`replay_in` in a transaction of its own; a WebhookError when there is no such delivery."""
    with db.connection() as conn, conn.transaction():
        message_id = replay_in(conn, delivery_id)
    if message_id is None:
        raise WebhookError(f"no webhook delivery {delivery_id}")
    return message_id


#: One batch of the deliveries that failed (or were skipped) since a time, back to pending.
MAKE_FAILED_PENDING = """
UPDATE standmeet.webhook_deliveries SET state = 'pending', next_attempt_at = NULL, updated_at = now()
WHERE id IN (SELECT id FROM standmeet.webhook_deliveries
             WHERE state IN ('failed', 'skipped') AND updated_at >= %(since)s
             ORDER BY id LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
RETURNING id
"""
#: How many deliveries one transaction of :func:`replay_failed` replays.
REPLAY_BATCH = 2_000


def replay_failed(since: datetime, *, batch: int = REPLAY_BATCH) -> int:
    """Deliver again every delivery that failed (or was skipped) since ``since``, ``batch``
    at a time, each batch in a transaction of its own (made pending and given a new
    message together): a million failures are never held in memory at once, and what a
    failure midway leaves is still failed, to replay again."""
    total = 0
    while True:
        with db.connection() as conn, conn.transaction():
            ids = [int(r[0]) for r in conn.execute(MAKE_FAILED_PENDING, {"since": since, "batch": batch})]
            enqueue_deliveries(conn, ids)
        total += len(ids)
        if len(ids) < batch:
            return total


#: Each delivery names the message that carries it: a job that makes the delivery as part
#: of its endpoint's batch marks that message done while it is still queued.
NAME_DELIVERY_MESSAGES = """
UPDATE standmeet.webhook_deliveries d SET message_id = m.message_id
FROM unnest(%(ids)s::bigint[], %(messages)b::uuid[]) AS m(id, message_id) WHERE d.id = m.id
"""


def enqueue_deliveries(conn: psycopg.Connection[Any], delivery_ids: list[int], *,
                       named: list[str] | None = None) -> list[str]:
    """A ``webhook.deliver`` message for each delivery, in the caller's transaction, each
    recorded on its delivery; their ids, in the same order. ``named``: the ids the
    deliveries were written with (the fan-out's), which the messages take; a delivery is
    written again only where its message came out with another id (an enqueue hook's)."""
    if not delivery_ids:
        return []
    built = [build_message("webhook.deliver", (delivery_id,)) for delivery_id in delivery_ids]
    if named is not None:
        built = [message.copy(message_id=message_id) for message, message_id in zip(built, named, strict=True)]
    message_ids = [m.message_id for m in enqueue_messages(conn, built)]
    written_with: list[str | None] = list(named) if named is not None else [None] * len(delivery_ids)
    renamed = [(d, m) for d, m, was in zip(delivery_ids, message_ids, written_with, strict=True) if m != was]
    if renamed:
        conn.execute(NAME_DELIVERY_MESSAGES, {"ids": [d for d, _ in renamed], "messages": [m for _, m in renamed]})
    return message_ids


# -- fan-out ------------------------------------------------------------------------------

FANOUT = """
WITH event AS (SELECT id, type FROM standmeet.webhook_events WHERE id = %(event)s),
targets AS (
    SELECT e.id AS endpoint_id, e.enabled FROM standmeet.webhook_endpoints e, event
    WHERE CASE WHEN event.type = 'webhook.ping' THEN e.id = %(ping_endpoint)s  -- a ping: its endpoint only
               ELSE e.event_types @> ARRAY[event.type] OR e.event_types @> ARRAY['*'] END
)
INSERT INTO standmeet.webhook_deliveries (event_id, endpoint_id, state, message_id)
SELECT %(event)s, endpoint_id, CASE WHEN enabled THEN 'pending' ELSE 'skipped' END,
       CASE WHEN enabled THEN gen_random_uuid() END
FROM targets
ON CONFLICT (event_id, endpoint_id) DO NOTHING
RETURNING id, state, message_id::text
"""
#: A delivery's message row ``q``, read by its id (the primary key), is still queued.
#: Written so that no plan reads the queue's claim index for it (partial, on the queued
#: rows): the queue's statistics lag a burst (a few queued rows counted where thousands
#: are), and the planner then took that index for each lookup, reading every queued
#: message once per delivery (~250 rows a delivery in a fan-out of 150 events).
_STILL_QUEUED = "q.\"state\"::text = 'queued'"
#: A delivery's message row ``q`` is queued or running: as :data:`_STILL_QUEUED`, read by id.
_QUEUED_OR_RUNNING = "q.\"state\"::text IN ('queued', 'consumed')"
#: The messages of new deliveries (``%(ids)s``, just committed, due now) that are still
#: queued, locked first: the statements below never wait for a lock (``NOWAIT``: a
#: conflict ends the attempt, and those messages simply stay due), so parking takes part
#: in no deadlock.
#: (The deliveries are read by id alone, then filtered: with their state in the same
#: scan, the planner could read the whole never-attempted index instead, as above.)
PARK_LOCK_MESSAGES = """
WITH fanned AS MATERIALIZED (
    SELECT message_id, state, attempts FROM standmeet.webhook_deliveries WHERE id = ANY(%(ids)s::bigint[])
)
SELECT q.message_id FROM fanned d JOIN dramatiq.queue q ON q.message_id = d.message_id
WHERE d.state = 'pending' AND d.attempts = 0 AND """ + _STILL_QUEUED + """
FOR UPDATE OF q NOWAIT
"""
#: The job of the waiting delivery ``w`` is live: its message queued or running, not
#: cancelled. A batch makes only such deliveries: one whose job an operator cancelled (to
#: stop the traffic) or that was rejected for good (it crashed its worker) is not posted
#: by another job's batch; it waits, pending, for the pass that fails abandoned deliveries
#: (and an operator's replay).
_JOB_LIVE = """EXISTS (SELECT FROM dramatiq.queue j WHERE j.message_id = w.message_id
                      AND j."state"::text IN ('queued', 'consumed') AND j.cancelled_at IS NULL)"""
#: When the waiting delivery ``w`` is due: its retry, or now for one never attempted or
#: replayed. The expression ``webhook_deliveries_retry_due_idx`` holds (written once, so
#: that the statements' conditions and orders match it and the index serves them).
_DUE_AT = "coalesce(w.next_attempt_at, '-infinity'::timestamptz)"
#: The turn of the waiting delivery ``w`` has come: its back-off has elapsed.
_BACKOFF_ELAPSED = _DUE_AT + " <= now()"
#: Of an endpoint's pending deliveries attempted before (retried or replayed) whose
#: back-off has elapsed, the one due the longest first: the order of
#: ``webhook_deliveries_retry_due_idx``, read from its start for the first whose message
#: qualifies (it reads neither the endpoint's delivered history, nor its deliveries still
#: in back-off, nor all those due: an endpoint back from an outage may have thousands).
_LONGEST_DUE_FIRST = "ORDER BY " + _DUE_AT + " LIMIT 1"
#: How many of an endpoint's first waiting deliveries, never attempted and retried, parking
#: looks at for one whose job is due: a few, not every one (an endpoint back from an outage
#: has thousands of retries whose jobs snoozed behind its lease; reading them all for every
#: delivery fanned out took a second). Parking only saves a claim: should those first few
#: not be due, the new deliveries stay due, as before parking.
_FIRST_IN_LINE = "8"
#: The message of one of those (``w``), locked, if it is queued and due: looked up by its
#: id in a subquery of its own, so that no plan scans the queue's due messages first and
#: reads the few again for each (joined plainly, the planner chose that with a small
#: queue's statistics).
_ITS_MESSAGE_IF_DUE = """
    CROSS JOIN LATERAL (SELECT q.message_id FROM dramatiq.queue q
                        WHERE q.message_id = w.message_id AND """ + _STILL_QUEUED + """ AND q.eta <= now()
                        FOR SHARE NOWAIT) q"""
#: Of those, the ones whose endpoint already has a delivery in hand, and until when to
#: park them: its lease is held (until it expires), or an older waiting delivery whose
#: back-off has elapsed has its message queued and due (a lease's length, which that job
#: takes when it runs): never attempted (``webhook_deliveries_due_idx``), or retried or
#: replayed (``webhook_deliveries_retry_due_idx``). The endpoint's row and those
#: messages' are read locked (``FOR SHARE NOWAIT``): a holder giving the lease back locks
#: the endpoint's row first (:data:`LOCK_ENDPOINT`, in its own statement), so it either
#: committed before (its outcome read here) or waits for this transaction and then, from
#: a snapshot taken after it, wakes the oldest waiter, these parked ones included. A
#: running waiter does not count (it may be ending: nothing would wake these).
PARK_BEHIND = """
SELECT d.message_id, CASE WHEN e.busy_until > now() THEN e.busy_until
                          ELSE now() + make_interval(secs => %(lease_s)s) END
FROM standmeet.webhook_deliveries d
JOIN LATERAL (SELECT id, busy_until FROM standmeet.webhook_endpoints WHERE id = d.endpoint_id
              FOR SHARE NOWAIT) e ON true
LEFT JOIN LATERAL (
    SELECT q.message_id FROM (
        SELECT w.message_id FROM standmeet.webhook_deliveries w
        WHERE w.endpoint_id = d.endpoint_id AND w.state = 'pending' AND w.attempts = 0
          AND w.id <> ALL(%(ids)s::bigint[])
        ORDER BY w.id LIMIT """ + _FIRST_IN_LINE + """) w
""" + _ITS_MESSAGE_IF_DUE + """
    LIMIT 1) waiter ON true
LEFT JOIN LATERAL (
    SELECT q.message_id FROM (
        SELECT w.message_id FROM standmeet.webhook_deliveries w
        WHERE w.endpoint_id = d.endpoint_id AND w.state = 'pending' AND w.attempts > 0 AND """ + _BACKOFF_ELAPSED + """
        ORDER BY """ + _DUE_AT + """ LIMIT """ + _FIRST_IN_LINE + """) w
""" + _ITS_MESSAGE_IF_DUE + """
    LIMIT 1) retried ON true
WHERE d.id = ANY(%(ids)s::bigint[]) AND d.message_id = ANY(%(locked)s::uuid[])
  AND (e.busy_until > now() OR waiter.message_id IS NOT NULL OR retried.message_id IS NOT NULL)
"""
PARK = """
UPDATE dramatiq.queue q SET eta = p.until, mtime = now()
FROM unnest(%(messages)s::uuid[], %(until)s::timestamptz[]) AS p(message_id, until)
WHERE q.message_id = p.message_id AND """ + _STILL_QUEUED + """
"""


@dramatiq.actor(actor_name="webhook.fanout", queue_name="webhook", time_limit=30_000)
def fanout(event_id: int) -> None:
    """One delivery per subscribed endpoint; a deliver job for each enabled one (written
    with the deliveries, in one transaction); then those behind a delivery in hand parked."""
    with db.connection() as conn, conn.transaction():
        event = conn.execute("SELECT type, payload FROM standmeet.webhook_events WHERE id = %s", (event_id,)).fetchone()
        if event is None:
            logger.warning("webhook event %s no longer exists", event_id)
            return
        ping_endpoint = (event[1] or {}).get("endpoint_id") if event[0] == "webhook.ping" else None
        rows = conn.execute(FANOUT, {"event": event_id, "ping_endpoint": ping_endpoint}).fetchall()
        # every deliver job in one statement, in the same transaction as the deliveries,
        # with the message id each delivery was written with (not written a second time)
        pending = [(int(delivery_id), message_id) for delivery_id, state, message_id in rows if state == "pending"]
        enqueue_deliveries(conn, [d for d, _ in pending], named=[m for _, m in pending])
    if pending:
        park_behind([d for d, _ in pending])


def park_behind(delivery_ids: list[int]) -> int:
    """Park the due messages of ``delivery_ids`` whose endpoint already has a delivery in
    hand until that lease would expire (:data:`PARK_BEHIND`): the holder's batch makes
    them (marking their messages done), or its release wakes the oldest, so they are not
    claimed only to find the endpoint busy; should that chain break (a holder's crash, an
    operator's cancel), they run when the lease has expired, as a job that found it busy
    would. After the deliveries' commit, so a release never misses them. Best effort: on
    a lock held elsewhere they stay due. Returns how many were parked."""
    try:
        with db.connection() as conn, conn.transaction():
            locked = [m for (m,) in conn.execute(PARK_LOCK_MESSAGES, {"ids": delivery_ids}).fetchall()]
            if not locked:
                return 0
            parked = conn.execute(PARK_BEHIND, {"ids": delivery_ids, "locked": locked,
                                                "lease_s": app_settings.current().webhook_lease_s}).fetchall()
            if parked:
                conn.execute(PARK, {"messages": [m for m, _ in parked], "until": [u for _, u in parked]})
            return len(parked)
    except psycopg.errors.LockNotAvailable:
        return 0  # a lease given back or a message claimed this moment: they stay due


# -- delivery -----------------------------------------------------------------------------

READ = """
SELECT d.state, d.attempts, e.id, e.url, e.secrets, e.enabled, ev.id, ev.type, ev.payload, ev.created_at
FROM standmeet.webhook_deliveries d
JOIN standmeet.webhook_endpoints e ON e.id = d.endpoint_id
JOIN standmeet.webhook_events ev ON ev.id = d.event_id
WHERE d.id = %s
"""
#: The endpoint's next waiting delivery whose turn has come is woken when its lease is
#: given back: of its pending deliveries whose back-off has elapsed (:data:`_BACKOFF_ELAPSED`),
#: never attempted (``webhook_deliveries_due_idx``) or attempted before, retried or
#: replayed (``webhook_deliveries_retry_due_idx``, the one due the longest), the older of
#: the two whose message is queued or running (not the one just made, ``%(made)s``, nor the holder's own, ``%(holder)s``,
#: whose retry must keep its back-off). A delivery still waiting out its back-off is never
#: woken: its message's eta is its retry. Neither index reads the endpoint's delivered
#: history, nor its deliveries still in back-off. A queued one snoozed until later (it
#: found the endpoint busy, or was parked behind it) is made due now; a running one (it
#: may be finding the lease busy this very moment, its snooze not yet written) is marked
#: woken, and its snooze's settle then makes it due at once (``woken_at``). A queued one
#: due already is written too, unchanged (no indexed column changes: Postgres rewrites it
#: in place, HOT): its row stays locked until the release commits, so no claim (``SKIP
#: LOCKED``) takes it before, whose run would find the lease still busy (the release's
#: snapshot, taken earlier, saw it queued) and snooze a whole lease. No wake is lost to
#: either race. Its queue's consumers are told. Only when the lease was ours
#: (``%(token)s``: the statement's snapshot, before its release). Waiters therefore
#: snooze until the lease's expiry (the holder's crash) rather than polling: one of them
#: is woken per release.
_WAKE_NEXT_WAITER = """
UPDATE dramatiq.queue q
SET eta = CASE WHEN q."state" = 'queued' THEN least(q.eta, now()) ELSE q.eta END,
    woken_at = CASE WHEN q."state" = 'consumed' THEN now() ELSE q.woken_at END,
    mtime = CASE WHEN q."state" = 'queued' AND q.eta <= now() THEN q.mtime ELSE now() END
WHERE q.message_id = (
        SELECT waiter.message_id FROM (
            (SELECT w.id, w.message_id FROM standmeet.webhook_deliveries w
             JOIN dramatiq.queue m ON m.message_id = w.message_id AND m."state" IN ('queued', 'consumed')
             WHERE w.endpoint_id = %(endpoint)s AND w.state = 'pending' AND w.attempts = 0
               AND w.id IS DISTINCT FROM %(made)s::bigint AND w.message_id IS DISTINCT FROM %(holder)s::uuid
             ORDER BY w.id LIMIT 1)
            UNION ALL
            (SELECT w.id, w.message_id FROM standmeet.webhook_deliveries w
             JOIN dramatiq.queue m ON m.message_id = w.message_id AND m."state" IN ('queued', 'consumed')
             WHERE w.endpoint_id = %(endpoint)s AND w.state = 'pending' AND w.attempts > 0
               AND """ + _BACKOFF_ELAPSED + """
               AND w.id IS DISTINCT FROM %(made)s::bigint AND w.message_id IS DISTINCT FROM %(holder)s::uuid
             """ + _LONGEST_DUE_FIRST + """)
        ) waiter
        ORDER BY waiter.id LIMIT 1)
  AND q."state" IN ('queued', 'consumed')
  AND EXISTS (SELECT FROM standmeet.webhook_endpoints
              WHERE id = %(endpoint)s AND lease_token = %(token)s::uuid)
RETURNING q.queue_name
"""
#: An attempt and its delivery's new state (the start of both statements below); when the
#: delivery reached its end (not retried later), the message that carries it is done in
#: the same statement if still queued (``%(finish)s``, :data:`FINISH_ONE_QUEUED`: a
#: batch's delivery; the job's own is running): a message is done exactly when its
#: delivery's attempt is recorded, and no consumer claims it meanwhile to find its
#: delivery made. A batch's delivery whose message is running (it found the endpoint busy
#: a moment ago: its snooze is not yet written) is marked woken (``woken_at``): its
#: snooze's settle makes it due at once, and its next run finds the delivery made and
#: ends, rather than a whole lease later. (A delivery an operator replays has a new
#: message of its own, which carries it again.) A batch's delivery that will be retried
#: has its queued message made due at its retry (``%(reschedule)s``): that message was
#: snoozed or parked behind the lease, and nothing else would bring it forward (a retry
#: waited out a lease, ~20 s, instead of its 5 s back-off); a running one is marked woken
#: (its next run snoozes until the retry). Each in one UPDATE for both states, so that a
#: row whose snooze settles while the statement waits for its lock is judged as it is then.
#: The delivery was replayed (it names another message than the one carrying it here:
#: the one read with the batch, or the job's own), and this attempt did not make it: the
#: replay stands (pending, due now, for its own message), whatever this attempt's outcome
#: would have set. An attempt that made it makes it for the replay too: that message then
#: finds the delivery made, and ends. (Judged by the message, not by a time: a host's
#: clock plays no part. A job that runs a delivery replayed before it started, and fails,
#: leaves one more attempt to the replay's job.)
_REPLAYED_MEANWHILE = """(%(state)s::text <> 'succeeded' AND message_id <> %(carrier)s::uuid)"""
#: When a delivery that is retried is tried next: ``%(retry_in_s)s`` after now by the
#: database's clock, the one every statement that reads ``next_attempt_at`` compares it
#: with (a worker host's clock behind the database's retried at once, ahead, too late).
_NEXT = "(now() + %(retry_in_s)s::float8 * interval '1 second')"
_ATTEMPT_AND_DELIVERY = """
WITH attempt AS (
    INSERT INTO standmeet.webhook_attempts
        (delivery_id, attempt, started_at, duration_ms, status_code, outcome, error, response_body, truncated)
    VALUES (%(made)s::bigint, %(attempt)s::int, %(started)s::timestamptz, %(ms)s::int, %(code)s::int,
            %(outcome)s::text, %(error)s::text, %(body)s::text, %(truncated)s::boolean)
), delivery AS (
    UPDATE standmeet.webhook_deliveries
    SET attempts = %(attempt)s::int,
        state = CASE WHEN """ + _REPLAYED_MEANWHILE + """ THEN 'pending' ELSE %(state)s::text END,
        last_outcome = %(outcome)s::text,
        next_attempt_at = CASE WHEN """ + _REPLAYED_MEANWHILE + """ THEN NULL ELSE """ + _NEXT + """ END,
        updated_at = now()
    WHERE id = %(made)s::bigint
), rescheduled AS (
    UPDATE dramatiq.queue q
    SET eta = CASE WHEN q."state" = 'queued' THEN """ + _NEXT + """ ELSE q.eta END,
        woken_at = CASE WHEN q."state" = 'consumed' THEN now() ELSE q.woken_at END, mtime = now()
    WHERE q.message_id = %(reschedule)s::uuid AND q.message_id IS DISTINCT FROM %(holder)s::uuid
      AND """ + _QUEUED_OR_RUNNING + """
), """ + FINISH_ONE_QUEUED
#: The endpoint's health, from the attempt: 410 disables it; a healthy endpoint's row is
#: not rewritten.
_HEALTH = """
    failing_since = CASE WHEN %(healthy)s THEN NULL ELSE coalesce(failing_since, now()) END,
    enabled = enabled AND %(disabled_reason)s::text IS NULL,
    disabled_reason = coalesce(%(disabled_reason)s, disabled_reason)"""
#: An attempt recorded while the lease is kept (one round trip, atomic): the attempt, its
#: delivery's new state and the endpoint's health; without the lease's parts, which a
#: NULL token leaves idle, ~15 % less of the server's CPU than SETTLE_ATTEMPT (~300 µs
#: against ~360 here). Scalar parameters: psycopg dumps a one-element array at ~15 times
#: a value's CPU.
RECORD_ATTEMPT = _ATTEMPT_AND_DELIVERY + """, endpoint AS (
    UPDATE standmeet.webhook_endpoints SET""" + _HEALTH + """
    WHERE id = %(endpoint)s::bigint AND (NOT %(healthy)s OR failing_since IS NOT NULL OR %(disabled_reason)s::text IS NOT NULL)
)""" + RECEIPT_OF_FINISHED
#: Everything that records an attempt, in one statement (one round trip, atomic): as
#: RECORD_ATTEMPT, and, when the token is still ours, the endpoint's lease given back and
#: its next waiter woken.
SETTLE_ATTEMPT = _ATTEMPT_AND_DELIVERY + """, endpoint AS (
    UPDATE standmeet.webhook_endpoints
    SET""" + _HEALTH + """,
        busy_until = CASE WHEN lease_token = %(token)s::uuid THEN NULL ELSE busy_until END,
        lease_token = CASE WHEN lease_token = %(token)s::uuid THEN NULL ELSE lease_token END
    WHERE id = %(endpoint)s::bigint AND (NOT %(healthy)s OR failing_since IS NOT NULL OR %(disabled_reason)s::text IS NOT NULL
                                 OR lease_token = %(token)s::uuid)
), woken AS (""" + _WAKE_NEXT_WAITER + """)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM woken
UNION ALL""" + RECEIPT_OF_FINISHED
SETTLE_DELIVERY = """
UPDATE standmeet.webhook_deliveries
SET attempts = %(attempt)s, state = %(state)s, last_outcome = %(outcome)s,
    next_attempt_at = %(next)s, updated_at = now()
WHERE id = %(delivery)s
"""


@dataclass(frozen=True)
class Outcome:
    outcome: str  # ok | http | redirect | timeout | connect | dns | tls | protocol | blocked | gone | error
    status_code: int | None = None
    error: str | None = None
    body: str | None = None
    truncated: bool = False
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def _classify(exc: httpx.HTTPError) -> str:
    """The outcome of a request that got no usable response: ``protocol`` when the
    endpoint answered with something that is not well-formed HTTP/1.1 (a malformed
    status line or header, bad framing, a head over its cap), not ``connect``."""
    text = str(exc).lower()
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ProtocolError) and "disconnected" not in text:
        return "protocol"  # a peer that hung up without answering is a connection failure
    if "ssl" in text or "certificate" in text:
        return "tls"
    if "name or service" in text or "nodename" in text or "getaddrinfo" in text:
        return "dns"
    return "connect"


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            from email.utils import parsedate_to_datetime

            seconds = (parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds()
        except (TypeError, ValueError):
            return None
    if math.isnan(seconds):  # "nan" parses, and passes through min and max unclamped
        return None
    return min(max(seconds, RETRY_AFTER_BOUNDS[0]), RETRY_AFTER_BOUNDS[1])


def post(url: str, secrets: list[str], msg_id: str, body: bytes, *, timeout_s: float) -> Outcome:
    """POST once, holding no database connection, within a total deadline of ``timeout_s``
    (shortened to what remains of the job): a watchdog closes the connection when it
    passes, whatever bytes the endpoint trickles."""
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secrets, msg_id, timestamp, body),
    }
    try:  # with the traceparent of its client span: the receiver can join the trace
        response = guarded_request("POST", url, allowed_networks=app_settings.current().allowed_networks,
                                   timeout_s=timeout_s, max_bytes=BODY_CAP, headers=headers, content=body,
                                   propagate_trace=True)
    except UrlUnresolved as exc:  # DNS may answer next time: retried on the schedule
        return Outcome("dns", error=str(exc))
    except UrlRefused as exc:
        return Outcome("blocked", error=str(exc))
    except httpx.HTTPError as exc:
        return Outcome(_classify(exc), error=f"{type(exc).__name__}: {exc}")
    code, text, truncated = response.status_code, response.text, response.truncated
    if 200 <= code < 300:
        return Outcome("ok", code, body=text, truncated=truncated)
    if code == 410:
        return Outcome("gone", code, body=text, truncated=truncated)
    if 300 <= code < 400:
        return Outcome("redirect", code, error="redirects are not followed", body=text, truncated=truncated)
    return Outcome("http", code, body=text, truncated=truncated,
                   retry_after_s=_retry_after(response.headers.get("retry-after")))


#: The endpoint lease: at most one delivery in flight per endpoint, across processes and
#: hosts, by a row lease on the endpoint with a token; it outlives the job's limit.
#: One statement finds the delivery's endpoint, takes its lease, and reads what the POSTs
#: need: the delivery, the endpoint's URL and secrets, the event, how long until the
#: delivery is due (a retry recorded by another job's batch), and the endpoint's next
#: never-attempted pending deliveries (up to 31, oldest first: :data:`BATCH_MAX` in all)
#: with their events. Its rows:
#:   (token, endpoint, state, attempts, url, secrets, event id, type, payload, created_at,
#:    due_in_s, batch ids, batch event ids, types, payloads, created_ats, batch message ids)
#:       the lease is ours;
#:   (NULL, NULL, 'busy', ahead, NULL × 6, busy_for_s, NULL × 6): the endpoint is busy:
#:       the lease expires in busy_for_s, and ``ahead`` never-attempted pending deliveries
#:       of the endpoint are older than this one (counted up to :data:`AHEAD_COUNTED`);
#:       the actor snoozes (:func:`_busy_wait_s`);
#:   (NULL, NULL, state, NULL, …): the delivery is no longer pending, or it or its
#:       endpoint is gone or disabled: no lease is needed (a delivered one must not make
#:       the endpoint's other deliveries snooze). A delivery made already (its state read
#:       here) ends at once; otherwise the actor reads and records why.
#: The deliveries are read with FOR UPDATE: their newest versions, after the lease (whose
#: UPDATE may have waited for the previous holder's record of them) is ours, so a delivery
#: the previous holder just made is never made again from the statement's older snapshot.
TAKE_ENDPOINT = """
WITH target AS (
    SELECT d.endpoint_id FROM standmeet.webhook_deliveries d
    JOIN standmeet.webhook_endpoints e ON e.id = d.endpoint_id
    WHERE d.id = %(key)s AND e.enabled AND d.state = 'pending'
), taken AS (
    UPDATE standmeet.webhook_endpoints
    SET busy_until = now() + make_interval(secs => %(lease_s)s), lease_token = gen_random_uuid()
    WHERE id = (SELECT endpoint_id FROM target) AND enabled AND (busy_until IS NULL OR busy_until < now())
    RETURNING id, lease_token, url, secrets
)
SELECT t.lease_token::text, t.id, d.state, d.attempts, t.url, t.secrets, ev.id, ev.type, ev.payload, ev.created_at,
       extract(epoch FROM d.next_attempt_at - now())::float8,
       b.ids, b.event_ids, b.types, b.payloads, b.created_ats, b.message_ids
FROM taken t
CROSS JOIN LATERAL (SELECT state, attempts, next_attempt_at, event_id FROM standmeet.webhook_deliveries
                    WHERE id = %(key)s AND endpoint_id = t.id FOR UPDATE) d
JOIN standmeet.webhook_events ev ON ev.id = d.event_id
CROSS JOIN LATERAL (
    SELECT array_agg(n.id ORDER BY n.id) AS ids, array_agg(nev.id ORDER BY n.id) AS event_ids,
           array_agg(nev.type ORDER BY n.id) AS types, array_agg(nev.payload ORDER BY n.id) AS payloads,
           array_agg(nev.created_at ORDER BY n.id) AS created_ats,
           array_agg(n.message_id::text ORDER BY n.id) AS message_ids
    FROM (SELECT w.id, w.event_id, w.message_id FROM standmeet.webhook_deliveries w
          WHERE w.endpoint_id = t.id AND w.state = 'pending' AND w.attempts = 0 AND w.id <> %(key)s
            AND """ + _JOB_LIVE + """
          ORDER BY w.id LIMIT 31 FOR UPDATE OF w) n
    JOIN standmeet.webhook_events nev ON nev.id = n.event_id
) b
UNION ALL
SELECT NULL, NULL, 'busy', w.ahead, NULL, NULL, NULL, NULL, NULL, NULL,
       extract(epoch FROM e.busy_until - now())::float8, NULL, NULL, NULL, NULL, NULL, NULL
FROM target JOIN standmeet.webhook_endpoints e ON e.id = target.endpoint_id
CROSS JOIN LATERAL (
    SELECT count(*)::int AS ahead FROM (
        SELECT FROM standmeet.webhook_deliveries a
        WHERE a.endpoint_id = target.endpoint_id AND a.state = 'pending' AND a.attempts = 0 AND a.id < %(key)s
        LIMIT 128) older
) w
WHERE NOT EXISTS (SELECT FROM taken)
UNION ALL
SELECT NULL, NULL, (SELECT d.state FROM standmeet.webhook_deliveries d WHERE d.id = %(key)s),
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT FROM target)
"""
#: Older never-attempted deliveries TAKE_ENDPOINT counts at most (its ``LIMIT``).
AHEAD_COUNTED = 128
#: The lease given back by the middleware (the actor raised before recording), and the
#: endpoint's next waiter woken, as SETTLE_ATTEMPT does.
RELEASE_ENDPOINT = """
WITH released AS (
    UPDATE standmeet.webhook_endpoints SET busy_until = NULL, lease_token = NULL
    WHERE id = %(key)s AND lease_token = %(token)s::uuid
), woken AS (""" + _WAKE_NEXT_WAITER.replace("%(endpoint)s", "%(key)s").replace(
    "%(made)s::bigint", "NULL::bigint").replace("%(holder)s", "%(message_id)s") + """)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM woken
"""


def _delivery_of(message: Any) -> int | None:
    """The lease's key as the message names it: its delivery (TAKE_ENDPOINT resolves it to
    the endpoint); None for a message without one."""
    return int(message.args[0]) if message.args else None


#: Taken first in the transaction of every statement that gives an endpoint's lease back
#: (and so wakes its next waiter): the release's statement then reads a snapshot taken
#: after any parking of the endpoint's jobs committed (:data:`PARK_BEHIND` reads this row
#: locked too, without waiting), so a parked job is never left unwoken. (NO KEY: a
#: fan-out inserting the endpoint's deliveries, whose key it references, is not held up.)
LOCK_ENDPOINT = "SELECT 1 FROM standmeet.webhook_endpoints WHERE id = %(key)s FOR NO KEY UPDATE"

ENDPOINT_LEASE = Lease(
    key=_delivery_of, take=TAKE_ENDPOINT, release=RELEASE_ENDPOINT,
    lease_s=lambda: app_settings.current().webhook_lease_s,
    busy_snooze_s=lambda: app_settings.current().webhook_busy_snooze_s,
    release_lock=LOCK_ENDPOINT,
)


#: Deliveries one job makes while it holds its endpoint's lease: its own first, then the
#: endpoint's next never-attempted pending ones, oldest first (TAKE_ENDPOINT reads up to
#: BATCH_MAX - 1 of them), over one kept-alive connection. Each delivery keeps its own
#: message until its attempt is recorded: then, in the same statement, one still queued is
#: marked done without running (``FINISH_ONE_QUEUED``), and one already claimed finds its
#: delivery made and ends.
BATCH_MAX = 32
#: A message whose delivery another job's batch tried, and scheduled for a retry later
#: than this, snoozes until the retry is due (the retry schedule holds whichever job tried).
DUE_SLACK_S = 1.0


@dataclass(frozen=True)
class _Due:
    """A delivery to make: its id, attempts so far, its event, and (for one of a batch) the
    message that carries it."""

    delivery_id: int
    attempts: int
    event_id: int
    event_type: str
    payload: Any
    created_at: datetime
    message_id: str | None = None


@dataclass(frozen=True)
class _Attempt:
    """An attempt made, as SETTLE_ATTEMPT records it."""

    due: _Due
    started: datetime
    ms: int
    outcome: Outcome
    state: str
    retry_in_s: float | None


#: A delivery failed as abandoned (:data:`FAIL_ABANDONED_RECENT`) whose own job runs again
#: is pending again, due now.
REVIVE_ABANDONED = """
UPDATE standmeet.webhook_deliveries SET state = 'pending', next_attempt_at = NULL, updated_at = now()
WHERE id = %(delivery)s AND state = 'failed' AND last_outcome = %(abandoned)s AND message_id = %(message)s::uuid
RETURNING id
"""


def _revived(delivery_id: int, message_id: str) -> bool:
    """Whether the delivery, failed as abandoned while carried by ``message_id``, is pending again."""
    with db.connection() as conn:
        revived = conn.execute(REVIVE_ABANDONED, {"delivery": delivery_id, "abandoned": ABANDONED,
                                                  "message": message_id}).fetchone() is not None
    if revived:
        logger.info("webhook delivery %s is pending again: its job %s, which had ended without making it, "
                    "runs again", delivery_id, message_id)
    return revived


@dramatiq.actor(actor_name="webhook.deliver", queue_name="webhook", max_retries=len(SCHEDULE) + 1,
                lease=ENDPOINT_LEASE, throws=(DeliveryFailed,))
def deliver(delivery_id: int) -> None:
    settings = app_settings.current()
    message = CurrentMessage.get_current_message()
    held = lease_of(message) if message is not None else None
    batch: list[_Due] = []
    if held is not None and held.row:
        # 1. the lease is ours, and its statement read the delivery and the endpoint's
        #    next never-attempted deliveries (middleware)
        (state, attempts, url, secrets, event_id, event_type, payload, created_at, due_in_s,
         ids, event_ids, types, payloads, created_ats, message_ids) = held.row
        endpoint_id, enabled, token = int(held.key), True, held.token
        if state == "pending" and due_in_s is not None and due_in_s > DUE_SLACK_S:
            # another job's batch tried it and scheduled its retry (the lease is given back)
            raise Snooze(due_in_s, f"delivery {delivery_id}: its retry is due in {due_in_s:.1f} s")
        batch = [_Due(int(i), 0, int(e), t, p, c, m)
                 for i, e, t, p, c, m in zip(ids or (), event_ids or (), types or (), payloads or (),
                                             created_ats or (), message_ids or (), strict=True)]
    else:
        # no lease taken (the endpoint is busy; or the delivery is no longer pending, or it
        # or its endpoint is gone or disabled; or no worker runs this)
        read = read_without_lease(message) if message is not None else ()
        if read and read[0] == "busy":
            raise Snooze(_busy_wait_s(read[8], read[1], settings),
                         f"webhook.deliver: the endpoint of delivery {delivery_id} is busy", label=LEASE_BUSY)
        if read and read[0] == "failed" and message is not None and _revived(delivery_id, message.message_id):
            # its job, failed as abandoned, is back (an operator's `jobs retry`, a worker
            # that was only cut off taking back its rejection): it makes its delivery after all
            raise Snooze(0, f"delivery {delivery_id}: pending again, its job being back")
        if read and read[0] is not None and read[0] != "pending":
            return  # made already (by a batch, or an earlier run): the lease statement read it
        # a short read, the connection returned at once
        with db.connection() as conn:
            row = conn.execute(READ, (delivery_id,)).fetchone()
        if row is None:
            logger.warning("webhook delivery %s no longer exists", delivery_id)
            return
        state, attempts, endpoint_id, url, secrets, enabled, event_id, event_type, payload, created_at = row
        token = None
    if state != "pending":
        return
    if not enabled:
        with db.connection() as conn:
            conn.execute(SETTLE_DELIVERY, {"delivery": delivery_id, "attempt": attempts, "state": "skipped",
                                           "outcome": "endpoint disabled", "next": None})
        return
    if message is not None and held is None:
        raise Retry("the endpoint lease was not taken", delay=1000)  # never post without it
    todo = [_Due(delivery_id, int(attempts), int(event_id), event_type, payload, created_at), *batch]
    signing: list[str] | None = None  # opened in the first attempt: a secret no key opens is its error
    own: _Attempt | None = None
    # 2. POST each holding no database connection, within the total deadline, ending early
    #    enough before the job's own limit that the attempts are always recorded, and
    #    record each before the next POST (a crash re-sends at most the one in flight);
    #    the next one only after a success and while the whole HTTP timeout and the margin
    #    still fit (a failing endpoint keeps its other deliveries for their own jobs); once
    #    a full batch is made, on with the endpoint's next ones, 32 at a time (:func:`_waiting`),
    #    without a claim in between. The record of the last one also gives the lease back.
    n = 0
    full = len(batch) == BATCH_MAX - 1  # the lease statement read as many as it could: more may wait
    while n < len(todo):
        due = todo[n]
        timeout_s = request_budget(settings.webhook_http_timeout_s, margin_s=RECORD_MARGIN_S)
        started = datetime.now(timezone.utc)
        t0 = time.monotonic()
        body = json.dumps({"type": due.event_type, "timestamp": due.created_at.isoformat(),
                           "data": due.payload}).encode()
        try:
            if signing is None:
                signing = open_secrets(list(secrets))
            outcome = post(url, signing, f"msg_{due.event_id}_{endpoint_id}", body, timeout_s=timeout_s)
        except (TimeLimitExceeded, DeadlineExceeded) as exc:
            # the job's own limit fired during the request: still an attempt, a timeout
            deadline.set_deadline(RECORD_MARGIN_S)  # room to record it
            _settle(message, endpoint_id, token, _attempt(due, started, t0, Outcome(
                "timeout", error=f"the job's time limit passed during the request ({type(exc).__name__})")))
            raise
        except Exception as exc:
            _settle(message, endpoint_id, token, _attempt(due, started, t0, Outcome(
                "error", error=f"{type(exc).__name__}: {exc}")))
            raise
        made = _attempt(due, started, t0, outcome)
        own = own or made
        going_on = outcome.ok and _room_for_another(settings.webhook_http_timeout_s)
        if going_on and full and n == len(todo) - 1 and token is not None:
            # a full batch made: the endpoint's next ones, while the lease is ours
            more = _waiting(endpoint_id, token, made=[d.delivery_id for d in todo])
            full = len(more) == BATCH_MAX
            todo.extend(more)
        last = n == len(todo) - 1 or not going_on
        # 3. record it in one statement, which also marks done the message of a batch's
        #    delivery that reached its end, if still queued (one a consumer claimed
        #    meanwhile runs, finds its delivery made, and ends); the last one's also gives
        #    the lease back
        if last:
            _settle(message, endpoint_id, token, made)
            break
        _settle(message, endpoint_id, None, made)
        n += 1
    assert own is not None
    if own.retry_in_s is not None:
        raise Retry(f"delivery {delivery_id}: {own.outcome.outcome} {own.outcome.status_code or ''}".strip(),
                    delay=int(own.retry_in_s * 1000))
    reason = _failed_for_good(own)
    if reason is not None:
        # the job ends rejected, saying why (the message's error), not done
        if message is not None:
            message.options["error"] = reason
        raise DeliveryFailed(reason.removeprefix("DeliveryFailed: "))


def _failed_for_good(made: _Attempt) -> str | None:
    """Why a delivery failed for good, as its message's error (logged as a warning once,
    here); None when it did not. A batch's delivery's queued message is rejected with it
    (:func:`_settle`), as the job's own delivery rejects its job."""
    if made.state != "failed":
        return None
    outcome = made.outcome
    reason = outcome.error or f"the endpoint answered {outcome.status_code}"
    failed = f"delivery {made.due.delivery_id} {_FAILED_AS.get(outcome.outcome, 'failed')}: {reason}"
    logger.warning("webhook %s", failed)
    return f"DeliveryFailed: {failed}"[:MAX_REASON]


#: The endpoint's next never-attempted pending deliveries (not those this job made), oldest
#: first, with their events, while the lease is still ``%(token)s`` and the endpoint
#: enabled: what a job that made a full batch goes on with (a backlog), without a claim
#: in between.
WAITING = """
SELECT n.id, nev.id, nev.type, nev.payload, nev.created_at, n.message_id::text
FROM (SELECT w.id, w.event_id, w.message_id FROM standmeet.webhook_deliveries w
      WHERE w.endpoint_id = %(endpoint)s AND w.state = 'pending' AND w.attempts = 0 AND w.id <> ALL(%(made)s::bigint[])
        AND """ + _JOB_LIVE + """
      ORDER BY w.id LIMIT %(limit)s) n
JOIN standmeet.webhook_events nev ON nev.id = n.event_id
WHERE EXISTS (SELECT FROM standmeet.webhook_endpoints WHERE id = %(endpoint)s AND lease_token = %(token)s::uuid
              AND enabled)
ORDER BY n.id
"""


def _waiting(endpoint_id: int, token: str, *, made: list[int]) -> list[_Due]:
    """The next :data:`BATCH_MAX` deliveries of :data:`WAITING` (none once the lease is not ours)."""
    with db.connection() as conn:
        rows = conn.execute(WAITING, {"endpoint": endpoint_id, "token": token, "made": made,
                                      "limit": BATCH_MAX}).fetchall()
    return [_Due(int(i), 0, int(e), t, p, c, m) for i, e, t, p, c, m in rows]


#: How a delivery that failed for good is logged, by its last outcome.
_FAILED_AS = {"blocked": "blocked by the request-forgery guard", "gone": "gone (410): the endpoint is disabled"}
#: A waiter further back than a batch waits one more lease per batch ahead of it, at most
#: this many (it is woken, or its delivery made, long before in a working chain).
MAX_LEASES_BEHIND = 4


def _busy_wait_s(busy_for_s: float | None, ahead: int | None, settings: app_settings.AppSettings) -> float:
    """How long a delivery whose endpoint is busy snoozes: until the lease expires (the
    holder gives it back sooner and wakes the next waiter, and makes the never-attempted
    deliveries of its batch, oldest first, finishing their messages as they wait), and one
    lease more per batch of older deliveries ahead of it (up to MAX_LEASES_BEHIND); never
    under STANDMEET_WEBHOOK_BUSY_SNOOZE_S, and with up to 10 % of jitter."""
    behind = min(int(ahead or 0) // BATCH_MAX, MAX_LEASES_BEHIND)
    wait = max(float(busy_for_s or 0.0), 0.0) + behind * settings.webhook_lease_s
    return max(wait, settings.webhook_busy_snooze_s) * (1 + random.random() / 10)


def _room_for_another(http_timeout_s: float) -> bool:
    """Whether another POST, given its whole timeout, still ends before the margin that
    records the attempts."""
    left = deadline.remaining_s()
    return left is None or left >= http_timeout_s + RECORD_MARGIN_S


def _attempt(due: _Due, started: datetime, t0: float, outcome: Outcome) -> _Attempt:
    """An attempt's record: the delivery's new state and, when it is retried, the delay."""
    ms = int((time.monotonic() - t0) * 1000)
    attempt = due.attempts + 1
    retry_in: float | None = None
    if outcome.ok:
        new_state = "succeeded"
    elif outcome.outcome in ("gone", "blocked") or attempt > len(SCHEDULE):
        new_state = "failed"
    else:
        new_state = "pending"
        base = SCHEDULE[attempt - 1]
        retry_in = outcome.retry_after_s or base * (1 + random.uniform(-0.1, 0.1))
    return _Attempt(due, started, ms, outcome, new_state, retry_in)


#: How many times the statement that records an attempt and gives the lease back is run
#: when Postgres finds it deadlocked: it locks two messages' rows (the next waiter's, woken,
#: then the made delivery's, finished), and an operator's cancel of several jobs locks rows
#: in id order; the loser is rolled back whole (nothing recorded, the lease still ours), so
#: running it again is safe. Unrecorded, the delivery would be posted again by its job.
SETTLE_TRIES = 3


def _settle(message: Any, endpoint_id: int, token: str | None, made: _Attempt) -> None:
    """Record the attempt, the endpoint's health and the delivery's next try; mark done
    the message of a batch's delivery that reached its end (not one retried later, which
    its message carries; the job's own is running) if it is still queued; and, with the
    lease's token, give the lease back and wake the endpoint's next waiter: one statement,
    so a message is done exactly when its delivery's attempt is recorded."""
    outcome = made.outcome
    params = {
        "made": made.due.delivery_id, "attempt": made.due.attempts + 1, "started": made.started, "ms": made.ms,
        "code": outcome.status_code, "outcome": outcome.outcome, "error": _storable(outcome.error),
        "body": _storable(outcome.body),
        "truncated": outcome.truncated, "state": made.state,
        "retry_in_s": made.retry_in_s,
        "endpoint": endpoint_id, "healthy": outcome.ok, "token": token,
        "holder": message.message_id if message is not None else None,
        "carrier": made.due.message_id or (message.message_id if message is not None else None),
        "disabled_reason": "the endpoint answered 410 Gone" if outcome.outcome == "gone" else None,
        "reschedule": made.due.message_id if made.state == "pending" else None,
        **finish_one_params(made.due.message_id if made.state != "pending" else None, deliver.queue_name,
                            rejected_for=_failed_for_good(made) if made.due.message_id else None)}
    if token is None:  # (a NULL token gives nothing back)
        with db.connection() as conn:
            conn.execute(RECORD_ATTEMPT, params)
        return
    for tries_left in range(SETTLE_TRIES - 1, -1, -1):
        try:
            with db.connection() as conn, conn.pipeline(), conn.transaction():
                # the lease given back: its row locked first (LOCK_ENDPOINT), one round trip
                conn.execute(LOCK_ENDPOINT, {"key": endpoint_id})
                conn.execute(SETTLE_ATTEMPT, params)
            break
        except psycopg.errors.DeadlockDetected:
            if not tries_left:
                raise
            logger.info("webhook delivery %s: its record and the lease's release met another transaction's "
                        "row locks in the opposite order (rolled back whole); trying again", made.due.delivery_id)
    if message is not None:
        given_back(message)  # released by that statement: the middleware need not


def _storable(text: str | None) -> str | None:
    """``text`` as Postgres text can hold it: each NUL (an endpoint's answer may hold one)
    replaced by U+FFFD, as undecodable bytes are; unrecordable, the attempt was never
    recorded and its delivery POSTed again at every retry."""
    return text.replace("\x00", "\ufffd") if text and "\x00" in text else text


DISABLE_FAILING = """
UPDATE standmeet.webhook_endpoints SET enabled = false,
    disabled_reason = 'failing continuously since ' || failing_since::text
WHERE enabled AND failing_since < now() - make_interval(secs => %s) RETURNING id
"""


@dramatiq.actor(actor_name="maintenance.webhook_health", queue_name="maintenance")
def webhook_health() -> None:
    """Disable endpoints failing without a break for STANDMEET_WEBHOOK_DISABLE_AFTER_DAYS,
    and fail every pending delivery whose job ended without making it (the minutely
    pass sees the last hour's only)."""
    days = app_settings.current().webhook_disable_after_days
    with db.connection() as conn:  # in seconds: 0.5 days is 12 hours, not 0
        rows = conn.execute(DISABLE_FAILING, (float(days) * 86400,)).fetchall()
    for (endpoint_id,) in rows:
        logger.warning("webhook endpoint %s disabled: failing for more than %s days", endpoint_id, days)
    while fail_abandoned_deliveries(everything=True) == ABANDONED_BATCH:
        deadline.check()


app.periodic("webhook-health", "maintenance.webhook_health", interval_s=3600)

#: What a delivery whose job ended without making it is failed with (``last_outcome``).
ABANDONED = "abandoned"
#: Fail the pending deliveries of ``abandoned`` (``id``, ``message_id``, ``error``), each
#: still carried by that message: a replay committed since the rows were read gave its
#: delivery a new message, and the comparison with the row read (``d.message_id =
#: a.message_id``, on the row as locked now) leaves it pending.
_FAIL_ABANDONED = """
UPDATE standmeet.webhook_deliveries d
SET state = 'failed', last_outcome = '""" + ABANDONED + """', next_attempt_at = NULL, updated_at = now()
FROM abandoned a
WHERE d.id = a.id AND d.state = 'pending' AND d.message_id = a.message_id
RETURNING d.id, d.message_id::text, coalesce(a.error, 'its job is gone')
"""
#: Pending deliveries whose job was rejected (an operator cancelled it, it crashed its
#: worker too often, it ran out of its own retries) between ``%(lookback_s)s`` and
#: ``%(grace_s)s`` ago: found from the rejected jobs of the ``%(queue)s`` queue, by time
#: (the finished jobs' index), then each delivery by its message (the pending deliveries'
#: index). A job rejected a moment ago is left its grace (it may be retried or replayed).
FAIL_ABANDONED_RECENT = """
WITH rejected AS MATERIALIZED (
    SELECT q.message_id, q.error FROM dramatiq.queue q
    WHERE q."state" = 'rejected' AND q.queue_name = %(queue)s
      AND q.mtime >= now() - make_interval(secs => %(lookback_s)s)
      AND q.mtime < now() - make_interval(secs => %(grace_s)s)
), abandoned AS MATERIALIZED (
    SELECT d.id, d.message_id, r.error FROM rejected r
    JOIN standmeet.webhook_deliveries d ON d.message_id = r.message_id AND d.state = 'pending'
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
)""" + _FAIL_ABANDONED
#: Every pending delivery whose job was rejected more than ``%(grace_s)s`` ago, or is gone
#: (pruned): what the recent pass cannot see (its maintenance queue was down longer than
#: its look-back). Reads the pending deliveries only, each job by its id.
FAIL_ABANDONED_ALL = """
WITH abandoned AS MATERIALIZED (
    SELECT d.id, d.message_id, q.error FROM standmeet.webhook_deliveries d
    LEFT JOIN dramatiq.queue q ON q.message_id = d.message_id
    WHERE d.state = 'pending' AND d.message_id IS NOT NULL
      AND (q.message_id IS NULL
           OR (q."state"::text = 'rejected' AND q.mtime < now() - make_interval(secs => %(grace_s)s)))
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
)""" + _FAIL_ABANDONED
#: How long after its job was rejected a pending delivery is failed.
ABANDONED_GRACE_S = 60.0
#: How far back the pass of every minute looks for rejected jobs.
ABANDONED_LOOKBACK_S = 3600.0
#: Deliveries failed a statement (a pass goes on while there may be more).
ABANDONED_BATCH = 1000


def fail_abandoned_deliveries(*, everything: bool = False, grace_s: float = ABANDONED_GRACE_S,
                              limit: int = ABANDONED_BATCH) -> int:
    """Fail the pending deliveries whose job ended without making them: those whose job
    was rejected within the last hour (:data:`FAIL_ABANDONED_RECENT`), or, with
    ``everything``, any (:data:`FAIL_ABANDONED_ALL`); each said once. How many."""
    params = {"grace_s": grace_s, "limit": limit, "queue": deliver.queue_name,
              "lookback_s": ABANDONED_LOOKBACK_S + grace_s}
    with db.connection() as conn:
        rows = conn.execute(FAIL_ABANDONED_ALL if everything else FAIL_ABANDONED_RECENT, params).fetchall()
    for delivery_id, message_id, reason in rows:
        logger.warning("webhook delivery %s failed: its job %s ended without making it (%s); "
                       "`standmeet-jobs webhooks replay %s` tries it again", delivery_id, message_id,
                       str(reason)[:MAX_REASON], delivery_id)
    return len(rows)


@dramatiq.actor(actor_name="maintenance.webhook_abandoned", queue_name="maintenance")
def webhook_abandoned() -> None:
    """Fail the pending deliveries whose job was rejected within the last hour."""
    while fail_abandoned_deliveries() == ABANDONED_BATCH:
        deadline.check()


app.periodic("webhook-abandoned", "maintenance.webhook_abandoned", interval_s=60)
