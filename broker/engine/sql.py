"""SQL of the broker's claims, settles, give-backs, liveness and rescue, as module-level
constants (never built from values); the statements that write message rows are in
:mod:`broker.engine.sql_enqueue`, those of the runs' history in
:mod:`broker.engine.sql_history`.

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

from broker.engine import queues
from broker.engine.sql_enqueue import FOLLOWUPS_OF_SETTLED
from broker.engine.sql_history import RAN_OF_SETTLED, RECORD_RAN
from broker.pg.liveness import rescue_window

#: A queue's channels (:mod:`broker.engine.queues`, which holds a queue's name to their length).
ENQUEUE_CHANNEL, RECEIPT_CHANNEL = queues.ENQUEUE_CHANNEL, queues.RECEIPT_CHANNEL

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
#: A cancel that reached the run in time: made before the run ended (its end by the
#: database's clock: the settle's ``now()`` less how long ago the run ended, ``o.ended_ago``).
#: A cancel made once the run had returned comes too late: the run is recorded as it ended.
_CANCELLED_IN_TIME = ("(q.cancelled_at IS NOT NULL"
                      " AND q.cancelled_at < now() - make_interval(secs => coalesce(o.ended_ago, 0)))")

#: Whether an operator's cancel decides a settled run's outcome: always for a run that is
#: to run again (a retry, no outcome: it is rejected, not retried), and for a run that
#: returned only when the cancel was made in time (:data:`_CANCELLED_IN_TIME`).
_CANCEL_APPLIES = ("(" + _CANCELLED_IN_TIME
                   + " OR (q.cancelled_at IS NOT NULL AND o.outcome IN ('queued', 'rerun')))")

#: A cancelled message never takes its unique key back (the cancel freed it: the same call
#: sent again may hold it now): recorded done, too late for the cancel, it drops the bit by
#: which a done message holds its key (4, ``unique.UNIQUE_DONE``).
_CANCELLED_HOLDS_NO_KEY = ("CASE WHEN q.cancelled_at IS NOT NULL THEN q.unique_states & ~4::smallint"
                           " ELSE q.unique_states END")

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


#: How long after the client sends it a claim may still claim (:data:`CLAIM`; the server's
#: clock, read by every heartbeat, sets the deadline). A claim a client gave up on (a
#: pooler holding it while its server connections are busy, or the server waiting for a
#: lock) therefore commits, if it ever does, within this window of the failure: behind a
#: pooler, where that server session cannot be ended, what the process holds is checked
#: again once the window has passed (broker.engine.consumer). Far above a claim's time:
#: a claim that took longer claims nothing, and the next one is made.
CLAIM_WITHIN_S = 5.0

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
#: A claim claims only until ``claim_until_s`` (by the server's clock, in seconds since the
#: epoch; NULL: no bound), which the client sets CLAIM_WITHIN_S after it sends the claim:
#: one that reaches the server later (held by a pooler) or waited longer (for a lock)
#: claims nothing.
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
  AND clock_timestamp() < coalesce(to_timestamp(%(claim_until_s)s::float8), 'infinity')
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


#: A claim's row ``q``, found by its message id (the primary key), is still claimed.
#: Written so that no plan reads the claimed rows' index (partial, on the consumed rows:
#: every process's claims) to find it: the planner, counting few claimed rows (statistics
#: behind a drain), scanned them all for each outcome of a batch, then compared each
#: with every outcome (a settle of 100 outcomes made 15,000 comparisons; more with each
#: process beside it).
STILL_CLAIMED = "q.\"state\"::text = 'consumed'"

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
                        WHEN """ + _CANCEL_APPLIES + """ THEN 'rejected'
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
        error = CASE WHEN """ + _CANCEL_APPLIES + """
                          THEN """ + _CANCELLED_BY + """ || CASE o.outcome
                               WHEN 'done' THEN ': its run returned after the cancellation'
                               WHEN 'rerun' THEN ': its run ended with no outcome; not run again'
                               WHEN 'rejected' THEN ': its run was stopped'
                               ELSE ': not retried' END
                     WHEN o.outcome = 'rejected' THEN o.error
                     WHEN o.outcome = 'rerun' AND q.runs_without_outcome + 1 >= %(max_runs_without_outcome)s
                          THEN 'rejected: ' || (q.runs_without_outcome + 1) || ' runs ended with no outcome'
                               || ' (STANDMEET_MAX_RUNS_WITHOUT_OUTCOME); the last: ' || coalesce(o.error, 'no reason given')
                     WHEN o.outcome = 'done' THEN NULL
                     ELSE q.error END,
        unique_states = """ + _CANCELLED_HOLDS_NO_KEY + """,
        worker_id = NULL, started_at = NULL, mtime = now()
    FROM outcome o, dramatiq.queue was
    WHERE q.message_id = o.message_id AND q.claims = o.claims AND """ + STILL_CLAIMED + """
      AND q.worker_id IS NOT DISTINCT FROM %(worker_id)s::uuid
      AND was.message_id = o.message_id
    RETURNING q.queue_name, q.message_id, q."state"::text AS state, """ + _CANCEL_APPLIES + """ AS cancelled,
              q.claims, was.eta AS due_at, o.actor_name, o.started_ago, o.ended_ago, o.hint,
              CASE WHEN """ + _CANCEL_APPLIES + """ OR (o.outcome = 'rerun' AND q."state" = 'rejected') THEN q.error
                   ELSE o.error END AS run_error
)""" + FOLLOWUPS_OF_SETTLED + RAN_OF_SETTLED + RECORD_RAN + RECEIPTS_OF_SETTLED + """UNION ALL
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
    WHERE q.message_id = s.message_id AND q.claims = s.claims AND """ + STILL_CLAIMED + """ AND q.worker_id = %(worker_id)s
      AND q.started_at IS NULL
), settled AS (
    UPDATE dramatiq.queue q
    SET "state" = (CASE WHEN """ + _CANCELLED_IN_TIME + """ THEN 'rejected' ELSE 'done' END)::dramatiq.state,
        error = CASE WHEN """ + _CANCELLED_IN_TIME + """
                     THEN """ + _CANCELLED_BY + """ || ': its run returned after the cancellation' END,
        unique_states = """ + _CANCELLED_HOLDS_NO_KEY + """,
        worker_id = NULL, started_at = NULL, mtime = now()
    FROM ran_here o
    WHERE q.message_id = o.message_id AND q.claims = o.claims AND """ + STILL_CLAIMED + """
      AND q.worker_id IS NOT DISTINCT FROM %(worker_id)s::uuid
    RETURNING q.queue_name, q.message_id, q."state"::text AS state, """ + _CANCELLED_IN_TIME + """ AS cancelled,
              q.claims, q.eta AS due_at, o.actor_name, o.started_ago, o.ended_ago, 'done' AS hint, q.error AS run_error
)""" + RAN_OF_SETTLED + RECORD_RAN + RECEIPTS_OF_SETTLED

#: Record that prefetched claims have started running (they can now be blamed for a
#: crash of their process).
MARK_STARTED = """
UPDATE dramatiq.queue q SET started_at = now()
FROM unnest(%(ids)b::uuid[], %(claims)s::int[]) AS s(message_id, claims)
WHERE q.message_id = s.message_id AND q.claims = s.claims AND """ + STILL_CLAIMED + """ AND q.worker_id = %(worker_id)s
  AND q.started_at IS NULL
"""

#: The claim ``%(claims)s`` of row ``q`` by this process, still held: what a statement
#: about a claim this process just made acts on (a claim rescued and taken by another
#: process meanwhile, had this one stalled past the rescue window, is not this one's).
_THIS_CLAIM = "q.claims = %(claims)s AND " + STILL_CLAIMED + " AND q.worker_id = %(worker_id)s"

#: A claimed row that cannot be run as it is (not a Dramatiq message, or one whose text
#: disagrees with its own row): rejected by its row id, with the reason.
REJECT_MALFORMED = """
UPDATE dramatiq.queue q SET "state" = 'rejected', worker_id = NULL, started_at = NULL, mtime = now(),
    error = %(error)s
WHERE q.message_id = %(message_id)s AND """ + _THIS_CLAIM + """
"""

#: A message for an actor this process does not have (a rolling deploy?): back to the
#: queue for a later or other worker, and rejected with the reason after ``max_claims``.
UNKNOWN_ACTOR = """
UPDATE dramatiq.queue q
SET "state" = CASE WHEN q.claims >= %(max_claims)s OR q.cancelled_at IS NOT NULL THEN 'rejected'::dramatiq.state
                   ELSE 'queued'::dramatiq.state END,
    eta = now() + make_interval(secs => %(delay_s)s), worker_id = NULL, started_at = NULL, mtime = now(),
    error = CASE WHEN q.cancelled_at IS NOT NULL THEN """ + _CANCELLED_BY + """ || ': not run' ELSE %(error)s END
WHERE q.message_id = %(message_id)s AND """ + _THIS_CLAIM + """
"""

#: An outcome the database refuses for what its own row holds (a unique, check or data
#: error), written alone: set aside, rejected with the reason, so that it blocks no other
#: outcome of the process and does not run again unseen; an operator may retry it. Only
#: if it is still the claim it names.
SET_ASIDE_OUTCOME = """
UPDATE dramatiq.queue q
SET "state" = 'rejected', error = %(error)s, worker_id = NULL, started_at = NULL, mtime = now()
WHERE q.message_id = %(message_id)s AND q.claims = %(claims)s AND """ + STILL_CLAIMED + """
  AND q.worker_id = %(worker_id)s
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
    WHERE q.message_id = r.message_id AND q.claims = r.claims AND """ + STILL_CLAIMED + """
      AND q.worker_id = %(worker_id)s
    RETURNING q.queue_name
)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM (SELECT DISTINCT queue_name FROM requeued) AS woken
"""

#: Register this process, or prove it alive: a heartbeat by the database's clock, with the
#: rescue window it was started with (:func:`rescue_window`). A process proves it is
#: alive this way before it claims again after an outage.
#: A process's queues only grow while it lives; each consumer registers the ones known when
#: it connects, and two of them may commit out of order: the row keeps their union, so a
#: late commit of an older list never hides a queue the process serves. Returns since when
#: the answering server has been the database's (:data:`RESCUE`'s epoch): a new value
#: means a restart or a failover, which may have lost outcomes this process wrote; and the
#: server's clock (seconds since the epoch), which claims' deadlines are set by.
HEARTBEAT = """
INSERT INTO standmeet.worker_processes AS w (id, hostname, pid, queues, rescue_after_s)
VALUES (%(worker_id)s, %(hostname)s, %(pid)s, %(queues)s, %(rescue_after_s)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), stopped_at = NULL, rescue_after_s = EXCLUDED.rescue_after_s,
    queues = ARRAY(SELECT DISTINCT q FROM unnest(w.queues || EXCLUDED.queues) AS q ORDER BY q)
RETURNING standmeet.server_epoch_since(), extract(epoch FROM clock_timestamp())::float8
"""

#: Which of some claims this process still holds (after it was cut off, to say which it lost).
STILL_HELD = """
SELECT q.message_id::text, q.claims FROM dramatiq.queue q
JOIN unnest(%(ids)b::uuid[], %(claims)s::int[]) AS h(message_id, claims)
  ON q.message_id = h.message_id AND q.claims = h.claims
WHERE q."state" = 'consumed' AND q.worker_id = %(worker_id)s
"""

#: Every claim the database says this process holds (the index of every claim, by worker).
HELD_HERE = """
SELECT q.message_id::text, q.claims, q.queue_name FROM dramatiq.queue q
WHERE q."state" = 'consumed' AND q.worker_id = %(worker_id)s
"""

#: Who a claim connection's session is on the server (direct connections): found again
#: by :data:`END_ABANDONED_SESSION` once the connection is given up.
SESSION_OF = "SELECT pg_backend_pid(), backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
#: A claim connection given up on (its client saw it fail) may still be running a claim on
#: the server (waiting for a lock, or not yet told its client is gone): that session is
#: ended, and its end waited for up to ``timeout_ms``, so the claim has committed or rolled
#: back before the process checks what it holds. Only the same session (its start too: a
#: process id is reused). True once it has ended, false if it did not end in time; no row
#: when it was gone already.
END_ABANDONED_SESSION = """
SELECT pg_terminate_backend(pid, %(timeout_ms)s) FROM pg_stat_activity
WHERE pid = %(pid)s AND backend_start = %(started)s
"""

#: A process that stepped down (cut off, not crashed) takes back what rescue laid on the
#: claims it lost (``ids`` with their ``claims``): the crash counted on it (a message
#: rejected for it alone goes back to its queue) and the suspicion of its set. Returns
#: how many messages were cleared. Only a message rescue rejected goes back: one claimed
#: again since (its claim number moved on) and rejected by the run that followed keeps
#: that run's outcome and reason. A unique job whose key a live message holds meanwhile
#: stays rejected (two live messages of one key are what the unique index refuses).
CLEAR_BLAME = """
WITH cleared AS (
    UPDATE dramatiq.queue q
    SET crashes = CASE WHEN q.blamed_worker = %(worker_id)s::uuid THEN greatest(q.crashes - 1, 0) ELSE q.crashes END,
        blamed_worker = CASE WHEN q.blamed_worker = %(worker_id)s::uuid THEN NULL ELSE q.blamed_worker END,
        suspect_of = CASE WHEN q.suspect_of = %(worker_id)s::uuid THEN NULL ELSE q.suspect_of END,
        "state" = CASE WHEN q."state" = 'rejected' AND q.blamed_worker = %(worker_id)s::uuid AND q.cancelled_at IS NULL
                            AND q.claims = h.claims AND NOT EXISTS (SELECT 1 FROM dramatiq.queue l WHERE l.unique_key = q.unique_key
                                            AND standmeet.unique_live(l.unique_states, l."state"))
                       THEN 'queued'::dramatiq.state ELSE q."state" END,
        error = CASE WHEN q."state" = 'rejected' AND q.blamed_worker = %(worker_id)s::uuid AND q.cancelled_at IS NULL
                          AND q.claims = h.claims AND NOT EXISTS (SELECT 1 FROM dramatiq.queue l WHERE l.unique_key = q.unique_key
                                          AND standmeet.unique_live(l.unique_states, l."state"))
                     THEN NULL ELSE q.error END,
        mtime = now()
    FROM unnest(%(ids)b::uuid[], %(claims)s::int[]) AS h(message_id, claims)
    WHERE q.message_id = h.message_id
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
#: stopped, or whose heartbeat is older than their rescue window (``after_s``, or the
#: longer one the process recorded: :func:`rescue_window`), go back to their queue:
#:   * never started (prefetched), or held by a process that stopped gracefully: no blame;
#:   * started by a process that died with only that one running, or a suspect (it was
#:     re-run with no other of its set beside it): a crash is counted, and past
#:     ``max_crashes`` it is rejected with the reason;
#:   * started beside others, no suspect among them: each becomes a suspect of that set,
#:     no crash counted; started beside a suspect: innocent, no blame;
#:   * cancelled (``jobs cancel`` while it ran): rejected, never run again.
#: A process never rescues its own claims (it lives: it is running this; its heartbeat
#: may only look old because its thread was held up).
#: The orphans are judged from the statement's snapshot (``judged``), then locked only
#: as judged: the same claim of the same process, still running. A claim that changed
#: meanwhile (given back, and claimed by a live process) is left alone: locked in the
#: judging query itself, Postgres would check the newer row against the dead process's
#: row through the outer join, find no match, and take the live claim for one whose
#: process is gone. A dead process's started runs are judged together, as a set, only
#: when every one of them was locked by this pass (a row locked elsewhere, by another
#: rescuer or an operator's cancel, leaves the set to the next pass): judged on a part
#: of the set, one of two runs would be blamed alone, then the other.
#: Nothing is rescued within that window of the server becoming this database's (its
#: start, or a standby's promotion: ``standmeet.server_epoch_since()``, migration 0017):
#: every process lost its connection then, and needs the time to prove it is alive.
RESCUE = """
WITH epoch AS MATERIALIZED (
    SELECT standmeet.server_epoch_since() AS since
), judged AS MATERIALIZED (
    SELECT q.message_id, q.worker_id, q.started_at IS NOT NULL AS started, q.suspect_of,
           coalesce(w.stopped_at IS NOT NULL, false) AS graceful, q.claims, q.started_at
    FROM dramatiq.queue q
    LEFT JOIN standmeet.worker_processes w ON w.id = q.worker_id
    WHERE q."state" = 'consumed' AND q.worker_id IS DISTINCT FROM %(worker_id)s::uuid
      AND (w.id IS NULL OR w.stopped_at IS NOT NULL
           OR w.heartbeat_at < now() - """ + rescue_window("w", "after_s") + """)
      AND (SELECT since FROM epoch) < now() - """ + rescue_window("w", "after_s") + """
), orphaned AS (
    SELECT j.* FROM judged j
    JOIN dramatiq.queue q ON q.message_id = j.message_id AND q.claims = j.claims
                         AND q.worker_id IS NOT DISTINCT FROM j.worker_id AND q."state" = 'consumed'
    FOR UPDATE OF q SKIP LOCKED
), per_worker AS (
    SELECT worker_id,
           count(*) FILTER (WHERE started) AS n_started,
           count(*) FILTER (WHERE started AND suspect_of IS NOT NULL) AS n_suspects,
           count(*) AS n_judged
    FROM judged GROUP BY worker_id
), locked AS (
    SELECT worker_id, count(*) AS n_locked FROM orphaned GROUP BY worker_id
), verdict AS (
    SELECT o.message_id, o.worker_id, o.graceful, o.claims, o.started_at,
           CASE WHEN o.graceful OR NOT o.started OR o.worker_id IS NULL THEN 'requeue'
                WHEN o.suspect_of IS NOT NULL THEN 'blame'
                WHEN p.n_suspects > 0 THEN 'requeue'
                WHEN p.n_started = 1 THEN 'blame'
                ELSE 'suspect' END AS verdict
    FROM orphaned o
    JOIN per_worker p ON p.worker_id IS NOT DISTINCT FROM o.worker_id
    JOIN locked l ON l.worker_id IS NOT DISTINCT FROM o.worker_id
    WHERE l.n_locked = p.n_judged OR o.graceful OR NOT o.started OR o.worker_id IS NULL
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

#: Delete one batch of finished messages older than the retention. The outer condition
#: is checked again on a row changed while the statement waited for it: a job an operator
#: retried meanwhile (queued again, as the batch's snapshot did not see) is kept.
PRUNE_FINISHED = """
DELETE FROM dramatiq.queue
WHERE message_id IN (
    SELECT message_id FROM dramatiq.queue
    WHERE "state" IN ('done', 'rejected')
      AND mtime < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
)
  AND "state" IN ('done', 'rejected')
  AND mtime < now() - make_interval(secs => %(retention_s)s)
"""

#: Channel the relay listens on; emit notifies it (at commit).
OUTBOX_CHANNEL = "standmeet_outbox"

EMIT = """
WITH inserted AS (
    INSERT INTO standmeet.outbox (topic, payload, routes) VALUES (%(topic)s, %(payload)s::jsonb, %(routes)s::jsonb)
    RETURNING id
)
SELECT id, pg_notify(standmeet.outbox_channel(), '') FROM inserted
"""

#: Delete one batch of relayed events older than the retention (the outer condition is
#: checked again on a row changed while the statement waited for it).
PRUNE_OUTBOX = """
DELETE FROM standmeet.outbox
WHERE id IN (
    SELECT id FROM standmeet.outbox
    WHERE relayed_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
)
  AND relayed_at < now() - make_interval(secs => %(retention_s)s)
"""

#: A message whose work another job did (a batch that did its too), inside a statement of
#: the caller's own that records that work, so that it is done exactly when that work is
#: recorded: a queued one is done without running (rejected, ``%(finish_error)s`` its error,
#: when that work failed for good); a running one (claimed a moment ago:
#: its run may be about to snooze, waiting for the job that did the work) is marked woken
#: (``woken_at``), so that a snooze it settles makes it due at once and its next run finds
#: its work made. Neither when cancelled. One UPDATE for both states: a row whose state
#: changes while the statement waits for its lock (a running one's snooze settling) is
#: judged again as it is then; with one update per state, each read it as the other's
#: and left it, and it waited out its whole snooze. A CTE, ``finished``
#: (``%(finish)s``: the message; NULL for none; ``ended_as`` its state now), and the SELECT that
#: sends its receipt when its queue is awaited (``%(finish_receipt)s``), for the
#: statement's end. Scalar parameters: a one-element array costs the caller ~15 times a
#: value's CPU.
FINISH_ONE_QUEUED = """finished AS (
    UPDATE dramatiq.queue
    SET "state" = CASE WHEN "state" <> 'queued' THEN "state" WHEN %(finish_error)s::text IS NULL THEN 'done'
                       ELSE 'rejected' END,
        error = CASE WHEN "state" = 'queued' THEN %(finish_error)s::text ELSE error END,
        woken_at = CASE WHEN "state" = 'consumed' THEN now() ELSE woken_at END,
        mtime = now()
    WHERE message_id = %(finish)s::uuid AND "state" IN ('queued', 'consumed') AND cancelled_at IS NULL
    RETURNING queue_name, message_id, "state"::text AS ended_as
)"""
RECEIPT_OF_FINISHED = """
SELECT pg_notify(standmeet.receipt_channel(queue_name), message_id::text || ':' || ended_as)
FROM finished WHERE ended_as <> 'consumed' AND %(finish_receipt)s::boolean
"""

