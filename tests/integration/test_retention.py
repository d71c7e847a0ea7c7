"""Retention: finished messages are pruned after their age, in batches, by a maintenance job."""

from __future__ import annotations

import threading

import dramatiq
import psycopg

from broker.engine import sql, sql_enqueue
from broker.engine.codec import enqueue_params
from broker.settings import replace
from tests.support.db import lock_waits, query, wait_for
from tests.support.jobs import mark


def test_old_finished_messages_are_pruned_in_batches_and_the_rest_kept(broker, database_url, start_worker):
    # Given 7 old done/rejected messages, a recent done one and an old queued one
    messages = [mark.message(f"retention-{i}") for i in range(9)]
    with psycopg.connect(database_url, autocommit=True) as conn:
        for m in messages:
            conn.execute(sql_enqueue.ENQUEUE, enqueue_params([m]))
        ids = [m.message_id for m in messages]
        conn.execute("UPDATE dramatiq.queue SET state = 'done', mtime = now() - interval '30 days' WHERE message_id = ANY(%s::uuid[])", (ids[:5],))
        conn.execute("UPDATE dramatiq.queue SET state = 'rejected', mtime = now() - interval '30 days' WHERE message_id = ANY(%s::uuid[])", (ids[5:7],))
        conn.execute("UPDATE dramatiq.queue SET state = 'done' WHERE message_id = %s", (ids[7],))
        conn.execute("UPDATE dramatiq.queue SET state = 'queued', queue_name = 'maintenance', eta = now() + interval '1 day',"
                     " mtime = now() - interval '30 days' WHERE message_id = %s", (ids[8],))
        # and the rows of a worker process stopped two days ago, and of one stopped just now
        conn.execute("INSERT INTO standmeet.worker_processes (id, hostname, pid, queues, heartbeat_at, stopped_at) VALUES"
                     " ('00000000-0000-0000-0000-0000000000aa', 'h', 1, '{index}', now() - interval '2 days',"
                     "  now() - interval '2 days'),"
                     " ('00000000-0000-0000-0000-0000000000bb', 'h', 2, '{index}', now(), now())")
    # When the maintenance job runs with a batch of 2
    broker.settings = replace(broker.settings, prune_batch=2)
    start_worker(queues=["maintenance"], threads=1)
    job = dramatiq.get_broker().get_actor("maintenance.prune_messages").send()
    wait_for(lambda: query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                           (job.message_id,)) == [("done",)], timeout_s=15, what="the prune job")
    # Then the old finished ones are gone, the recent and the unfinished are kept
    left = {row[0] for row in query(database_url, "SELECT message_id::text FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,))}
    assert left == {ids[7], ids[8]}
    workers = {r[0] for r in query(database_url, "SELECT id::text FROM standmeet.worker_processes WHERE hostname = 'h'")}
    assert workers == {"00000000-0000-0000-0000-0000000000bb"}


def test_relayed_outbox_rows_are_pruned_after_their_retention_and_pending_ones_kept(broker, database_url, start_worker):
    with psycopg.connect(database_url, autocommit=True) as conn:
        old, recent, pending = (conn.execute("INSERT INTO standmeet.outbox (topic, payload, relayed_at) VALUES"
                                             " ('document.written', '{}', %s) RETURNING id", (at,)).fetchone()[0]
                                for at in (None, None, None))
        conn.execute("UPDATE standmeet.outbox SET relayed_at = now() - interval '2 days' WHERE id = %s", (old,))
        conn.execute("UPDATE standmeet.outbox SET relayed_at = now() WHERE id = %s", (recent,))
        conn.execute("UPDATE standmeet.outbox SET error = 'kept for an operator' WHERE id = %s", (pending,))
    start_worker(queues=["maintenance"], threads=1)
    job = dramatiq.get_broker().get_actor("maintenance.prune_outbox").send()
    wait_for(lambda: query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                           (job.message_id,)) == [("done",)], timeout_s=15, what="the outbox prune job")
    left = {r[0] for r in query(database_url, "SELECT id FROM standmeet.outbox WHERE id = ANY(%s)", ([old, recent, pending],))}
    assert left == {recent, pending}


def test_relays_gone_for_a_day_are_forgotten_unless_an_old_event_may_still_wait_for_their_routes(
        broker, database_url, monkeypatch):
    import uuid

    from broker import maintenance

    # Given relays stopped 2 and 4 days ago, and one stopped just now
    relays = {name: str(uuid.uuid4()) for name in ("two_days", "four_days", "now")}
    with psycopg.connect(database_url, autocommit=True) as conn:
        for name, ago in (("two_days", "2 days"), ("four_days", "4 days"), ("now", "0 seconds")):
            conn.execute("INSERT INTO standmeet.relays (id, hostname, pid, topics, heartbeat_at, stopped_at)"
                         " VALUES (%s, 'h', 1, '{}', now() - %s::interval, now() - %s::interval)",
                         (relays[name], ago, ago))
    # When the outbox is pruned while unrouted events may wait three days
    monkeypatch.setattr(broker, "settings", replace(broker.settings, outbox_unrouted_max_age_s=3 * 86_400.0))
    maintenance.prune_outbox()
    # Then only the relay gone for longer than that is forgotten
    left = {r[0] for r in query(database_url, "SELECT id::text FROM standmeet.relays WHERE id = ANY(%s::uuid[])",
                                (list(relays.values()),))}
    assert left == {relays["two_days"], relays["now"]}
    # and with the default (300 s), those gone for over a day are
    monkeypatch.setattr(broker, "settings", replace(broker.settings, outbox_unrouted_max_age_s=300.0))
    maintenance.prune_outbox()
    left = {r[0] for r in query(database_url, "SELECT id::text FROM standmeet.relays WHERE id = ANY(%s::uuid[])",
                                (list(relays.values()),))}
    assert left == {relays["now"]}


def test_a_job_an_operator_retries_while_the_prune_reads_it_is_kept(broker, database_url):
    # Given a message rejected long ago
    message = mark.message("retried-while-pruned")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
        conn.execute("UPDATE dramatiq.queue SET state = 'rejected', mtime = now() - interval '30 days'"
                     " WHERE message_id = %s", (message.message_id,))
    # and an operator's retry of it, not committed yet
    with psycopg.connect(database_url) as retrying:
        retrying.execute("UPDATE dramatiq.queue SET state = 'queued', mtime = now(), eta = now()"
                         " WHERE message_id = %s", (message.message_id,))
        # When the prune reads it meanwhile (rejected and old, as its snapshot sees it) and
        # waits for its row, and the retry then commits
        deleted: list[int] = []

        def prune() -> None:
            with psycopg.connect(database_url, autocommit=True) as conn:
                deleted.append(conn.execute(sql.PRUNE_FINISHED, {"retention_s": 7 * 86400, "batch": 10}).rowcount)

        pruning = threading.Thread(target=prune, name="test-prune")
        pruning.start()
        wait_for(lambda: lock_waits(database_url, statement="DELETE FROM dramatiq.queue") == 1, timeout_s=10,
                 what="the prune waiting for the retried row")
        retrying.commit()
    pruning.join(timeout=10)
    assert not pruning.is_alive()

    # Then the prune deleted nothing, and the job waits in its queue to run again
    assert deleted == [0]
    assert query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                 (message.message_id,)) == [("queued",)]
