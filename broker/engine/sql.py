"""SQL of the broker, as module-level constants (never built from values).

Placeholders are ``%(name)s`` (psycopg 3); arrays of strings are sent in binary,
``%(name)b``: psycopg escapes every element of a text array literal in Python (a regular
expression per quote of a JSON message), which cost more than the rest of a bulk enqueue.
Numeric arrays stay ``%(name)s`` (binary refuses a list mixing ints and floats).
Channel and table names are spelt here and nowhere else in the broker's Python; in SQL,
every statement names a channel through ``standmeet.enqueue_channel(queue)``,
``standmeet.receipt_channel(queue)`` or ``standmeet.outbox_channel()`` (migration 0012),
which a test binds to the constants below.
"""

from __future__ import annotations

#: Channel a consumer of queue Q listens on; a NOTIFY on it means "look again".
ENQUEUE_CHANNEL = "dramatiq.{queue}.enqueue"
#: Channel a final settle on an awaited queue notifies, with '<message id>:<state>'.
RECEIPT_CHANNEL = "standmeet_receipts_{queue}"

#: What ENQUEUE does with an id that exists: a queued message takes the new text; one
#: that is running or has finished is never resurrected (a re-relayed event cannot run
#: its job twice).
_ON_CONFLICT_KEEP_STARTED = """    ON CONFLICT (message_id) DO UPDATE SET
        message = EXCLUDED.message, eta = EXCLUDED.eta, priority = EXCLUDED.priority, mtime = now()
    WHERE q."state" = 'queued'"""

_ENQUEUE_ROWS = """
WITH enqueued AS (
    INSERT INTO dramatiq.queue AS q
        (queue_name, message_id, "state", message, eta, enqueued_at, mtime, priority)
    SELECT m.body ->> 'queue_name', (m.body ->> 'message_id')::uuid, 'queued', m.body,
           now() + make_interval(secs => %(delay_s)s::float8), now(), now(), m.priority
    FROM ROWS FROM (jsonb_array_elements(%(messages)s::jsonb), unnest(%(priorities)s::int[])) AS m(body, priority)
"""

_ENQUEUE_WAKE = """
    RETURNING q.queue_name
)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '')
FROM (SELECT DISTINCT queue_name FROM enqueued) AS woken
"""

#: Insert messages, all due after ``delay_s``, and wake each queue once (NOTIFYs with the
#: same channel and payload in one transaction are sent once, at commit). ``messages`` is
#: one JSON array of the messages' bodies, ``priorities`` one int array (lower runs first),
#: each sent as a single text: arrays of many strings cost more to send than the rest of
#: building them. The row's queue and id are the body's own; an existing id is kept as
#: ``_ON_CONFLICT_KEEP_STARTED`` says.
ENQUEUE = _ENQUEUE_ROWS + _ON_CONFLICT_KEEP_STARTED + _ENQUEUE_WAKE

#: ENQUEUE for a batch whose ids are all new, as fresh Dramatiq messages' are: a plain
#: insert, without the speculative insertion ON CONFLICT makes of every row (about a
#: tenth of a batch's time). One id that exists fails the whole statement with a unique
#: violation, and ENQUEUE then writes the batch: a clash costs the server an error line
#: in its log and the rows written before it (dead until vacuumed), so a caller that
#: re-sends ids on purpose is better served by ENQUEUE. Only on the broker's own
#: autocommit connection: in a caller's transaction the error would abort it.
ENQUEUE_NEW = _ENQUEUE_ROWS + _ENQUEUE_WAKE

#: ENQUEUE for one message, with plain parameters: a single send dumps no arrays and
#: unnests nothing (the same rules: an existing id is never resurrected).
ENQUEUE_ONE = """
WITH enqueued AS (
    INSERT INTO dramatiq.queue AS q
        (queue_name, message_id, "state", message, eta, enqueued_at, mtime, priority)
    VALUES (%(queue)s, %(message_id)s::uuid, 'queued', %(message)s::jsonb,
            now() + make_interval(secs => %(delay_s)s::float8), now(), now(), %(priority)s::int)
    ON CONFLICT (message_id) DO UPDATE SET
        message = EXCLUDED.message, eta = EXCLUDED.eta, priority = EXCLUDED.priority, mtime = now()
    WHERE q."state" = 'queued'
    RETURNING q.queue_name
)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM enqueued
"""

#: Claims commit asynchronously (no WAL flush wait): the claim statement turns
#: ``synchronous_commit`` off for its own transaction (``set_config(…, true)``), never for
#: the session, so it holds through a transaction pooler and leaks into nothing. Losing a
#: claim in a server crash only means a message runs again (at least once), never that one
#: is lost. Settles and enqueues stay synchronous: a settle the settler counts as written
#: is forgotten by its process, so losing one would leave its message consumed by a live
#: worker.
_ASYNC_COMMIT = "(SELECT set_config('synchronous_commit', 'off', true)) AS async_commit"

#: Who cancelled the message of row ``q`` and when, as ``jobs cancel`` words it: the start
#: of the ``error`` of every message settled as cancelled (followed by how its run ended).
_CANCELLED_BY = (
    "'cancelled by ' || coalesce(q.cancelled_by, 'an operator') || ' at '"
    " || to_char(q.cancelled_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
)


def _oversize(alias: str) -> str:
    """The size of the message of row ``alias`` when a claim must refuse it (NULL when it
    fits), decided in the statement: a row is never loaded into a worker to be measured.

    Postgres' text of a jsonb is at most six times its stored size (a control character,
    one byte, is written ``\\u0001``), so an uncompressed row whose stored size is at most
    ``claim_cheap_bytes`` fits without being measured: reading the size of a stored value
    never fetches it. Only a compressed or larger one is turned into text to be measured."""
    return (f"CASE WHEN pg_column_compression({alias}.message) IS NULL"
            f" AND pg_column_size({alias}.message) <= %(claim_cheap_bytes)s THEN NULL"
            f" ELSE (SELECT t.n FROM (SELECT octet_length({alias}.message::text) AS n) AS t"
            " WHERE t.n > %(claim_max_bytes)s) END")


#: Claim up to ``n`` due messages of a queue for this worker process, lower priority
#: number first, then oldest due. Rows locked by a concurrent claimer are skipped, not
#: waited on. The first ``n_start`` are marked started (they run at once); the rest are
#: prefetched and carry no blame if this process dies before starting them.
#: A suspect (a message whose worker died running it beside others) is claimed only
#: when no other message of its set runs anywhere, one at a time: the advisory lock
#: of its set (held for this statement only) keeps two claimers from racing.
#: A paused queue is claimed from by nobody. The claim commits asynchronously (_ASYNC_COMMIT).
#: A picked row that must not run is rejected by the claim itself, with the reason, and
#: comes back with no text (NULL): a cancelled one (none should be queued; whatever put
#: it back, it never runs), or one whose text is over ``claim_max_bytes`` (_oversize).
CLAIM = """
WITH normal AS (
    SELECT message_id, priority, eta, cancelled_at IS NOT NULL AS cancelled, """ + _oversize("n") + """ AS oversize
    FROM dramatiq.queue n
    WHERE queue_name = %(queue)s AND "state" = 'queued' AND eta <= now() AND suspect_of IS NULL
      AND NOT EXISTS (SELECT 1 FROM standmeet.queue_pauses p WHERE p.queue_name = %(queue)s)
    ORDER BY priority, eta
    LIMIT %(n)s
    FOR UPDATE SKIP LOCKED
), suspect AS (
    SELECT s.message_id, s.priority, s.eta, s.cancelled_at IS NOT NULL AS cancelled, """ + _oversize("s") + """ AS oversize
    FROM dramatiq.queue s
    WHERE s.queue_name = %(queue)s AND s."state" = 'queued' AND s.eta <= now() AND s.suspect_of IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM standmeet.queue_pauses p WHERE p.queue_name = %(queue)s)
      AND NOT EXISTS (SELECT 1 FROM dramatiq.queue c
                      WHERE c.suspect_of = s.suspect_of AND c."state" = 'consumed')
      AND pg_try_advisory_xact_lock(727274002, hashtext(s.suspect_of::text))
    ORDER BY s.eta
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT message_id, cancelled, oversize, (cancelled OR oversize IS NOT NULL) AS refused,
           row_number() OVER (ORDER BY priority, eta) AS rn
    FROM (SELECT * FROM suspect UNION ALL SELECT * FROM normal) AS both_kinds
    ORDER BY priority, eta
    LIMIT %(n)s
)
UPDATE dramatiq.queue q
SET "state" = (CASE WHEN picked.refused THEN 'rejected' ELSE 'consumed' END)::dramatiq.state,
    mtime = now(), claims = q.claims + 1, woken_at = NULL,
    worker_id = CASE WHEN picked.refused THEN NULL ELSE %(worker_id)s::uuid END,
    started_at = CASE WHEN NOT picked.refused AND picked.rn <= %(n_start)s THEN now() END,
    error = CASE WHEN picked.cancelled THEN """ + _CANCELLED_BY + """ || ': found queued; not run'
                 WHEN picked.refused
                 THEN 'rejected when claimed: its message is ' || picked.oversize || ' bytes as Postgres writes it, over the '
                      || %(claim_max_bytes)s || ' a claim accepts (1.5 x STANDMEET_MESSAGE_MAX_BYTES)'
                 ELSE q.error END
FROM picked, """ + _ASYNC_COMMIT + """
WHERE q.message_id = picked.message_id
RETURNING CASE WHEN picked.refused THEN NULL ELSE q.message::text END, q.claims, picked.rn, q.message_id::text,
          q.queue_name, CASE WHEN picked.refused THEN q.error END
"""

#: Seconds until the next queued message of a queue is due (None when there is none, or
#: when the queue is paused: its consumers then wait for a NOTIFY or their poll).
#: The claim index is ordered by priority, then due time: the earliest due time is the
#: least of each priority's first, found by skipping from one priority to the next (a
#: handful of index probes, where min(eta) read every queued message: 22 ms at 30,000).
NEXT_DUE = """
WITH RECURSIVE priorities AS (
    (SELECT priority FROM dramatiq.queue
     WHERE queue_name = %(queue)s AND "state" = 'queued' ORDER BY priority LIMIT 1)
    UNION ALL
    SELECT (SELECT q.priority FROM dramatiq.queue q
            WHERE q.queue_name = %(queue)s AND q."state" = 'queued' AND q.priority > p.priority
            ORDER BY q.priority LIMIT 1)
    FROM priorities p WHERE p.priority IS NOT NULL
)
SELECT EXTRACT(EPOCH FROM min(
           (SELECT q.eta FROM dramatiq.queue q
            WHERE q.queue_name = %(queue)s AND q."state" = 'queued' AND q.priority = p.priority
            ORDER BY q.eta LIMIT 1)) - now())::float8
FROM priorities p
WHERE p.priority IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM standmeet.queue_pauses qp WHERE qp.queue_name = %(queue)s)
"""

#: The receipts of what a statement's ``settled`` CTE (queue_name, message_id, state)
#: finished on awaited queues: one notification per queue and 150 receipts, under
#: Postgres' 8000-byte payload limit. The tail of every statement that finishes messages.
RECEIPTS_OF_SETTLED = """
SELECT pg_notify(standmeet.receipt_channel(queue_name), string_agg(message_id::text || ':' || state, ','))
FROM (SELECT queue_name, message_id, state,
             (row_number() OVER (PARTITION BY queue_name) - 1) / 150 AS chunk
      FROM settled WHERE state IN ('done', 'rejected') AND queue_name = ANY(%(awaited)b::text[])) AS receipts
GROUP BY queue_name, chunk
"""

#: The bounds (milliseconds) of the wait and run histograms of ``standmeet.queue_history``:
#: element i (1-based) of a histogram counts the values in [bound i, bound i+1); the last
#: one everything from the last bound up. Never change them in place: a migration would
#: have to rewrite every row.
HISTORY_BOUNDS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000,
                     300_000, 900_000, 3_600_000)
#: How many rows of one minute, queue and actor the writers spread over: a process writes
#: the shard of its id, so processes settling the same actor do not wait on one row's lock.
HISTORY_SHARDS = 8
#: Longest error text kept on an attempt.
ATTEMPT_ERROR_CHARS = 4000

_BOUNDS = "'{" + ",".join(str(b) for b in HISTORY_BOUNDS_MS) + "}'::float8[]"
_SHARD = "(hashtext(%(worker_id)s::text) & " + str(HISTORY_SHARDS - 1) + ")::smallint"


def _histogram(bucket: str) -> str:
    """The histogram of a group's ``bucket`` column (width_bucket over _BOUNDS), as an array."""
    return "ARRAY[" + ", ".join(f"count(*) FILTER (WHERE r.{bucket} = {i})"
                                for i in range(1, len(HISTORY_BOUNDS_MS) + 1)) + "]"


def _added(column: str) -> str:
    """Two histograms added element by element (an upsert's stored row and its new one)."""
    return "ARRAY[" + ", ".join(f"h.{column}[{i}] + EXCLUDED.{column}[{i}]"
                                for i in range(1, len(HISTORY_BOUNDS_MS) + 1)) + "]"


_COUNTED = ("done", "failed", "rejected", "cancelled", "snoozed", "timed_out", "crashed", "given_back",
            "wait_count", "wait_sum_ms", "run_count", "run_sum_ms")

#: The tail of every statement that ends runs: from its CTE ``ran`` (message_id, attempt,
#: queue_name, actor_name, worker_id, outcome, state, started_at, ended_at, error, wait_ms,
#: run_ms: one row per run ended, ``state`` the message's state after it, ``wait_ms`` and
#: ``run_ms`` NULL when not measured), one row per run into ``standmeet.job_attempts`` and
#: one upsert of the runs' per-minute counts and histograms into
#: ``standmeet.queue_history`` (this process's shard), in the statement (and transaction)
#: that ends them: a run is counted exactly when its outcome is written. The groups are
#: written in key order, so two writers of a shard never lock its rows in opposite orders.
RECORD_RAN = """, attempted AS (
    INSERT INTO standmeet.job_attempts
        (message_id, attempt, queue_name, actor_name, worker_id, started_at, ended_at, outcome, error)
    SELECT message_id, attempt, queue_name, actor_name, worker_id, started_at, ended_at, outcome,
           left(error, """ + str(ATTEMPT_ERROR_CHARS) + """)
    FROM ran
), rolled_up AS (
    INSERT INTO standmeet.queue_history AS h
        (minute, queue_name, actor_name, shard, """ + ", ".join(_COUNTED[:8]) + """,
         wait_count, wait_sum_ms, wait_hist, run_count, run_sum_ms, run_hist)
    SELECT date_trunc('minute', r.ended_at), r.queue_name, r.actor_name, """ + _SHARD + """,
           count(*) FILTER (WHERE r.outcome = 'done'),
           count(*) FILTER (WHERE r.state = 'queued' AND r.outcome IN ('failed', 'timeout')),
           count(*) FILTER (WHERE r.state = 'rejected' AND r.outcome IN ('rejected', 'timeout')),
           count(*) FILTER (WHERE r.outcome = 'cancelled'),
           count(*) FILTER (WHERE r.outcome = 'snoozed'),
           count(*) FILTER (WHERE r.outcome = 'timeout'),
           count(*) FILTER (WHERE r.outcome = 'crashed'),
           count(*) FILTER (WHERE r.outcome IN ('cut_at_shutdown', 'interrupted')),
           count(r.wait_ms), coalesce(sum(r.wait_ms), 0), """ + _histogram("wait_b") + """,
           count(r.run_ms), coalesce(sum(r.run_ms), 0), """ + _histogram("run_b") + """
    FROM (SELECT ran.*, width_bucket(ran.wait_ms, """ + _BOUNDS + """) AS wait_b,
                 width_bucket(ran.run_ms, """ + _BOUNDS + """) AS run_b
          FROM ran) AS r
    GROUP BY 1, 2, 3
    ORDER BY 1, 2, 3
    ON CONFLICT (minute, queue_name, actor_name, shard) DO UPDATE SET
        """ + ", ".join(f"{c} = h.{c} + EXCLUDED.{c}" for c in _COUNTED) + """,
        wait_hist = """ + _added("wait_hist") + """,
        run_hist = """ + _added("run_hist") + """
)
"""

#: Delete one batch of attempts that ended before the history's retention.
PRUNE_ATTEMPTS = """
DELETE FROM standmeet.job_attempts
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM standmeet.job_attempts
    WHERE ended_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
))
"""

#: Delete one batch of per-minute history older than its retention.
PRUNE_HISTORY = """
DELETE FROM standmeet.queue_history
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM standmeet.queue_history
    WHERE minute < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
))
"""

#: How a settled run's ``ran`` row is computed from a ``settled`` CTE that returns, beside
#: the message's new state, ``cancelled``, ``claims``, ``due_at`` (when the message became
#: due for this run), ``actor_name``, ``started_ago`` and ``ended_ago`` (seconds before
#: this statement the run started and ended, measured by the worker's monotonic clock and
#: placed on the database's), ``hint`` (the run's outcome as its worker saw it) and
#: ``run_error``: every timestamp is the database's.
_RAN_OF_SETTLED = """, ran AS (
    SELECT message_id, claims AS attempt, queue_name, actor_name, %(worker_id)s::uuid AS worker_id,
           CASE WHEN cancelled THEN 'cancelled'
                WHEN hint = 'rerun' AND state = 'rejected' THEN 'rejected'
                WHEN hint = 'rerun' THEN 'failed'
                ELSE hint END AS outcome,
           state,
           now() - make_interval(secs => started_ago) AS started_at,
           now() - make_interval(secs => ended_ago) AS ended_at,
           run_error AS error,
           greatest((EXTRACT(EPOCH FROM now() - due_at)::float8 - started_ago) * 1000, 0) AS wait_ms,
           greatest((started_ago - ended_ago) * 1000, 0) AS run_ms
    FROM settled
)"""

#: Settle finished claims, many at once, each only if it is still the claim it names
#: (a message rescued and claimed again elsewhere is left alone). A claim is named by its
#: number *and* its worker process: after a failover that lost the last claims the old
#: primary took, the same number can be taken again by another process.
#:   done      the actor returned
#:   rejected  failed for good, with the reason
#:   queued    run again after a delay: a retry with back-off or a snooze (which never
#:             counts a retry)
#:   rerun     the run ended with no outcome (its retry logic raised): run again after a
#:             delay, counted in ``runs_without_outcome``; rejected with the reason (the
#:             error given) once ``max_runs_without_outcome`` runs ended so
#: A cancelled message is never done nor queued again: it is rejected, the error saying who
#: cancelled it and how its run ended (a rejection keeps its own reason).
#: ``options`` is the message's options as the run left them (NULL: unchanged): only they
#: change in a run, so the arguments are neither sent nor parsed again.
#: In the same statement (one transaction): the messages the settled runs sent from their
#: after-hooks (pipelines, callbacks) are enqueued, only for claims that were settled;
#: receipts are sent for final states of awaited queues (RECEIPTS_OF_SETTLED), and
#: consumers of queues that got messages are woken; each run settled is recorded as an
#: attempt and in the per-minute history (RECORD_RAN), the wait measured from the due time
#: the message had when claimed (``was``: the row as the statement found it).
SETTLE = """
WITH outcome AS MATERIALIZED (
    SELECT * FROM unnest(%(ids)b::uuid[], %(claims)s::int[], %(outcomes)b::text[],
                         %(options)b::jsonb[], %(delays)s::float8[], %(errors)b::text[],
                         %(hints)b::text[], %(actors)b::text[], %(started_ago)s::float8[], %(ended_ago)s::float8[])
         AS o(message_id, claims, outcome, options, delay_s, error, hint, actor_name, started_ago, ended_ago)
), settled AS (
    UPDATE dramatiq.queue q
    SET "state" = (CASE WHEN o.outcome = 'rejected' THEN 'rejected'
                        WHEN q.cancelled_at IS NOT NULL THEN 'rejected'
                        WHEN o.outcome = 'rerun' AND q.runs_without_outcome + 1 >= %(max_runs_without_outcome)s
                             THEN 'rejected'
                        WHEN o.outcome = 'rerun' THEN 'queued'
                        ELSE o.outcome END)::dramatiq.state,
        message = CASE WHEN o.options IS NULL THEN q.message
                       ELSE jsonb_set(q.message, '{options}', o.options) END,
        runs_without_outcome = q.runs_without_outcome + (o.outcome = 'rerun')::int,
        -- a run woken while it ran (``woken_at``, set by the job it waited for) is due now
        eta = CASE WHEN o.outcome IN ('queued', 'rerun')
                   THEN now() + make_interval(secs => CASE WHEN q.woken_at IS NULL THEN o.delay_s ELSE 0 END)
                   ELSE q.eta END,
        error = CASE WHEN o.outcome = 'rejected' THEN o.error
                     WHEN q.cancelled_at IS NOT NULL
                          THEN """ + _CANCELLED_BY + """ || CASE o.outcome
                               WHEN 'done' THEN ': its run returned after the cancellation'
                               WHEN 'rerun' THEN ': its run ended with no outcome; not run again'
                               ELSE ': not retried' END
                     WHEN o.outcome = 'rerun' AND q.runs_without_outcome + 1 >= %(max_runs_without_outcome)s
                          THEN 'rejected: ' || (q.runs_without_outcome + 1) || ' runs ended with no outcome'
                               || ' (STANDMEET_MAX_RUNS_WITHOUT_OUTCOME); the last: ' || coalesce(o.error, 'no reason given')
                     WHEN o.outcome = 'done' THEN NULL
                     ELSE q.error END,
        worker_id = NULL, started_at = NULL, mtime = now()
    FROM outcome o, dramatiq.queue was
    WHERE q.message_id = o.message_id AND q.claims = o.claims AND q."state" = 'consumed'
      AND q.worker_id IS NOT DISTINCT FROM %(worker_id)s::uuid
      AND was.message_id = o.message_id
    RETURNING q.queue_name, q.message_id, q."state"::text AS state, q.cancelled_at IS NOT NULL AS cancelled,
              q.claims, was.eta AS due_at, o.actor_name, o.started_ago, o.ended_ago, o.hint,
              CASE WHEN q.cancelled_at IS NOT NULL OR (o.outcome = 'rerun' AND q."state" = 'rejected') THEN q.error
                   ELSE o.error END AS run_error
), followed AS (
    INSERT INTO dramatiq.queue AS q
        (queue_name, message_id, "state", message, eta, enqueued_at, mtime, priority)
    SELECT f.queue_name, f.message_id, 'queued', f.message,
           now() + make_interval(secs => f.delay_s), now(), now(), f.priority
    FROM unnest(%(f_parents)b::uuid[], %(f_queues)b::text[], %(f_ids)b::uuid[], %(f_messages)b::jsonb[],
                %(f_delays)s::float8[], %(f_priorities)s::int[])
         AS f(parent_id, queue_name, message_id, message, delay_s, priority)
    WHERE f.parent_id IN (SELECT message_id FROM settled)
    ON CONFLICT (message_id) DO NOTHING
    RETURNING q.queue_name
)""" + _RAN_OF_SETTLED + RECORD_RAN + RECEIPTS_OF_SETTLED + """UNION ALL
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '')
FROM (SELECT queue_name FROM settled WHERE state = 'queued'
      UNION SELECT queue_name FROM followed) AS woken
"""

#: The settles find their rows by id (the primary key), once per outcome, from the
#: outcomes' arrays unnested once (MATERIALIZED): compared to the worker with IS NOT
#: DISTINCT FROM (the same test, the parameter is never NULL), the worker's index is not
#: offered to the planner, whose generic plan otherwise scanned every claim of the worker
#: and unnested the arrays again for each (quadratic in the batch: 2 ms for 100 rows).
#: The common settle, many at once: runs that returned, sent nothing from their
#: after-hooks and left their message as it was claimed. Only the state changes (the
#: message text is not sent, parsed or rewritten); receipts as in SETTLE. Each only if it
#: is still the claim it names; a cancelled one is rejected, as SETTLE says. The start
#: marks of other claims (MARK_STARTED's, never a claim settled here) ride along in the
#: same statement: one round trip, no pipeline.
SETTLE_DONE = """
WITH ran_here AS MATERIALIZED (
    SELECT * FROM unnest(%(ids)b::uuid[], %(claims)s::int[], %(actors)b::text[], %(started_ago)s::float8[],
                         %(ended_ago)s::float8[]) AS o(message_id, claims, actor_name, started_ago, ended_ago)
), marked AS (
    UPDATE dramatiq.queue q SET started_at = now()
    FROM unnest(%(s_ids)b::uuid[], %(s_claims)s::int[]) AS s(message_id, claims)
    WHERE q.message_id = s.message_id AND q.claims = s.claims AND q."state" = 'consumed' AND q.worker_id = %(worker_id)s
      AND q.started_at IS NULL
), settled AS (
    UPDATE dramatiq.queue q
    SET "state" = (CASE WHEN q.cancelled_at IS NULL THEN 'done' ELSE 'rejected' END)::dramatiq.state,
        error = CASE WHEN q.cancelled_at IS NOT NULL
                     THEN """ + _CANCELLED_BY + """ || ': its run returned after the cancellation' END,
        worker_id = NULL, started_at = NULL, mtime = now()
    FROM ran_here o
    WHERE q.message_id = o.message_id AND q.claims = o.claims AND q."state" = 'consumed'
      AND q.worker_id IS NOT DISTINCT FROM %(worker_id)s::uuid
    RETURNING q.queue_name, q.message_id, q."state"::text AS state, q.cancelled_at IS NOT NULL AS cancelled,
              q.claims, q.eta AS due_at, o.actor_name, o.started_ago, o.ended_ago, 'done' AS hint, q.error AS run_error
)""" + _RAN_OF_SETTLED + RECORD_RAN + RECEIPTS_OF_SETTLED

#: Record that prefetched claims have started running (they can now be blamed for a
#: crash of their process).
MARK_STARTED = """
UPDATE dramatiq.queue q SET started_at = now()
FROM unnest(%(ids)b::uuid[], %(claims)s::int[]) AS s(message_id, claims)
WHERE q.message_id = s.message_id AND q.claims = s.claims AND q."state" = 'consumed' AND q.worker_id = %(worker_id)s
  AND q.started_at IS NULL
"""

#: A claimed row that cannot be run as it is (not a Dramatiq message, or one whose text
#: disagrees with its own row): rejected by its row id, with the reason.
REJECT_MALFORMED = """
UPDATE dramatiq.queue SET "state" = 'rejected', worker_id = NULL, started_at = NULL, mtime = now(),
    error = %(error)s
WHERE message_id = %(message_id)s
"""

#: A message for an actor this process does not have (a rolling deploy?): back to the
#: queue for a later or other worker, and rejected with the reason after ``max_claims``.
UNKNOWN_ACTOR = """
UPDATE dramatiq.queue q
SET "state" = CASE WHEN q.claims >= %(max_claims)s OR q.cancelled_at IS NOT NULL THEN 'rejected'::dramatiq.state
                   ELSE 'queued'::dramatiq.state END,
    eta = now() + make_interval(secs => %(delay_s)s), worker_id = NULL, started_at = NULL, mtime = now(),
    error = CASE WHEN q.cancelled_at IS NOT NULL THEN """ + _CANCELLED_BY + """ || ': not run' ELSE %(error)s END
WHERE q.message_id = %(message_id)s
"""

#: Give claimed-but-not-started messages back to their queue, without blame, and wake
#: its consumers; one cancelled meanwhile is rejected instead, never to run.
REQUEUE = """
WITH requeued AS (
    UPDATE dramatiq.queue q
    SET "state" = (CASE WHEN q.cancelled_at IS NULL THEN 'queued' ELSE 'rejected' END)::dramatiq.state,
        error = CASE WHEN q.cancelled_at IS NULL THEN q.error ELSE """ + _CANCELLED_BY + """ || ': not run' END,
        worker_id = NULL, started_at = NULL, mtime = now()
    FROM unnest(%(ids)b::uuid[], %(claims)s::int[]) AS r(message_id, claims)
    WHERE q.message_id = r.message_id AND q.claims = r.claims AND q."state" = 'consumed'
      AND q.worker_id = %(worker_id)s
    RETURNING q.queue_name
)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM (SELECT DISTINCT queue_name FROM requeued) AS woken
"""

#: Register this process, or prove it alive: a heartbeat by the database's clock. A
#: process proves it is alive this way before it claims again after an outage.
#: A process's queues only grow while it lives; each consumer registers the ones known when
#: it connects, and two of them may commit out of order: the row keeps their union, so a
#: late commit of an older list never hides a queue the process serves.
HEARTBEAT = """
INSERT INTO standmeet.worker_processes AS w (id, hostname, pid, queues)
VALUES (%(worker_id)s, %(hostname)s, %(pid)s, %(queues)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), stopped_at = NULL,
    queues = ARRAY(SELECT DISTINCT q FROM unnest(w.queues || EXCLUDED.queues) AS q ORDER BY q)
"""
REGISTER_WORKER = HEARTBEAT

#: Which of some claims this process still holds (after it was cut off, to say which it lost).
STILL_HELD = """
SELECT q.message_id::text, q.claims FROM dramatiq.queue q
JOIN unnest(%(ids)b::uuid[], %(claims)s::int[]) AS h(message_id, claims)
  ON q.message_id = h.message_id AND q.claims = h.claims
WHERE q."state" = 'consumed' AND q.worker_id = %(worker_id)s
"""

#: A process that stepped down (cut off, not crashed) takes back what rescue laid on the
#: claims it lost: the crash counted on it (a message rejected for it alone goes back to
#: its queue) and the suspicion of its set. Returns how many messages were cleared. A
#: unique job whose key a live message holds meanwhile stays rejected (two live messages
#: of one key are what the unique index refuses).
CLEAR_BLAME = """
WITH cleared AS (
    UPDATE dramatiq.queue q
    SET crashes = CASE WHEN q.blamed_worker = %(worker_id)s::uuid THEN greatest(q.crashes - 1, 0) ELSE q.crashes END,
        blamed_worker = CASE WHEN q.blamed_worker = %(worker_id)s::uuid THEN NULL ELSE q.blamed_worker END,
        suspect_of = CASE WHEN q.suspect_of = %(worker_id)s::uuid THEN NULL ELSE q.suspect_of END,
        "state" = CASE WHEN q."state" = 'rejected' AND q.blamed_worker = %(worker_id)s::uuid AND q.cancelled_at IS NULL
                            AND NOT EXISTS (SELECT 1 FROM dramatiq.queue l WHERE l.unique_key = q.unique_key
                                            AND standmeet.unique_live(l.unique_states, l."state"))
                       THEN 'queued'::dramatiq.state ELSE q."state" END,
        error = CASE WHEN q."state" = 'rejected' AND q.blamed_worker = %(worker_id)s::uuid AND q.cancelled_at IS NULL
                          AND NOT EXISTS (SELECT 1 FROM dramatiq.queue l WHERE l.unique_key = q.unique_key
                                          AND standmeet.unique_live(l.unique_states, l."state"))
                     THEN NULL ELSE q.error END,
        mtime = now()
    WHERE q.message_id = ANY(%(ids)b::uuid[])
      AND (q.blamed_worker = %(worker_id)s::uuid OR q.suspect_of = %(worker_id)s::uuid)
    RETURNING q.queue_name, q."state"
)
SELECT count(*), count(pg_notify(standmeet.enqueue_channel(queue_name), '')) FILTER (WHERE "state" = 'queued')
FROM cleared
"""

#: A graceful stop: the process is recorded as stopped and every message it still holds
#: (a job cut off at the shutdown timeout) goes back to its queue without blame; one
#: cancelled is rejected instead, never to run again.
STOP_WORKER = """
WITH stopped AS (
    UPDATE standmeet.worker_processes SET stopped_at = now() WHERE id = %(worker_id)s RETURNING id
), requeued AS (
    UPDATE dramatiq.queue q
    SET "state" = (CASE WHEN q.cancelled_at IS NULL THEN 'queued' ELSE 'rejected' END)::dramatiq.state,
        error = CASE WHEN q.cancelled_at IS NULL THEN q.error
                     ELSE """ + _CANCELLED_BY + """ || ': its worker stopped while holding it; not run again' END,
        worker_id = NULL, started_at = NULL, mtime = now()
    FROM dramatiq.queue was
    WHERE q.worker_id = %(worker_id)s AND q."state" = 'consumed' AND was.message_id = q.message_id
    RETURNING q.queue_name, q.message_id, q.claims, q."state"::text AS state, was.started_at,
              q.message ->> 'actor_name' AS actor_name, q.error
), ran AS (
    SELECT message_id, claims AS attempt, queue_name, coalesce(actor_name, '') AS actor_name,
           %(worker_id)s::uuid AS worker_id, 'cut_at_shutdown' AS outcome, state, started_at, now() AS ended_at,
           CASE WHEN state = 'rejected' THEN error
                ELSE 'cut at shutdown: its worker stopped gracefully while it ran; it runs again, unblamed' END AS error,
           NULL::float8 AS wait_ms, NULL::float8 AS run_ms
    FROM requeued WHERE started_at IS NOT NULL
)""" + RECORD_RAN + """
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '')
FROM (SELECT DISTINCT queue_name FROM requeued) AS woken
"""

#: Crash rescue, judged by the database's clock only. The messages of processes that
#: stopped, or whose heartbeat is older than ``after_s``, go back to their queue:
#:   * never started (prefetched), or held by a process that stopped gracefully: no blame;
#:   * started by a process that died with only that one running, or a suspect (it was
#:     re-run with no other of its set beside it): a crash is counted, and past
#:     ``max_crashes`` it is rejected with the reason;
#:   * started beside others, no suspect among them: each becomes a suspect of that set,
#:     no crash counted; started beside a suspect: innocent, no blame;
#:   * cancelled (``jobs cancel`` while it ran): rejected, never run again.
#: A process never rescues its own claims (it lives: it is running this; its heartbeat
#: may only look old because its thread was held up).
#: Nothing is rescued within ``after_s`` of the server becoming this database's (its
#: start, or a standby's promotion: ``standmeet.server_epoch_since()``, migration 0017):
#: every process lost its connection then, and needs the time to prove it is alive.
RESCUE = """
WITH epoch AS MATERIALIZED (
    SELECT standmeet.server_epoch_since() AS since
), orphaned AS (
    SELECT q.message_id, q.worker_id, q.started_at IS NOT NULL AS started, q.suspect_of,
           coalesce(w.stopped_at IS NOT NULL, false) AS graceful, q.claims, q.started_at
    FROM dramatiq.queue q
    LEFT JOIN standmeet.worker_processes w ON w.id = q.worker_id
    WHERE q."state" = 'consumed' AND q.worker_id IS DISTINCT FROM %(worker_id)s::uuid
      AND (w.id IS NULL OR w.stopped_at IS NOT NULL
           OR w.heartbeat_at < now() - make_interval(secs => %(after_s)s))
      AND (SELECT since FROM epoch) < now() - make_interval(secs => %(after_s)s)
    FOR UPDATE OF q SKIP LOCKED
), per_worker AS (
    SELECT worker_id,
           count(*) FILTER (WHERE started) AS n_started,
           count(*) FILTER (WHERE started AND suspect_of IS NOT NULL) AS n_suspects
    FROM orphaned GROUP BY worker_id
), verdict AS (
    SELECT o.message_id, o.worker_id, o.graceful, o.claims, o.started_at,
           CASE WHEN o.graceful OR NOT o.started OR o.worker_id IS NULL THEN 'requeue'
                WHEN o.suspect_of IS NOT NULL THEN 'blame'
                WHEN p.n_suspects > 0 THEN 'requeue'
                WHEN p.n_started = 1 THEN 'blame'
                ELSE 'suspect' END AS verdict
    FROM orphaned o JOIN per_worker p ON p.worker_id IS NOT DISTINCT FROM o.worker_id
), rescued AS (
    UPDATE dramatiq.queue q
    SET crashes = q.crashes + (v.verdict = 'blame')::int,
        blamed_worker = CASE WHEN v.verdict = 'blame' THEN v.worker_id ELSE q.blamed_worker END,
        suspect_of = CASE WHEN v.verdict = 'suspect' THEN v.worker_id ELSE q.suspect_of END,
        worker_id = NULL, started_at = NULL, mtime = now(),
        "state" = CASE WHEN q.cancelled_at IS NOT NULL
                            OR (v.verdict = 'blame' AND q.crashes + 1 > %(max_crashes)s)
                       THEN 'rejected'::dramatiq.state ELSE 'queued'::dramatiq.state END,
        error = CASE WHEN q.cancelled_at IS NOT NULL
                     THEN """ + _CANCELLED_BY + """ || ': its worker process died holding it; not run again'
                     WHEN v.verdict = 'blame' AND q.crashes + 1 > %(max_crashes)s
                     THEN 'rejected: its worker process died while running it '
                          || (q.crashes + 1) || ' times'
                     ELSE q.error END
    FROM verdict v
    WHERE q.message_id = v.message_id
    RETURNING q.queue_name, q."state", v.verdict, q.message_id, v.claims, v.started_at, v.graceful,
              v.worker_id AS held_by, q.message ->> 'actor_name' AS actor_name, q.error
), ran AS (
    SELECT message_id, claims AS attempt, queue_name, coalesce(actor_name, '') AS actor_name, held_by AS worker_id,
           CASE WHEN graceful THEN 'cut_at_shutdown' ELSE 'crashed' END AS outcome, "state"::text AS state,
           started_at, now() AS ended_at,
           CASE WHEN graceful THEN 'its worker process stopped while running it; rescued, unblamed'
                WHEN verdict = 'blame' THEN 'its worker process died or fell silent while running it; rescued, crash counted'
                WHEN verdict = 'suspect' THEN 'its worker process died or fell silent while running it beside others; '
                                              'rescued as a suspect, to run alone'
                ELSE 'its worker process died or fell silent while running it; rescued, unblamed' END
           || CASE WHEN "state" = 'rejected' THEN '; ' || coalesce(error, 'rejected') ELSE '' END AS error,
           NULL::float8 AS wait_ms, NULL::float8 AS run_ms
    FROM rescued WHERE started_at IS NOT NULL
)""" + RECORD_RAN + """
SELECT queue_name,
       count(*) FILTER (WHERE "state" = 'queued') AS requeued,
       count(*) FILTER (WHERE "state" = 'rejected') AS rejected,
       count(*) FILTER (WHERE verdict = 'suspect') AS suspects,
       pg_notify(standmeet.enqueue_channel(queue_name), '')
FROM rescued
GROUP BY queue_name
"""

#: What ``join`` waits for: messages of a queue not yet finished (queued, delayed or running).
OUTSTANDING = """
SELECT count(*) FROM dramatiq.queue WHERE queue_name = %(queue)s AND "state" IN ('queued', 'consumed')
"""

#: ``flush``: drop the messages of some queues that wait (queued or delayed).
FLUSH = """
DELETE FROM dramatiq.queue WHERE queue_name = ANY(%(queues)s::text[]) AND "state" = 'queued'
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

#: Channel the relay listens on; emit notifies it (at commit).
OUTBOX_CHANNEL = "standmeet_outbox"

EMIT = """
WITH inserted AS (
    INSERT INTO standmeet.outbox (topic, payload) VALUES (%(topic)s, %(payload)s::jsonb)
    RETURNING id
)
SELECT id, pg_notify(standmeet.outbox_channel(), '') FROM inserted
"""

PRUNE_OUTBOX = """
DELETE FROM standmeet.outbox
WHERE id IN (
    SELECT id FROM standmeet.outbox
    WHERE relayed_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
)
"""

#: Queued messages whose work another job did (a webhook batch made their deliveries):
#: done without running, only while still queued and not cancelled (one a consumer
#: claimed runs, and finds its work made); receipts as in SETTLE.
FINISH_QUEUED = """
WITH settled AS (
    UPDATE dramatiq.queue SET "state" = 'done', error = NULL, mtime = now()
    WHERE message_id = ANY(%(ids)b::uuid[]) AND "state" = 'queued' AND cancelled_at IS NULL
    RETURNING queue_name, message_id, 'done' AS state
)""" + RECEIPTS_OF_SETTLED

#: Write messages that carry a unique key (migration 0021), in one statement: each is
#: inserted unless its id exists or a message holds its key in a covered state (the
#: partial unique index ``queue_unique_key_idx`` decides, atomically, whatever other
#: transactions send at once; a duplicate inside the batch loses to the first). Returns
#: the ids written and wakes their queues (one NOTIFY per queue at commit). Who holds a
#: key that was not written is read by UNIQUE_LIVE, in a statement of its own: only a
#: new statement sees what a concurrent sender committed.
ENQUEUE_UNIQUE = """
WITH enqueued AS (
    INSERT INTO dramatiq.queue AS q
        (queue_name, message_id, "state", message, eta, enqueued_at, mtime, priority, unique_key, unique_states)
    SELECT m.body ->> 'queue_name', (m.body ->> 'message_id')::uuid, 'queued', m.body,
           now() + make_interval(secs => %(delay_s)s::float8), now(), now(), m.priority,
           standmeet.unique_key_at(m.unique_key, m.period_s), m.states
    FROM ROWS FROM (jsonb_array_elements(%(messages)s::jsonb), unnest(%(priorities)s::int[]),
                    unnest(%(unique_keys)b::bytea[]), unnest(%(unique_periods)s::float8[]),
                    unnest(%(unique_states)s::int2[])) AS m(body, priority, unique_key, period_s, states)
    ON CONFLICT DO NOTHING
    RETURNING q.queue_name, q.message_id
)
SELECT message_id::text, pg_notify(standmeet.enqueue_channel(queue_name), '') FROM enqueued
"""

#: For each message ENQUEUE_UNIQUE did not write (``n``: its place in the arrays, from
#: 1): the message that holds its key now (id and text; NULL if none: it finished in
#: between) and whether a row with its own id exists.
UNIQUE_LIVE = """
SELECT k.n::int, live.message_id::text, live.message::text,
       EXISTS (SELECT 1 FROM dramatiq.queue o WHERE o.message_id = k.message_id)
FROM unnest(%(ids)b::uuid[], %(unique_keys)b::bytea[], %(unique_periods)s::float8[])
     WITH ORDINALITY AS k(message_id, key, period_s, n)
LEFT JOIN LATERAL (
    SELECT q.message_id, q.message FROM dramatiq.queue q
    WHERE q.unique_key = standmeet.unique_key_at(k.key, k.period_s)
      AND standmeet.unique_live(q.unique_states, q."state")
    LIMIT 1
) AS live ON true
"""

#: Count sends skipped because their key was live, per queue and actor, with the time of
#: the last. Written on the sender's own autocommit connection, never in a caller's
#: transaction (which would hold the row's lock until it ends); rows in a fixed order.
UNIQUE_SKIPPED = """
INSERT INTO standmeet.unique_skips AS s (queue_name, actor_name, skipped, last_skipped_at)
SELECT c.queue_name, c.actor_name, c.n, now()
FROM unnest(%(queues)b::text[], %(actors)b::text[], %(counts)s::int8[]) AS c(queue_name, actor_name, n)
ORDER BY c.queue_name, c.actor_name
ON CONFLICT (queue_name, actor_name) DO UPDATE
SET skipped = s.skipped + EXCLUDED.skipped, last_skipped_at = now()
"""
