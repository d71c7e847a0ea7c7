"""The statements that write message rows into ``dramatiq.queue``: the only SQL that
inserts or copies a message (sends, batches, unique sends, the relay's messages, and the
messages a settled run sent from its after-hooks, as a fragment of ``broker.engine.sql.SETTLE``).

Only the writer, :mod:`broker.engine.enqueue`, executes them (the settle statement that
embeds :data:`FOLLOWUPS_OF_SETTLED` is the settler's, with parameters the writer makes);
a test holds that no other module of the runtime spells such an INSERT or COPY. Conventions as in
:mod:`broker.engine.sql` (placeholders, binary text arrays); consumers are woken through
``standmeet.enqueue_channel(queue)``, whose name is :data:`broker.engine.sql.ENQUEUE_CHANNEL`.
"""

from __future__ import annotations

#: What ENQUEUE does with an id that exists: a queued message takes the new one whole (its
#: text, queue, due time, priority, and no unique key of the old); one that is running or
#: has finished is never resurrected (a re-relayed event cannot run its job twice).
_ON_CONFLICT_KEEP_STARTED = """    ON CONFLICT (message_id) DO UPDATE SET
        queue_name = EXCLUDED.queue_name, message = EXCLUDED.message, eta = EXCLUDED.eta,
        priority = EXCLUDED.priority, unique_key = EXCLUDED.unique_key, unique_states = EXCLUDED.unique_states,
        mtime = now()
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

#: Copy a batch of messages whose ids are all new, as fresh Dramatiq messages' are, due
#: now: the rows of :class:`broker.engine.copy_rows.CopyBatch` (COPY's text format), a
#: chunk at a time, in one statement that holds none of them whole. Postgres parses each
#: message once and inserts the rows in bulk, without the JSON array, its elements and the
#: speculative insertion ENQUEUE makes of every row; ``eta``, ``enqueued_at`` and
#: ``mtime`` take their default, the transaction's ``now()``, as ENQUEUE's do. One id that
#: exists fails the whole copy with a unique violation (ENQUEUE then writes the batch, in
#: the same savepoint or transaction, rolled back first): a clash costs the server an
#: error line in its log and the rows copied before it (dead until vacuumed). Wake the
#: queues with WAKE_QUEUES in the same transaction.
COPY_QUEUED = 'COPY dramatiq.queue (queue_name, message_id, "state", message, priority) FROM STDIN'

#: COPY_QUEUED for a batch due later: each row ends with its ``eta``, the text of
#: ETA_AFTER read in the same transaction.
COPY_QUEUED_AT = 'COPY dramatiq.queue (queue_name, message_id, "state", message, priority, eta) FROM STDIN'

#: When a batch copied in this transaction is due: ``now() + delay_s``, the same instant
#: ENQUEUE writes, as ISO 8601 text with its offset (JSON's form of a timestamptz: read
#: back unchanged whatever the session's DateStyle and TimeZone).
ETA_AFTER = "SELECT to_json(now() + make_interval(secs => %(delay_s)s::float8)) #>> '{}'"

#: Wake the consumers of ``queues`` (one NOTIFY per queue, sent at commit), as ENQUEUE
#: wakes the queues it wrote to.
WAKE_QUEUES = "SELECT pg_notify(standmeet.enqueue_channel(q), '') FROM unnest(%(queues)s::text[]) AS q"

#: A batch written in a transaction the writer does not own is written under a savepoint:
#: a copy that meets an existing id (or fails) is rolled back alone, and the caller's
#: transaction stays usable.
SAVEPOINT = "SAVEPOINT standmeet_enqueue"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT standmeet_enqueue"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT standmeet_enqueue"

#: ENQUEUE for one message, with plain parameters: a single send dumps no arrays and
#: unnests nothing (the same rules: an existing id is never resurrected).
ENQUEUE_ONE = """
WITH enqueued AS (
    INSERT INTO dramatiq.queue AS q
        (queue_name, message_id, "state", message, eta, enqueued_at, mtime, priority)
    VALUES (%(queue)s, %(message_id)s::uuid, 'queued', %(message)s::jsonb,
            now() + make_interval(secs => %(delay_s)s::float8), now(), now(), %(priority)s::int)
""" + _ON_CONFLICT_KEEP_STARTED + """
    RETURNING q.queue_name
)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM enqueued
"""

#: The messages that runs settled in the same statement sent from their after-hooks
#: (pipelines, callbacks): a CTE ``followed`` of ``broker.engine.sql.SETTLE``, written only
#: for claims the statement settled (its CTE ``settled``), never over an existing id. One
#: with a unique key holds it when no live message does (``followed_keyed``, against the
#: partial unique index, as a send); one whose key a live message holds is written all the
#: same, without it (``followed_plain``): a pipeline is never cut by a key.
#: Parameters: :func:`broker.engine.codec.followup_params`.
FOLLOWUPS_OF_SETTLED = """, sent_by_settled AS MATERIALIZED (
    SELECT f.* FROM unnest(%(f_parents)b::uuid[], %(f_queues)b::text[], %(f_ids)b::uuid[], %(f_messages)b::jsonb[],
                           %(f_delays)s::float8[], %(f_priorities)s::int[], %(f_unique_keys)b::text[],
                           %(f_unique_periods)s::float8[], %(f_unique_states)s::int2[])
         AS f(parent_id, queue_name, message_id, message, delay_s, priority, unique_key_hex, period_s, states)
    WHERE f.parent_id IN (SELECT message_id FROM settled)
), followed_keyed AS (
    INSERT INTO dramatiq.queue AS q
        (queue_name, message_id, "state", message, eta, enqueued_at, mtime, priority, unique_key, unique_states)
    SELECT f.queue_name, f.message_id, 'queued', f.message,
           now() + make_interval(secs => f.delay_s), now(), now(), f.priority,
           standmeet.unique_key_at(decode(f.unique_key_hex, 'hex'), f.period_s), f.states
    FROM sent_by_settled f
    WHERE f.unique_key_hex IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING q.queue_name, q.message_id
), followed_plain AS (
    INSERT INTO dramatiq.queue AS q
        (queue_name, message_id, "state", message, eta, enqueued_at, mtime, priority)
    SELECT f.queue_name, f.message_id, 'queued', f.message,
           now() + make_interval(secs => f.delay_s), now(), now(), f.priority
    FROM sent_by_settled f
    WHERE f.message_id NOT IN (SELECT message_id FROM followed_keyed)
    ON CONFLICT (message_id) DO NOTHING
    RETURNING q.queue_name
), followed AS (
    SELECT queue_name FROM followed_keyed UNION ALL SELECT queue_name FROM followed_plain
)"""

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
