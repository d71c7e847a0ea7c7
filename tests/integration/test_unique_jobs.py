"""Unique jobs: a send whose key is live is skipped and returns the live message.

The key is the actor and its arguments (``unique=True``), or a key the sender names
(``unique_key``); it is held while its message is queued (delayed too) or running, and,
with a period, done within it. The database decides, by a partial unique index: every
test asserts from rows what was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid

import dramatiq
import psycopg
import pytest
from prometheus_client import REGISTRY

from broker import ConfigError, UniqueBy, enqueue, enqueue_many, outbox
from broker.errors import InvalidMessage
from tests.support import unique_jobs
from tests.support.db import lock_waits, query, scalar, wait_for

LIVE = """
SELECT message_id::text, state::text FROM dramatiq.queue
WHERE message->>'actor_name' = %s AND message->'args' = %s::jsonb
ORDER BY enqueued_at, message_id
"""
STATE = "SELECT state::text FROM dramatiq.queue WHERE message_id = %s::uuid"
SKIPS = "SELECT coalesce(max(skipped), 0) FROM standmeet.unique_skips WHERE queue_name = 'index' AND actor_name = %s"


def _rows(url: str, actor: str, *args: object) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in query(url, LIVE, (actor, json.dumps(list(args))))]


def _skipped_metric(actor: str) -> float:
    return REGISTRY.get_sample_value("standmeet_unique_skipped_total", {"queue": "index", "actor": actor}) or 0.0


def _done(url: str, message_id: str) -> str:
    wait_for(lambda: scalar(url, STATE, (message_id,)) in ("done", "rejected"), timeout_s=20,
             what=f"{message_id} to be settled")
    return str(scalar(url, STATE, (message_id,)))


def test_a_second_send_of_a_live_key_writes_nothing_returns_the_live_message_and_is_counted(
        broker, database_url, start_worker):
    # Given a unique actor's message, queued
    first = unique_jobs.unique.send("live-1")
    skips_before, metric_before = scalar(database_url, SKIPS, ("test.unique",)), _skipped_metric("test.unique")
    # When the same call is sent twice more, and once with other arguments
    again = [unique_jobs.unique.send("live-1") for _ in range(2)]
    other = unique_jobs.unique.send("live-2")
    # Then the repeats wrote nothing and returned the live message; the other is its own
    assert [m.message_id for m in again] == [first.message_id] * 2
    assert _rows(database_url, "test.unique", "live-1") == [(first.message_id, "queued")]
    assert other.message_id != first.message_id
    # And each skip was counted, in the table and in this process's counter
    assert scalar(database_url, SKIPS, ("test.unique",)) == skips_before + 2
    assert _skipped_metric("test.unique") == metric_before + 2
    assert scalar(database_url, "SELECT last_skipped_at > now() - interval '1 minute' FROM standmeet.unique_skips"
                                " WHERE actor_name = 'test.unique'")
    # And the returned message's result is the live one's
    start_worker(queues=["index"])
    assert again[0].get_result(block=True, timeout=10_000) == "ran live-1"


def test_a_key_frees_when_its_job_settles_and_a_send_after_it_makes_a_new_message(
        broker, database_url, start_worker):
    # Given a unique job that ran to the end
    start_worker(queues=["index"])
    first = unique_jobs.unique.send("frees-1")
    assert _done(database_url, first.message_id) == "done"
    # When the same call is sent again
    second = unique_jobs.unique.send("frees-1")
    # Then it is a new message, and it runs
    assert second.message_id != first.message_id
    assert _done(database_url, second.message_id) == "done"
    assert [state for _, state in _rows(database_url, "test.unique", "frees-1")] == ["done", "done"]


def test_a_delayed_message_holds_its_key_until_it_runs(broker, database_url):
    # Given a unique message delayed by an hour (a queued row, due later)
    delayed = unique_jobs.unique.send_with_options(args=("delayed-1",), delay=3_600_000)
    # When the same call is sent now
    now = unique_jobs.unique.send("delayed-1")
    # Then it is the delayed one
    assert now.message_id == delayed.message_id
    assert len(_rows(database_url, "test.unique", "delayed-1")) == 1


def test_a_key_of_the_senders_own_folds_other_arguments_and_is_the_actors_own(broker, database_url):
    # Given a message to a plain actor with a key of the sender's own
    first = unique_jobs.plain.send_with_options(args=("own-a",), unique_key="doc-17")
    # When another call of that actor names the same key, and another actor names it too
    same = unique_jobs.plain.send_with_options(args=("own-b",), unique_key="doc-17")
    elsewhere = unique_jobs.unique.send_with_options(args=("own-c",), unique_key="doc-17")
    # Then the second is the first (its arguments are the live message's), the third its own
    assert (same.message_id, same.args) == (first.message_id, ("own-a",))
    assert elsewhere.message_id != first.message_id
    assert _rows(database_url, "test.plain", "own-b") == []
    # And a message without a key is written every time
    assert unique_jobs.plain.send("free").message_id != unique_jobs.plain.send("free").message_id


def test_enqueue_many_skips_duplicates_inside_the_batch_and_of_live_messages(broker, database_url):
    # Given a live unique message
    live = unique_jobs.unique.send("batch-live")
    # When a batch holds it again, a new key twice, and a message without a key
    batch = [unique_jobs.unique.message("batch-live"), unique_jobs.unique.message("batch-new"),
             unique_jobs.unique.message("batch-new"), unique_jobs.plain.message("batch-plain")]
    written = enqueue_many(batch)
    # Then the repeat of the live one returned it, the new key was written once, the
    # plain one as it is
    assert written[0].message_id == live.message_id
    assert written[1].message_id == batch[1].message_id
    assert written[2].message_id == batch[1].message_id
    assert written[3].message_id == batch[3].message_id
    assert [mid for mid, _ in _rows(database_url, "test.unique", "batch-new")] == [batch[1].message_id]
    assert len(_rows(database_url, "test.plain", "batch-plain")) == 1


def test_in_the_callers_transaction_a_duplicate_returns_the_first_and_a_rollback_frees_the_key(broker, database_url):
    with psycopg.connect(database_url) as conn:
        # Given a unique message enqueued in a transaction not yet committed
        first = enqueue(conn, "test.unique", "tx-1")
        # When the same call is enqueued in that transaction, then it rolls back
        again = enqueue(conn, "test.unique", "tx-1")
        assert again.message_id == first.message_id
        assert enqueue_many([unique_jobs.unique.message("tx-1")], conn=conn)[0].message_id == first.message_id
        conn.rollback()
        # Then nothing is left, and the key is free for the next transaction
        assert _rows(database_url, "test.unique", "tx-1") == []
        later = enqueue(conn, "test.unique", "tx-1")
        conn.commit()
    assert _rows(database_url, "test.unique", "tx-1") == [(later.message_id, "queued")]


def test_a_retry_of_a_unique_job_is_not_blocked_by_its_own_key(broker, database_url, start_worker):
    # Given a unique job that fails on its first run
    start_worker(queues=["index"])
    message = unique_jobs.unique_raise_once.send("retry-1")
    # When it is retried (the same message, queued again with its key)
    assert _done(database_url, message.message_id) == "done"
    # Then it ran twice as one message, and no send was skipped for its own key
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE actor = 'test.unique_raise_once'"
                                " AND label = 'retry-1'") == 2
    assert scalar(database_url, SKIPS, ("test.unique_raise_once",)) == 0
    assert _rows(database_url, "test.unique_raise_once", "retry-1") == [(message.message_id, "done")]


def test_a_message_sent_again_with_its_own_id_is_itself_not_a_skip(broker, database_url):
    # Given a unique message, queued
    message = unique_jobs.unique.message("own-id")
    assert broker.enqueue(message).message_id == message.message_id
    skips = scalar(database_url, SKIPS, ("test.unique",))
    # When the same message (its own id) is sent again
    again = broker.enqueue(message)
    # Then it is itself, and no skip is counted
    assert again.message_id == message.message_id
    assert scalar(database_url, SKIPS, ("test.unique",)) == skips


def test_with_a_period_a_done_message_holds_its_key_and_the_key_holds_the_periods_start(
        broker, database_url, start_worker):
    # Given a message of an actor unique per hour, which ran to the end
    start_worker(queues=["index"])
    first = unique_jobs.unique_per_hour.send("hourly-1")
    assert _done(database_url, first.message_id) == "done"
    # When the same call is sent again within the hour
    again = unique_jobs.unique_per_hour.send("hourly-1")
    # Then it is the done one
    assert again.message_id == first.message_id
    # And its key is the call's, with the start of its hour by the database's clock
    call = hashlib.sha256(json.dumps(["test.unique_per_hour", "args", ["hourly-1"], {}],
                                     separators=(",", ":")).encode()).digest()
    assert scalar(database_url, """
        SELECT unique_key = sha256(%s::bytea || convert_to(
                   (floor(extract(epoch FROM enqueued_at) / 3600) * 3600)::text, 'UTF8'))
        FROM dramatiq.queue WHERE message_id = %s::uuid""", (call, first.message_id))


def test_a_new_period_is_a_new_key(broker, database_url, start_worker):
    # Given a message unique for a one-second period, done
    start_worker(queues=["index"])
    first = unique_jobs.plain.send_with_options(args=("period-1",), unique_key="per-second", unique_period_s=1)
    assert _done(database_url, first.message_id) == "done"
    # When the same key is sent until the database's clock is in the next second
    later = wait_for(lambda: (m := unique_jobs.plain.send_with_options(
        args=("period-1",), unique_key="per-second", unique_period_s=1)).message_id != first.message_id and m,
        timeout_s=5, what="a send in the next period")
    # Then that send is a new message, under another key
    keys = query(database_url, "SELECT unique_key FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                 ([first.message_id, later.message_id],))
    assert len({bytes(k[0]) for k in keys}) == 2


def test_the_relay_fans_out_one_live_message_per_key(broker, database_url):
    # Given five events for one label of the unique actor and one for another
    with psycopg.connect(database_url) as conn, conn.transaction():
        for _ in range(5):
            outbox.emit(conn, "test.unique_fanout", {"label": "fan-a"})
        outbox.emit(conn, "test.unique_fanout", {"label": "fan-b"})
    skips = scalar(database_url, SKIPS, ("test.unique",))
    # When the relay relays them
    with psycopg.connect(database_url) as conn:
        result = outbox.relay_once(conn, limit=100, topics=["test.unique_fanout"])
    # Then each label has one live message, and the four repeats were counted as skips
    assert result.claimed == 6
    assert len(_rows(database_url, "test.unique", "fan-a")) == 1
    assert len(_rows(database_url, "test.unique", "fan-b")) == 1
    assert scalar(database_url, SKIPS, ("test.unique",)) == skips + 4
    # And relaying them again changes nothing
    query(database_url, "UPDATE standmeet.outbox SET relayed_at = NULL WHERE topic = 'test.unique_fanout'")
    with psycopg.connect(database_url) as conn:
        outbox.relay_once(conn, limit=100, topics=["test.unique_fanout"])
    assert len(_rows(database_url, "test.unique", "fan-a")) == 1


def test_a_bad_unique_option_is_refused_in_one_line_before_anything_is_written(broker, database_url):
    # A unique_key that is not a text
    with pytest.raises(InvalidMessage, match=r"option unique_key=5 of a message to 'test.plain' is not a text"):
        unique_jobs.plain.send_with_options(args=("bad",), unique_key=5)
    # A period below a second
    with pytest.raises(InvalidMessage, match=r"option unique_period_s=0 .* is not a number from 1"):
        unique_jobs.plain.send_with_options(args=("bad",), unique_key="k", unique_period_s=0)
    assert _rows(database_url, "test.plain", "bad") == []
    # An actor option that is neither true, false nor a UniqueBy, and a bad period
    with pytest.raises(ConfigError, match=r"unique='yes' is not true, false or a UniqueBy"):
        dramatiq.actor(actor_name=f"test.bad_unique_{uuid.uuid4().hex[:6]}", unique="yes")(lambda: None)
    with pytest.raises(ConfigError, match=r"UniqueBy\(period_s=0\) is not a number of seconds"):
        UniqueBy(period_s=0)


def test_a_retry_of_a_rejected_unique_job_leaves_it_while_a_live_message_holds_its_key(broker, database_url):
    from broker import ops

    # Given a unique job rejected by an operator's cancel, and a new live one of the same key
    first = unique_jobs.unique.send("retry-held")
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert ops.cancel_jobs(conn, message_ids=[first.message_id], by="test") == 1
        live = unique_jobs.unique.send("retry-held")
        assert live.message_id != first.message_id
        # When every rejected job of the actor is retried, cancelled ones included
        outcome = ops.retry_jobs_outcome(conn, actor="test.unique", include_cancelled=True, by="test")
    # Then the first stays rejected (the live one runs instead), said, and nothing failed
    assert outcome.skipped_unique >= 1
    assert scalar(database_url, STATE, (first.message_id,)) == "rejected"
    assert _rows(database_url, "test.unique", "retry-held") == [(first.message_id, "rejected"),
                                                                 (live.message_id, "queued")]


def test_a_cancelled_running_job_frees_its_key_so_the_same_call_sent_again_runs(
        broker, database_url, start_worker):
    from broker import ops

    # Given a unique job running (its key named: the same call, however long it runs)
    start_worker(queues=["index"])
    first = unique_jobs.unique_slow.send_with_options(args=("cancel-frees", 60_000), unique_key="cancel-frees")
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'cancel-frees'"),
             timeout_s=20, what="the first run to start")
    # When an operator cancels it, and the same call is sent again at once
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert ops.cancel_jobs(conn, message_ids=[first.message_id], by="test") == 1
    again = unique_jobs.unique_slow.send_with_options(args=("cancel-frees", 0), unique_key="cancel-frees")
    # Then the new send is a message of its own (not folded into the cancelled one, which
    # never runs again), and it runs
    assert again.message_id != first.message_id
    assert _done(database_url, again.message_id) == "done"
    # And the cancelled one ends rejected, saying who cancelled it
    assert _done(database_url, first.message_id) == "rejected"
    error = scalar(database_url, "SELECT error FROM dramatiq.queue WHERE message_id = %s::uuid", (first.message_id,))
    assert re.match(r"cancelled by test at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", error or ""), error
    # And a retry of the cancelled one holds its key again while it is live
    with psycopg.connect(database_url, autocommit=True) as conn:
        outcome = ops.retry_jobs_outcome(conn, message_ids=[first.message_id], include_cancelled=True, by="test")
    assert outcome.retried == 1
    assert unique_jobs.unique_slow.send_with_options(args=("cancel-frees", 0), unique_key="cancel-frees").message_id \
        == first.message_id
    with psycopg.connect(database_url, autocommit=True) as conn:  # its minute-long run need not hold the teardown
        ops.cancel_jobs(conn, message_ids=[first.message_id], by="test")
    broker.flush("index")


def test_a_pipeline_step_holds_its_key_when_free_and_runs_all_the_same_when_it_is_held(
        broker, database_url, start_worker):
    # Given a pipeline whose next step, delayed, goes to a unique actor whose key is free,
    # and one whose key a delayed message holds
    start_worker(queues=["index"])
    held = unique_jobs.unique.send_with_options(args=("pipe-held",), delay=600_000)
    dramatiq.pipeline([unique_jobs.plain.message("pipe-1"),
                       unique_jobs.unique.message_with_options(args=("pipe-free",), pipe_ignore=True,
                                                               delay=600_000)]).run()
    dramatiq.pipeline([unique_jobs.plain.message("pipe-2"),
                       unique_jobs.unique.message_with_options(args=("pipe-held",), pipe_ignore=True)]).run()
    # When the first steps have run
    step = wait_for(lambda: _rows(database_url, "test.unique", "pipe-free"), timeout_s=20,
                    what="the first pipeline's next step written")
    wait_for(lambda: [s for _, s in _rows(database_url, "test.unique", "pipe-held")].count("done") == 1,
             timeout_s=20, what="the second pipeline's next step to run")
    # Then the step whose key was free holds it: the same call sent now is folded into it
    assert unique_jobs.unique.send("pipe-free").message_id == step[0][0]
    assert _rows(database_url, "test.unique", "pipe-free") == [(step[0][0], "queued")]
    # And the step whose key was held ran all the same, the holder still waiting
    assert (held.message_id, "queued") in _rows(database_url, "test.unique", "pipe-held")
    broker.flush("index")


def test_skipped_sends_show_in_status_json_and_on_the_dashboards_overview(broker, database_url):
    import subprocess
    import sys

    from starlette.testclient import TestClient

    from broker.dashboard.app import DashboardConfig
    from broker.dashboard.server import create_app
    from tests.support.procs import ROOT

    # Given two skipped sends of a unique actor
    unique_jobs.unique.send("shown-1")
    unique_jobs.unique.send("shown-1")
    unique_jobs.unique.send("shown-1")
    skipped = scalar(database_url, SKIPS, ("test.unique",))
    # When an operator asks for the status, and opens the dashboard
    env = {**os.environ, "DATABASE_URL": database_url}
    done = subprocess.run([sys.executable, "-m", "broker.cli", "status", "--json"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    with TestClient(create_app(DashboardConfig(database_url=database_url)), base_url="http://127.0.0.1:8420") as c:
        page = c.get("/").text
    # Then both say how many sends of that actor were skipped
    assert done.returncode == 0, done.stderr
    shown = {u["actor"]: u for u in json.loads(done.stdout)["unique_skips"]}
    assert shown["test.unique"]["skipped"] == skipped >= 2 and shown["test.unique"]["queue"] == "index"
    assert re.search(rf"<td>test.unique</td><td>index</td><td class=\"n\">{skipped}</td>", page), page


def test_a_retry_of_a_unique_job_whose_key_a_send_takes_meanwhile_leaves_it_and_says_so(broker, database_url):
    import threading

    from broker import ops

    # Given a unique job rejected by an operator's cancel, and a send of its key in a
    # transaction still open
    first = unique_jobs.unique.send("retry-raced")
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert ops.cancel_jobs(conn, message_ids=[first.message_id], by="test") == 1
    with psycopg.connect(database_url) as sending:
        live = enqueue(sending, "test.unique", "retry-raced")
        # When the operator retries the job meanwhile, and the send then commits
        outcomes: list[ops.RetryOutcome] = []

        def retry() -> None:
            with psycopg.connect(database_url, autocommit=True) as conn:
                outcomes.append(ops.retry_jobs_outcome(conn, message_ids=[first.message_id], by="test"))

        retrying = threading.Thread(target=retry, name="test-retry")
        retrying.start()
        wait_for(lambda: lock_waits(database_url) >= 1 or not retrying.is_alive(),
                 timeout_s=10, what="the retry waiting for the send")
        sending.commit()
    retrying.join(timeout=10)
    assert not retrying.is_alive()
    # Then the retry ends without an error: the job stays rejected, said, and the sent one is live
    [outcome] = outcomes
    assert (outcome.retried, outcome.skipped_unique) == (0, 1)
    assert _rows(database_url, "test.unique", "retry-raced") == [(first.message_id, "rejected"),
                                                                   (live.message_id, "queued")]
