"""Claims: an ack settles the claim it belongs to, never a later claim of the same message."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from dramatiq.broker import MessageProxy

from broker.engine import sql, sql_enqueue
from broker.engine.codec import claim_size_params, enqueue_params
from broker.engine.consumer import StandmeetConsumer
from broker.engine.queues import QueueState
from broker.settings import MIB
from tests.support.db import query
from tests.support.jobs import mark

#: What the claim statement refuses, at the default STANDMEET_MESSAGE_MAX_BYTES.
CLAIM_SIZES = {**claim_size_params(MIB), "claim_until_s": None}


def _state(url: str, message_id: str) -> list[tuple[str, int]]:
    return query(url, "SELECT state::text, claims FROM dramatiq.queue WHERE message_id = %s", (message_id,))


def test_a_settle_applies_only_to_the_claim_it_names_never_to_a_later_claim(broker, database_url):
    # Given a message claimed once by this process
    broker.claiming = True
    state = broker.queue_states["index"]
    consumer = broker.consume("index", timeout=100)
    message = mark.send("reclaimed")
    first = consumer.__next__()
    assert first is not None and first.message_id == message.message_id
    # When it is taken back (as rescue would) and claimed again before the first run settles
    query(database_url, "UPDATE dramatiq.queue SET state = 'queued', worker_id = NULL WHERE message_id = %s",
          (message.message_id,))
    consumer.next_due_s = 0.0
    second = None
    for _ in range(20):
        second = second or consumer.__next__()
    assert second is not None and second.message_id == message.message_id
    assert _state(database_url, message.message_id) == [("consumed", 2)]
    # Then the first run's settle leaves the second claim running
    broker.emit_after("process_message", first, result=None)
    consumer.ack(first)
    assert broker.settler.flush(5)
    assert _state(database_url, message.message_id) == [("consumed", 2)]
    assert state.in_flight == {(message.message_id, 2)}
    # And the second run's settle finishes it and frees the slot
    broker.emit_after("process_message", second, result=None)
    consumer.ack(second)
    assert broker.settler.flush(5)
    assert _state(database_url, message.message_id) == [("done", 2)]
    assert state.in_flight == set()
    consumer.close()


def test_a_settle_applies_only_to_its_own_process_claim_even_when_another_has_the_same_number(
    broker, database_url
):
    # Given a message claimed by this process
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    message = mark.send("claimed-again-after-a-failover")
    run = consumer.__next__()
    assert run is not None and run.message_id == message.message_id
    # When, after a failover lost that claim, another process claimed the message with the
    # same claim number (the promoted standby never saw this process's claim)
    # (a live one: a rescue pass of another test's process must not take its claim back)
    other = str(uuid.uuid4())
    query(database_url, "INSERT INTO standmeet.worker_processes (id, hostname, pid, queues, heartbeat_at)"
                        " VALUES (%s, 'promoted-standby-host', 4242, '{index}', now() + interval '1 hour')", (other,))
    try:
        query(database_url, "UPDATE dramatiq.queue SET worker_id = %s WHERE message_id = %s",
              (other, message.message_id))
        # Then this process's settle leaves the other process's run alone
        broker.emit_after("process_message", run, result=None)
        consumer.ack(run)
        assert broker.settler.flush(5)
        assert _state(database_url, message.message_id) == [("consumed", 1)]
    finally:
        query(database_url, "UPDATE dramatiq.queue SET state = 'done', worker_id = NULL WHERE message_id = %s",
              (message.message_id,))
        query(database_url, "DELETE FROM standmeet.worker_processes WHERE id = %s", (other,))
        consumer.close()


def test_a_run_that_ended_without_returning_is_never_recorded_as_done(broker, database_url):
    # Given a claimed message whose after-hooks never said how it ended (a middleware broke)
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    message = mark.send("no-outcome")
    proxy = consumer.__next__()
    assert proxy is not None and proxy.message_id == message.message_id
    # When the worker acks it anyway (Dramatiq acks whatever was not failed)
    consumer.ack(proxy)
    assert broker.settler.flush(5)
    # Then it is queued to run again, not done
    assert query(database_url, "SELECT state::text, eta > now() - interval '1 second' FROM dramatiq.queue"
                               " WHERE message_id = %s", (message.message_id,)) == [("queued", True)]
    consumer.close()
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (message.message_id,))


def test_messages_handed_out_but_not_started_go_back_to_the_queue_and_wake_consumers(broker, database_url):
    import psycopg

    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    messages = [mark.send(f"requeued-{i}") for i in range(2)]
    handed = [consumer.__next__() for _ in range(2)]
    assert {m.message_id for m in handed} == {m.message_id for m in messages}
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute('LISTEN "dramatiq.index.enqueue"')
        # When the worker gives them back unstarted (shutdown)
        consumer.requeue(handed)
        woken = [n.channel for n in listener.notifies(timeout=2, stop_after=1)]
    # Then they are queued for anyone, consumers were woken, and the slots are free
    states = query(database_url, "SELECT state::text, worker_id FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                   ([m.message_id for m in messages],))
    assert states == [("queued", None), ("queued", None)]
    assert woken == ["dramatiq.index.enqueue"]
    assert broker.queue_states["index"].in_flight == set()
    consumer.close()
    # (they would be the next messages any other test's consumer claims)
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
          ([m.message_id for m in messages],))


def test_a_malformed_message_is_rejected_with_the_reason_and_the_others_run(broker, database_url, start_worker):
    import uuid

    bad = str(uuid.uuid4())
    query(database_url, "INSERT INTO dramatiq.queue (queue_name, message_id, state, message)"
                        " VALUES ('index', %s, 'queued', '{\"not\": \"a dramatiq message\"}')", (bad,))
    good = mark.send("after-malformed")
    start_worker(queues=["index"], threads=4)
    from tests.support.db import wait_for

    wait_for(lambda: _state(database_url, good.message_id)[0][0] == "done", timeout_s=10, what="the good message")
    wait_for(lambda: query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s", (bad,))
             == [("rejected",)], timeout_s=10, what="the malformed one rejected")
    (error,) = query(database_url, "SELECT error FROM dramatiq.queue WHERE message_id = %s", (bad,))[0]
    assert error.startswith("malformed message:")


def test_a_row_whose_message_disagrees_with_its_own_columns_is_rejected_by_its_row_id(
    broker, database_url, start_worker
):
    import json
    import uuid

    from tests.support.db import wait_for

    # Given two rows whose JSON names another queue or another id than the row itself
    other_queue = mark.message("wrong-queue")
    wrong_queue_row = other_queue.message_id
    text = json.loads(other_queue.encode())
    text["queue_name"] = "webhook"
    query(database_url, "INSERT INTO dramatiq.queue (queue_name, message_id, state, message)"
                        " VALUES ('index', %s, 'queued', %s)", (wrong_queue_row, json.dumps(text)))
    other_id = mark.message("wrong-id")
    wrong_id_row = str(uuid.uuid4())
    query(database_url, "INSERT INTO dramatiq.queue (queue_name, message_id, state, message)"
                        " VALUES ('index', %s, 'queued', %s)", (wrong_id_row, other_id.encode().decode()))
    good = mark.send("after-disagreeing")
    # When a worker serves the queue
    start_worker(queues=["index"], threads=4)
    # Then both rows are rejected by their own ids, with the reason, and the queue goes on
    wait_for(lambda: _state(database_url, good.message_id)[0][0] == "done", timeout_s=10, what="the good message")
    rows = dict(query(database_url, "SELECT message_id::text, error FROM dramatiq.queue"
                                    " WHERE message_id = ANY(%s::uuid[]) AND state = 'rejected'",
                      ([wrong_queue_row, wrong_id_row],)))
    assert "queue_name 'webhook' is not the row's 'index'" in rows[wrong_queue_row]
    assert f"is not the row's '{wrong_id_row}'" in rows[wrong_id_row]
    assert query(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = %s",
                 (other_id.message_id,)) == [(0,)]


def test_a_message_for_an_unknown_actor_is_given_back_with_the_reason_not_lost(broker, database_url, start_worker):
    import dramatiq

    from tests.support.db import wait_for

    message = dramatiq.Message(queue_name="index", actor_name="newer.release.actor", args=(), kwargs={}, options={})
    broker.enqueue(message)
    good = mark.send("after-unknown")
    start_worker(queues=["index"], threads=4)
    wait_for(lambda: _state(database_url, good.message_id)[0][0] == "done", timeout_s=10, what="the good message")
    wait_for(lambda: query(database_url, "SELECT error IS NOT NULL FROM dramatiq.queue WHERE message_id = %s",
                           (message.message_id,)) == [(True,)], timeout_s=10, what="the unknown actor's message bounced")
    state, error, later = query(database_url, "SELECT state::text, error, eta > now() FROM dramatiq.queue WHERE message_id = %s",
                                (message.message_id,))[0]
    assert (state, later) == ("queued", True)  # kept, for a worker that has the actor
    assert "no actor 'newer.release.actor'" in error
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (message.message_id,))


def test_settles_commit_synchronously_and_claims_asynchronously_without_session_state(broker, database_url):
    import psycopg

    from broker.engine import sql

    # Given the broker's settler and a consumer, connected as they run
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    consumer_conn = consumer._connection()
    settler_conn = broker.settler._connection()
    # Then a settle is durable once written (the settler forgets it then: a settle lost in
    # a server crash would leave its message consumed by a live worker, rescued by nobody),
    # and neither connection carries a setting of its own: through a transaction pooler a
    # session setting would reach other clients' transactions
    assert settler_conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert consumer_conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    consumer.close()
    # While the claim statement's own transaction commits asynchronously: a lost claim only
    # makes its message run again
    message = mark.send("claimed-asynchronously")
    with psycopg.connect(database_url) as conn:
        claimed = conn.execute(sql.CLAIM, {"queue": message.queue_name, "n": 1, "n_start": 1,
                                           "worker_id": "00000000-0000-0000-0000-000000000000",
                                           **CLAIM_SIZES}).fetchall()
        assert len(claimed) == 1
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        conn.rollback()
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        conn.execute("DELETE FROM dramatiq.queue WHERE message_id = %s", (message.message_id,))
        conn.commit()


#: The server ends the settler's session (as a failover or an administrator would).
KILL_SETTLER = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-settler'
"""


def test_a_settle_that_meets_a_broken_connection_is_kept_and_written_after_reconnecting(
    broker, database_url, caplog
):
    import logging

    from tests.support.db import scalar

    # Given a claimed job, and the settler's session ended by the server
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    message = mark.send("settled-through-an-outage")
    proxy = consumer.__next__()
    assert proxy is not None and proxy.message_id == message.message_id
    assert broker.settler.flush(5)
    broker.settler._connection()
    assert scalar(database_url, KILL_SETTLER) == 1
    # When the job finishes
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        broker.emit_after("process_message", proxy, result=None)
        consumer.ack(proxy)
        # Then its settle is kept through the failure and written after reconnecting
        assert broker.settler.flush(10), "the settle was not written"
    assert _state(database_url, message.message_id) == [("done", 1)]
    assert broker.queue_states["index"].in_flight == set()
    # and the outage was reported once, naming the settle
    lines = [r.getMessage() for r in caplog.records if "database unreachable" in r.getMessage()]
    assert len(lines) == 1 and "settle" in lines[0], lines
    consumer.close()


HELD = "SELECT state::text, worker_id, crashes FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
CONSUMED = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state = 'consumed'"


def test_when_shutdown_starts_prefetched_messages_go_back_at_once_and_nothing_more_is_claimed(
    broker, database_url
):
    from tests.support.db import scalar
    from tests.support.jobs import SLEEP

    # Given the fetch queue's consumer running its limit (3), one more prefetched, and
    # more messages due
    state = broker.queue_states["fetch"]
    ids = [SLEEP["fetch"].send(0, "shutdown").message_id for _ in range(6)]
    broker.claiming = True
    consumer = broker.consume("fetch", timeout=50)
    running = [p for p in (consumer.__next__() for _ in range(10)) if p is not None]
    assert len(running) == 3
    prefetched = [c.message.message_id for c in state.buffer]
    assert len(prefetched) == 1
    # When shutdown starts
    broker.stop_claiming()
    try:
        # Then the prefetched message is back in its queue at once, for anyone, unblamed
        assert query(database_url, HELD, (prefetched,)) == [("queued", None, 0)]
        assert list(state.buffer) == []
        assert state.in_flight == {(p.message_id, p.standmeet_claim) for p in running}
        # and the consumer claims nothing more, though messages are due
        assert [consumer.__next__() for _ in range(5)] == [None] * 5
        assert scalar(database_url, CONSUMED, (ids,)) == 3
    finally:
        broker.claiming = True
    for proxy in running:
        broker.emit_after("process_message", proxy, result=None)
        consumer.ack(proxy)
    assert broker.settler.flush(5)
    consumer.close()
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,))


def test_an_idle_settler_stops_as_soon_as_it_is_asked_not_at_its_next_tick(database_url):
    from broker.engine.broker import StandmeetBroker
    from tests.conftest import test_settings

    # Given a broker of its own (not the process's) whose settler thread runs, with nothing to write
    own = StandmeetBroker(settings=test_settings(database_url=database_url), url=database_url)
    try:
        own.settler.start()
        assert own.settler.flush(5)
        # When it is asked to stop, Then it has stopped well within its idle wait (0.5 s)
        assert own.settler.stop(timeout_s=0.2)
    finally:
        own.close()


def _rows_read(plan: dict) -> int:
    """Rows a plan's scans returned or filtered out, over the whole tree."""
    own = 0
    if "Scan" in plan.get("Node Type", "") and "CTE" not in plan["Node Type"]:
        own = (plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)) * plan.get("Actual Loops", 1)
    return own + sum(_rows_read(child) for child in plan.get("Plans", []))


def test_a_claim_reads_about_as_many_rows_as_it_claims_whatever_the_backlog(database_url):
    # Given a backlog of 3,000 queued messages, none of them a suspect of a crash
    messages = [mark.message(f"backlog-{i}") for i in range(3000)]
    queue = messages[0].queue_name
    with psycopg.connect(database_url) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(messages))
        # When one claim of 6 runs (rolled back: nothing is taken)
        [(plan,)] = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql.CLAIM,
            {"queue": queue, "n": 6, "n_start": 6, "worker_id": str(uuid.uuid4()), **CLAIM_SIZES},
        ).fetchall()
        conn.rollback()
        conn.execute("DELETE FROM dramatiq.queue WHERE queue_name = %s", (queue,))
        conn.commit()
    # Then it read a few dozen rows at most, not the backlog (looking for suspects once
    # walked every queued message of the queue)
    assert _rows_read(plan[0]["Plan"]) <= 60


def test_a_run_that_returned_is_done_and_options_its_middleware_changed_are_kept(broker, database_url):
    # Given two claimed messages, one whose after-hooks change its options
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    sent = [mark.send("plain"), mark.send("changed")]
    claimed = {}
    for _ in range(20):
        proxy = consumer.__next__()
        if proxy is not None:
            claimed[proxy.message_id] = proxy
        if len(claimed) == 2:
            break
    plain, changed = claimed[sent[0].message_id], claimed[sent[1].message_id]
    changed.options["note"] = "written by a middleware"
    # When both return and are settled
    for proxy in (plain, changed):
        broker.emit_after("process_message", proxy, result=None)
        consumer.ack(proxy)
    assert broker.settler.flush(5)
    consumer.close()
    # Then both are done; the changed options were written, the other message is as sent
    rows = dict(query(database_url, "SELECT message_id::text, state::text || ' ' || (message->'options')::text "
                                    "FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                      ([m.message_id for m in sent],)))
    assert rows[plain.message_id].startswith("done ")
    assert "note" not in rows[plain.message_id]
    assert rows[changed.message_id].startswith("done ") and '"note": "written by a middleware"' in rows[changed.message_id]


def test_the_next_due_time_is_the_earliest_of_any_priority_and_reads_a_few_rows_of_a_large_backlog(database_url):
    # Given 3,000 messages due in an hour at priority 0, and one due in 60 s at priority 5
    later = [mark.message(f"later-{i}") for i in range(3000)]
    queue = later[0].queue_name
    soon = mark.message_with_options(args=("soon",), priority=5)
    with psycopg.connect(database_url) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(later, delay=3_600_000))
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([soon], delay=60_000))
        # When the consumer asks when to look again
        [(seconds,)] = conn.execute(sql.NEXT_DUE, {"queue": queue}).fetchall()
        [(plan,)] = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql.NEXT_DUE, {"queue": queue}).fetchall()
        conn.rollback()
    # Then it is the priority-5 message's time, found without reading the backlog
    assert 55 < seconds <= 60
    assert _rows_read(plan[0]["Plan"]) <= 30


def test_the_queue_table_is_vacuumed_after_one_percent_of_it_changed_not_twenty(database_url):
    [(options,)] = query(database_url, "SELECT reloptions FROM pg_class WHERE oid = 'dramatiq.queue'::regclass")
    assert "autovacuum_vacuum_scale_factor=0.01" in options
    assert "autovacuum_vacuum_threshold=2000" in options


def test_a_consumer_looks_again_when_the_next_message_is_due_not_at_the_retry_floor(
        broker, database_url, monkeypatch):
    # Given a retry floor far longer than the wait (the floor is for due rows another claimer holds)
    from broker.engine import consumer as pgconsumer

    monkeypatch.setattr(pgconsumer, "MIN_WAIT_S", 0.5)
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    message = mark.send_with_options(args=("due-soon",), delay=150)
    # When the consumer claims before it is due
    consumer.next_due_s = 0.0
    assert consumer.claim_once(consumer._connection()) == 0
    assert consumer.next_due_unknown  # asked before it sleeps, after any hand-out
    consumer.look_up_next_due(consumer._connection())
    # Then it looks again at the message's due time, not after the floor
    assert consumer.next_due_s is not None
    assert consumer.next_due_s - time.monotonic() <= 0.15
    # And a due message that another claimer holds locked is looked at again after the floor
    query(database_url, "UPDATE dramatiq.queue SET eta = now() WHERE message_id = %s", (message.message_id,))
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT 1 FROM dramatiq.queue WHERE message_id = %s FOR UPDATE", (message.message_id,))
        assert consumer.claim_once(consumer._connection()) == 0
        consumer.look_up_next_due(consumer._connection())
        assert 0.3 < consumer.next_due_s - time.monotonic() <= 0.5
        holder.rollback()
    consumer.close()
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (message.message_id,))


def _hand_outs(monkeypatch) -> list[tuple[str, bool]]:
    """(message id, whether a consumer thread put it on the work queue), in order."""
    import threading

    from dramatiq.worker import ConsumerThread

    seen: list[tuple[str, bool]] = []
    original = ConsumerThread.handle_message

    def handle_message(self, message):
        seen.append((message.message_id, isinstance(threading.current_thread(), ConsumerThread)))
        return original(self, message)

    monkeypatch.setattr(ConsumerThread, "handle_message", handle_message)
    return seen


def _done(database_url: str, ids: list[str]) -> bool:
    return query(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
                               " AND state = 'done'", (ids,))[0][0] == len(ids)


def test_a_buffered_job_is_started_by_the_thread_that_finished_the_one_before_not_the_consumer(
        broker, database_url, start_worker, monkeypatch):
    from broker import enqueue_many
    from tests.support.db import wait_for

    # Given a queue that runs one job at a time with three claimed behind it, and a backlog of four
    assert broker.settler.flush(5)  # earlier tests' outcomes written: the whole room is free
    state = broker.queue_states["index"]
    monkeypatch.setattr(state, "limit", 1)
    monkeypatch.setattr(state, "prefetch", 3)
    seen = _hand_outs(monkeypatch)
    messages = enqueue_many([mark.message(f"handed-{i}") for i in range(4)])
    ids = [m.message_id for m in messages]
    # When a worker drains them
    start_worker(queues=["index"], threads=1)
    wait_for(lambda: _done(database_url, ids), timeout_s=10)
    # Then the consumer started the first; each later one was started by the thread whose job had ended
    assert sorted(mid for mid, _ in seen) == sorted(ids)
    assert [by_consumer for _, by_consumer in seen] == [True, False, False, False]


def test_a_buffered_job_that_its_finishing_thread_could_not_start_is_started_by_the_consumer(
        broker, database_url, start_worker, monkeypatch):
    from dramatiq.worker import ConsumerThread

    from broker import enqueue_many
    from tests.support.db import wait_for

    # Given hand-offs from worker threads that fail (the work queue refuses them)
    assert broker.settler.flush(5)
    state = broker.queue_states["index"]
    monkeypatch.setattr(state, "limit", 1)
    monkeypatch.setattr(state, "prefetch", 3)
    seen = _hand_outs(monkeypatch)
    handle_message = ConsumerThread.handle_message

    def refuse_from_worker_threads(self, message):
        import threading

        if not isinstance(threading.current_thread(), ConsumerThread):
            seen.append((message.message_id, False))
            raise RuntimeError("work queue refused")
        return handle_message(self, message)

    monkeypatch.setattr(ConsumerThread, "handle_message", refuse_from_worker_threads)
    messages = enqueue_many([mark.message(f"refused-{i}") for i in range(3)])
    ids = [m.message_id for m in messages]
    # When a worker drains them
    start_worker(queues=["index"], threads=1)
    # Then every one still runs, once, started by the consumer after the refused hand-off
    wait_for(lambda: _done(database_url, ids), timeout_s=10)
    assert query(database_url, "SELECT count(*) FROM test_runs WHERE label LIKE 'refused-%%'")[0][0] == 3
    assert [by_consumer for _, by_consumer in seen].count(False) == 2  # the two behind the first


def test_a_claimed_message_is_handed_out_before_the_consumer_asks_when_to_look_again(broker, database_url):
    # Given an idle consumer whose statements are recorded, and one message sent
    broker.claiming = True
    assert broker.settler.flush(5)
    consumer = broker.consume("index", timeout=100)
    conn = consumer._connection()
    statements: list[str] = []
    real_execute = conn.execute

    def execute(query, *args, **kwargs):
        statements.append("next due" if query is sql.NEXT_DUE else "claim" if query is sql.CLAIM else "other")
        return real_execute(query, *args, **kwargs)

    conn.execute = execute  # type: ignore[method-assign]
    message = mark.send("handed-first")
    consumer.next_due_s = 0.0
    # When the consumer claims it
    proxy = None
    for _ in range(20):  # each call waits at most the consumer's 100 ms
        proxy = proxy or consumer.__next__()
        if proxy is not None:
            break
    # Then it was handed out after the claim alone; when the next message is due is asked after
    assert proxy is not None and proxy.message_id == message.message_id
    assert statements == ["claim"]
    consumer.__next__()
    assert statements[:2] == ["claim", "next due"]
    broker.emit_after("process_message", proxy, result=None)
    consumer.ack(proxy)
    assert broker.settler.flush(5)
    consumer.close()


def _slow_queue(broker, monkeypatch, label: str) -> tuple[QueueState, list[str], StandmeetConsumer, MessageProxy]:
    """The index queue with two slots, one running, four claims behind it, and a mean run
    time of 10 s: what it holds past a second should go back."""
    import dataclasses

    from broker import enqueue_many

    assert broker.settler.flush(5)
    state = broker.queue_states["index"]
    monkeypatch.setattr(state, "settings", dataclasses.replace(state.settings, max_workers=2, prefetch_setting=-1))
    monkeypatch.setattr(state, "limit", 1)
    monkeypatch.setattr(state, "prefetch", 4)
    ids = [m.message_id for m in enqueue_many([mark.message(f"{label}-{i}") for i in range(5)])]
    broker.claiming = True
    consumer = broker.consume("index", timeout=50)
    running = consumer.__next__()
    assert running is not None and running.message_id == ids[0]
    assert [c.message.message_id for c in state.buffer] == ids[1:]
    monkeypatch.setattr(state, "mean_run_s", 10.0)
    return state, ids, consumer, running


def test_what_a_queue_would_hold_past_a_second_goes_back_to_the_queue_unblamed(
        broker, database_url, monkeypatch):
    # Given a queue running one job with four claimed behind it, whose jobs now take 10 s
    state, ids, consumer, running = _slow_queue(broker, monkeypatch, "slow")
    # When its consumer next looks
    assert consumer.__next__() is None
    # Then all but the first in line are queued again for anyone, with no crash counted;
    # the first stays claimed here, and nothing more is claimed
    assert query(database_url, HELD, (ids[2:],)) == [("queued", None, 0)] * 3
    assert [c.message.message_id for c in state.buffer] == ids[1:2]
    assert state.in_flight == {(m, 1) for m in ids[:2]}
    assert query(database_url, CONSUMED, (ids,)) == [(2,)]
    consumer.close()
    _forget(broker, database_url, state, ids)


def test_a_give_back_whose_outcome_is_unknown_is_never_started_here_and_is_tried_again(
        broker, database_url, monkeypatch):
    # Given a queue whose buffer holds three claims past a second
    state, ids, consumer, running = _slow_queue(broker, monkeypatch, "unknown")
    execute = broker.execute

    def committed_then_cut_off(query_text, params=None):
        rows = execute(query_text, params)
        if query_text == sql.REQUEUE:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows

    # When the give-back commits but its answer is lost
    monkeypatch.setattr(broker, "execute", committed_then_cut_off)
    consumer._give_back_excess()
    monkeypatch.setattr(broker, "execute", execute)
    assert [c.message.message_id for c in state.returning] == ids[:1:-1]  # to be offered again
    assert consumer.give_back_after > time.monotonic()  # after a back-off
    # and another process claims those messages and runs them
    other = str(uuid.uuid4())
    query(database_url, sql.CLAIM, {"queue": "index", "n": 10, "n_start": 10, "worker_id": other, **CLAIM_SIZES})
    assert sorted(r[0] for r in query(database_url, "SELECT message_id::text FROM dramatiq.queue"
                                                    " WHERE worker_id = %s", (other,))) == sorted(ids[2:])
    # Then this process never starts them, though its slot frees
    state.finished((running.message_id, running.standmeet_claim))
    assert [c.message.message_id for c in (state.next_buffered(), state.next_buffered()) if c] == ids[1:2]
    # and its next try leaves the other process's claims alone and forgets them
    consumer.give_back_after = 0.0
    consumer._give_back_excess()
    assert state.returning == [] and not any((m, 1) in state.in_flight for m in ids[2:])
    assert query(database_url, "SELECT count(*) FROM dramatiq.queue WHERE worker_id = %s"
                               " AND state = 'consumed' AND claims = 2", (other,)) == [(3,)]
    consumer.close()
    _forget(broker, database_url, state, ids)


def _forget(broker, database_url: str, state, ids: list[str]) -> None:
    """What a test claimed by hand leaves neither this process's books nor the queue."""
    state.take_buffer()
    state.release([(m, 1) for m in ids])
    state.drain_wake()
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,))


def test_prefetched_messages_that_shutdown_could_not_give_back_are_offered_again_never_started(
        broker, database_url, monkeypatch):
    # Given a queue running one job with four claimed behind it
    state, ids, consumer, running = _slow_queue(broker, monkeypatch, "stopped")
    monkeypatch.setattr(state, "mean_run_s", None)

    # When shutdown cannot give them back (the database is unreachable)
    def unreachable(messages, claims):
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(broker, "requeue", unreachable)
    broker.stop_claiming()
    monkeypatch.undo()
    # Then they are still this process's, never to start here, and a consumer that
    # claims again (a worker booted anew) gives them back
    assert [c.message.message_id for c in state.returning] == ids[1:]
    assert state.next_buffered() is None and all((m, 1) in state.in_flight for m in ids[1:])
    broker.claiming = True
    consumer._give_back_excess()
    assert state.returning == [] and query(database_url, HELD, (ids[1:],)) == [("queued", None, 0)] * 4
    consumer.close()
    _forget(broker, database_url, state, ids)


def test_a_job_ending_alone_makes_no_claim_when_the_last_claim_found_the_queue_empty(
        broker, database_url, start_worker, monkeypatch):
    # Given a worker whose claims and look-ups are counted, idle on an empty queue
    from broker.engine.consumer import StandmeetConsumer
    from tests.support.db import wait_for

    calls = {"claim_once": 0, "look_up_next_due": 0}
    for name in calls:
        original = getattr(StandmeetConsumer, name)

        def counted(self, conn, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, conn)

        monkeypatch.setattr(StandmeetConsumer, name, counted)
    start_worker(queues=["index"], threads=4)
    first = mark.send("warm-up")
    wait_for(lambda: _done(database_url, [first.message_id]), timeout_s=10, what="the first job")
    wait_for(lambda: broker.settler.pending() == 0, timeout_s=10, what="its outcome written")
    before = dict(calls)
    # When jobs come one at a time, each sent once the one before is done
    jobs = 5
    for i in range(jobs):
        message = mark.send(f"alone-{i}")
        ids = [message.message_id]
        wait_for(lambda ids=ids: _done(database_url, ids), timeout_s=10, what=f"job {i}")
        wait_for(lambda: broker.settler.pending() == 0, timeout_s=10, what=f"job {i}'s outcome written")
    # Then each was claimed once, on its notification: neither its end nor its outcome's
    # write made another claim (or another look-up) that could only find the queue empty
    claims = calls["claim_once"] - before["claim_once"]
    look_ups = calls["look_up_next_due"] - before["look_up_next_due"]
    assert claims <= jobs + 1, f"{claims} claims for {jobs} jobs"
    assert look_ups <= jobs + 1, f"{look_ups} look-ups for {jobs} jobs"


def test_a_claimed_message_is_the_message_sent_and_a_row_with_a_field_dramatiq_does_not_know_is_rejected(
        broker, database_url):
    import dataclasses
    import json

    from dramatiq import Message

    # Given a message sent as usual, and a row whose JSON carries a field no message has
    sent = mark.message_with_options(args=("as-sent",), options_set_by_test=[1, 2])
    broker.enqueue(sent)
    odd = mark.message("with-an-extra-field")
    text = json.loads(odd.encode())
    text["colour"] = "blue"
    query(database_url, "INSERT INTO dramatiq.queue (queue_name, message_id, state, message, priority)"
                        " VALUES ('index', %s, 'queued', %s, 0)", (odd.message_id, json.dumps(text)))
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    claimed: list[MessageProxy] = []
    try:
        # When the consumer claims them
        claimed = [p for p in (consumer.__next__() for _ in range(10)) if p is not None]
        # Then the one sent is the same message: every field equal, frozen, its args a tuple
        (run,) = [p for p in claimed if p.message_id == sent.message_id]
        message = run._message
        assert type(message) is Message and message == sent
        assert message.args == ("as-sent",) and type(message.args) is tuple
        assert message.options["options_set_by_test"] == [1, 2]
        with pytest.raises(dataclasses.FrozenInstanceError):
            message.actor_name = "changed"  # type: ignore[misc]
        # And the other is rejected as malformed, naming the field, never run
        assert all(p.message_id != odd.message_id for p in claimed)
        (state, error), = query(database_url, "SELECT state::text, error FROM dramatiq.queue WHERE message_id = %s",
                                (odd.message_id,))
        assert state == "rejected" and error.startswith("malformed message:") and "colour" in error
    finally:
        for proxy in claimed:
            broker.emit_after("process_message", proxy, result=None)
            consumer.ack(proxy)
        assert broker.settler.flush(5)
        consumer.close()


def test_a_claim_rejected_or_bounced_by_its_consumer_leaves_a_later_claim_of_another_process_alone(
        broker, database_url):
    # Given a message claimed here (claim 1), then rescued and claimed by another process
    # (claim 2), as it would be had this process stalled past the rescue window
    message = mark.message("claimed-elsewhere-since")
    other = str(uuid.uuid4())
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
        conn.execute("UPDATE dramatiq.queue SET state = 'consumed', worker_id = %s, claims = 2, started_at = now()"
                     " WHERE message_id = %s", (other, message.message_id))
    # When this process rejects its claim as malformed, or gives it back as an unknown actor's
    mine = {"message_id": message.message_id, "claims": 1, "worker_id": broker.worker_id, "error": "late"}
    broker.execute(sql.REJECT_MALFORMED, mine)
    broker.execute(sql.UNKNOWN_ACTOR, {**mine, "delay_s": 60.0, "max_claims": 1})
    # Then the other process's claim runs on, untouched
    assert query(database_url, "SELECT state::text, worker_id::text, claims, error FROM dramatiq.queue"
                               " WHERE message_id = %s", (message.message_id,)) == [("consumed", other, 2, None)]


def test_a_claim_on_its_way_when_shutdown_starts_is_given_back_and_none_of_it_starts(broker, database_url):
    import threading

    from tests.support.db import scalar, wait_for
    from tests.support.jobs import SLEEP

    # Given messages due on the fetch queue, and its consumer's claim on its way: its rows
    # are back, not yet held, when shutdown starts on another thread
    state = broker.queue_states["fetch"]
    ids = [SLEEP["fetch"].send(0, "shutdown-mid-claim").message_id for _ in range(4)]
    broker.claiming = True
    consumer = broker.consume("fetch", timeout=50)
    hold_all = state.hold_all
    answered = threading.Event()

    def held_once_shutdown_started(claims: list) -> None:
        answered.set()
        wait_for(lambda: not broker.claiming, timeout_s=10, what="shutdown to start")
        hold_all(claims)

    state.hold_all = held_once_shutdown_started  # type: ignore[method-assign]
    stopping = threading.Thread(target=lambda: (answered.wait(10), broker.stop_claiming()), name="test-shutdown")
    stopping.start()
    try:
        # When the claim's answer lands
        handed = consumer.__next__()
        stopping.join(timeout=10)
        assert not stopping.is_alive()
        # Then nothing of it was handed out to run, and all of it is back in its queue, for anyone
        assert handed is None
        assert list(state.buffer) == []
        assert scalar(database_url, CONSUMED, (ids,)) == 0
    finally:
        state.hold_all = hold_all  # type: ignore[method-assign]
        broker.claiming = True
        consumer.close()
        query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,))
