"""SQL of the broker, as module-level constants (never built from values).

Placeholders are ``%(name)s``, which psycopg2 (the broker's driver) and psycopg 3
(the caller's connection, for transactional enqueue) both understand.
"""

from __future__ import annotations

#: Channel a consumer of queue Q listens on; a NOTIFY on it means "look again".
ENQUEUE_CHANNEL = "dramatiq.{queue}.enqueue"

#: Insert (or re-queue) messages, each due after its delay, and wake each queue once.
#: NOTIFYs with the same channel and payload in one transaction are sent once at commit.
ENQUEUE = """
WITH enqueued AS (
    INSERT INTO dramatiq.queue AS q (queue_name, message_id, "state", message, eta, enqueued_at, mtime)
    SELECT m.queue_name, m.message_id, 'queued', m.message, now() + make_interval(secs => m.delay_s), now(), now()
    FROM unnest(%(queues)s::text[], %(message_ids)s::uuid[], %(messages)s::jsonb[], %(delays)s::float8[])
         AS m(queue_name, message_id, message, delay_s)
    ON CONFLICT (message_id) DO UPDATE SET
        "state" = 'queued',
        message = EXCLUDED.message,
        queue_name = EXCLUDED.queue_name,
        eta = EXCLUDED.eta,
        worker_id = NULL,
        mtime = now()
    RETURNING q.queue_name
)
SELECT pg_notify('dramatiq.' || queue_name || '.enqueue', '') FROM (SELECT DISTINCT queue_name FROM enqueued) AS woken
"""

#: Acks and claims commit asynchronously (no WAL flush wait). Losing one in a server
#: crash only means a message runs again (at least once), never that one is lost;
#: enqueues stay synchronous. Sent with the statement in one round trip: a multi-
#: statement query runs as one implicit transaction, so SET LOCAL applies to it.
ASYNC_COMMIT = "SET LOCAL synchronous_commit = off;\n"

#: Claim up to ``n`` due messages of a queue for this worker process. Rows locked by a
#: concurrent claimer are skipped, not waited on; no advisory lock outlives the statement.
#: A paused queue (``standmeet.queue_pauses``) gives nothing.
CLAIM = ASYNC_COMMIT + """
WITH picked AS (
    SELECT message_id FROM dramatiq.queue
    WHERE queue_name = %(queue)s AND "state" = 'queued' AND eta <= now()
      AND NOT EXISTS (SELECT 1 FROM standmeet.queue_pauses p WHERE p.queue_name = %(queue)s)
    ORDER BY eta
    LIMIT %(n)s
    FOR UPDATE SKIP LOCKED
)
UPDATE dramatiq.queue q
SET "state" = 'consumed', mtime = now(), worker_id = %(worker_id)s, claims = q.claims + 1
FROM picked
WHERE q.message_id = picked.message_id
RETURNING q.message::text, q.claims, q.eta, q.message_id::text
"""

#: Seconds until the next queued message of a queue is due (None when there is none, or
#: when the queue is paused: its consumers then wait for a NOTIFY or their poll).
NEXT_DUE = """
SELECT EXTRACT(EPOCH FROM min(eta) - now())::float8
FROM dramatiq.queue
WHERE queue_name = %(queue)s AND "state" = 'queued'
  AND NOT EXISTS (SELECT 1 FROM standmeet.queue_pauses p WHERE p.queue_name = %(queue)s)
"""

#: Mark a message done, only if it is still the claim we made (a message re-enqueued by
#: the retry policy, or rescued and claimed again elsewhere, is left alone). On an
#: awaited queue, the receipt is sent in the same statement: at once, no batching.
ACK = ASYNC_COMMIT + """
WITH settled AS (
    UPDATE dramatiq.queue
    SET "state" = 'done', message = %(message)s::jsonb, mtime = now(), worker_id = NULL
    WHERE message_id = %(message_id)s AND "state" = 'consumed' AND claims = %(claims)s
    RETURNING queue_name, message_id
)
SELECT pg_notify('standmeet_receipts_' || queue_name, message_id::text || ':done')
FROM settled WHERE queue_name = ANY(%(awaited)s::text[])
"""

#: Mark a message rejected (failed for good), under the same condition as ACK.
NACK = ASYNC_COMMIT + """
WITH settled AS (
    UPDATE dramatiq.queue
    SET "state" = 'rejected', message = %(message)s::jsonb, mtime = now(), worker_id = NULL,
        error = %(error)s
    WHERE message_id = %(message_id)s AND "state" = 'consumed' AND claims = %(claims)s
    RETURNING queue_name, message_id
)
SELECT pg_notify('standmeet_receipts_' || queue_name, message_id::text || ':rejected')
FROM settled WHERE queue_name = ANY(%(awaited)s::text[])
"""

#: A claimed row that Dramatiq cannot decode: kept, rejected with the reason.
REJECT_MALFORMED = """
UPDATE dramatiq.queue SET "state" = 'rejected', worker_id = NULL, error = %(error)s
WHERE message_id = %(message_id)s
"""

#: A message for an actor this process does not have (a rolling deploy?): back to the
#: queue for a later or other worker, and rejected with the reason after many tries.
UNKNOWN_ACTOR = """
UPDATE dramatiq.queue
SET "state" = CASE WHEN claims >= %(max_claims)s THEN 'rejected'::dramatiq.state ELSE 'queued'::dramatiq.state END,
    eta = now() + make_interval(secs => %(delay_s)s), worker_id = NULL, mtime = now(), error = %(error)s
WHERE message_id = %(message_id)s
"""

#: Give claimed-but-not-started messages back to their queue and wake its consumers.
REQUEUE = """
WITH requeued AS (
    UPDATE dramatiq.queue
    SET "state" = 'queued', worker_id = NULL, mtime = now()
    WHERE message_id = ANY(%(message_ids)s::uuid[]) AND "state" = 'consumed'
      AND worker_id = %(worker_id)s
    RETURNING queue_name
)
SELECT pg_notify('dramatiq.' || queue_name || '.enqueue', '') FROM (SELECT DISTINCT queue_name FROM requeued) AS woken
"""

REGISTER_WORKER = """
INSERT INTO standmeet.worker_processes (id, hostname, pid, queues)
VALUES (%(worker_id)s, %(hostname)s, %(pid)s, %(queues)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), stopped_at = NULL, queues = EXCLUDED.queues
"""

HEARTBEAT = """
UPDATE standmeet.worker_processes SET heartbeat_at = now()
WHERE id = %(worker_id)s AND stopped_at IS NULL
"""

STOP_WORKER = """
UPDATE standmeet.worker_processes SET stopped_at = now() WHERE id = %(worker_id)s
"""

#: Requeue (and wake) the messages held by processes that stopped or whose heartbeat is
#: older than ``after_s``; a message that has crashed its worker more than
#: ``max_crashes`` times is rejected with the reason instead.
RESCUE = """
WITH orphaned AS (
    SELECT q.message_id
    FROM dramatiq.queue q
    LEFT JOIN standmeet.worker_processes w ON w.id = q.worker_id
    WHERE q."state" = 'consumed'
      AND (w.id IS NULL OR w.stopped_at IS NOT NULL
           OR w.heartbeat_at < now() - make_interval(secs => %(after_s)s))
    FOR UPDATE OF q SKIP LOCKED
), rescued AS (
    UPDATE dramatiq.queue q
    SET crashes = q.crashes + 1,
        worker_id = NULL,
        mtime = now(),
        "state" = CASE WHEN q.crashes + 1 > %(max_crashes)s
                       THEN 'rejected'::dramatiq.state ELSE 'queued'::dramatiq.state END,
        error = CASE WHEN q.crashes + 1 > %(max_crashes)s
                     THEN 'rejected: its worker process died while running it '
                          || (q.crashes + 1) || ' times'
                     ELSE q.error END
    FROM orphaned
    WHERE q.message_id = orphaned.message_id
    RETURNING q.queue_name, q."state"
)
SELECT queue_name,
       count(*) FILTER (WHERE "state" = 'queued') AS requeued,
       count(*) FILTER (WHERE "state" = 'rejected') AS rejected,
       pg_notify('dramatiq.' || queue_name || '.enqueue', '')
FROM rescued
GROUP BY queue_name
"""

#: Forget the rows of processes stopped or silent for a day (their messages are rescued).
PRUNE_WORKERS = """
DELETE FROM standmeet.worker_processes
WHERE coalesce(stopped_at, heartbeat_at) < now() - interval '1 day'
  AND NOT EXISTS (SELECT 1 FROM dramatiq.queue q
                  WHERE q.worker_id = worker_processes.id AND q."state" = 'consumed')
"""

#: Delete one batch of finished messages older than the retention.
PRUNE_FINISHED = """
DELETE FROM dramatiq.queue
WHERE message_id IN (
    SELECT message_id FROM dramatiq.queue
    WHERE "state" IN ('done', 'rejected')
      AND mtime < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
)
"""

#: Claim a periodic job's period; a row back means this scheduler enqueues it.
CLAIM_PERIOD = """
INSERT INTO standmeet.periodic_runs (job, period_start, message_id)
VALUES (%(job)s, %(period_start)s, %(message_id)s)
ON CONFLICT (job, period_start) DO NOTHING
RETURNING message_id
"""

#: Channel the relay listens on; emit notifies it (at commit).
OUTBOX_CHANNEL = "standmeet_outbox"

EMIT = """
WITH inserted AS (
    INSERT INTO standmeet.outbox (topic, payload) VALUES (%(topic)s, %(payload)s::jsonb)
    RETURNING id
)
SELECT id, pg_notify('standmeet_outbox', '') FROM inserted
"""

#: One relay pass: up to ``limit`` pending rows, rows not a cursor; concurrent relays
#: skip each other's rows.
RELAY_CLAIM = """
SELECT id, topic, payload
FROM standmeet.outbox
WHERE relayed_at IS NULL AND error IS NULL
ORDER BY id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""

RELAY_MARK = """
UPDATE standmeet.outbox AS o
SET relayed_at = now(), relay_txid = txid_current(), messages = m.n
FROM unnest(%(ids)s::bigint[], %(counts)s::int[]) AS m(id, n)
WHERE o.id = m.id
"""

RELAY_FAIL = "UPDATE standmeet.outbox SET error = %(error)s WHERE id = %(id)s"

PRUNE_OUTBOX = """
DELETE FROM standmeet.outbox
WHERE id IN (
    SELECT id FROM standmeet.outbox
    WHERE relayed_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
)
"""
