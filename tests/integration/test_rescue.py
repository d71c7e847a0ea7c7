"""Fair crash rescue: only the job that kills its worker is blamed.

Rows are set up as dead processes leave them (a worker row whose heartbeat is old, its
messages ``consumed``), then the broker's rescue pass judges them by the database's
clock.
"""

from __future__ import annotations

import threading
import uuid
from contextlib import nullcontext

import psycopg
import pytest

from broker.engine import sql, sql_enqueue
from broker.engine.codec import claim_size_params, enqueue_params
from tests.support.db import lock_waits, query, wait_for
from tests.support.jobs import mark

DEAD_WORKER = """
INSERT INTO standmeet.worker_processes (id, hostname, pid, queues, heartbeat_at, stopped_at)
VALUES (%s, 'gone', 1, '{index}', now() - interval '1 hour', %s::timestamptz)
"""
HOLD = """
UPDATE dramatiq.queue SET state = 'consumed', worker_id = %s, claims = claims + 1,
       started_at = CASE WHEN %s THEN now() END, suspect_of = %s, crashes = %s
WHERE message_id = %s
"""


def _held_by_dead_worker(url: str | psycopg.Connection, runs: list[tuple[bool, str | None, int]], *,
                         graceful: bool = False) -> list[str]:
    """Messages held by a dead worker: one per (started, suspect_of, crashes)."""
    worker = str(uuid.uuid4())
    messages = [mark.message(f"rescue-{i}") for i in range(len(runs))]
    opened = psycopg.connect(url, autocommit=True) if isinstance(url, str) else nullcontext(url)
    with opened as conn:
        conn.execute(DEAD_WORKER, (worker, None))
        if graceful:
            conn.execute("UPDATE standmeet.worker_processes SET stopped_at = now() WHERE id = %s", (worker,))
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(messages, delay=60_000))  # nobody else claims them
        for message, (started, suspect, crashes) in zip(messages, runs, strict=True):
            conn.execute(HOLD, (worker, started, suspect, crashes, message.message_id))
    return [m.message_id for m in messages]


def _rows(url: str, ids: list[str]) -> list[tuple[str, int, bool, str | None]]:
    found = dict(
        (row[0], row[1:]) for row in query(
            url, "SELECT message_id::text, state::text, crashes, suspect_of IS NOT NULL, error FROM dramatiq.queue"
                 " WHERE message_id = ANY(%s::uuid[])", (ids,))
    )
    return [found[i] for i in ids]


def test_prefetched_messages_of_a_dead_worker_are_requeued_without_blame(broker, database_url):
    # Given a dead worker that had started one message and prefetched two
    ids = _held_by_dead_worker(database_url, [(True, None, 0), (False, None, 0), (False, None, 0)])
    # When rescue runs
    broker.rescue_once()
    # Then the started one is blamed once; the prefetched ones are requeued with no crash
    assert _rows(database_url, ids) == [("queued", 1, False, None), ("queued", 0, False, None),
                                        ("queued", 0, False, None)]


def test_messages_of_a_gracefully_stopped_worker_carry_no_blame(broker, database_url):
    # Given a worker recorded as stopped (a deploy), still holding a started job
    ids = _held_by_dead_worker(database_url, [(True, None, 0)], graceful=True)
    broker.rescue_once()
    assert _rows(database_url, ids) == [("queued", 0, False, None)]


def test_jobs_that_died_together_become_suspects_and_none_is_blamed_yet(broker, database_url):
    # Given a worker that died running three jobs at once
    ids = _held_by_dead_worker(database_url, [(True, None, 0)] * 3)
    # When rescue runs
    broker.rescue_once()
    # Then all three are requeued as suspects of that crash, none blamed
    assert _rows(database_url, ids) == [("queued", 0, True, None)] * 3


def test_a_suspect_that_dies_again_is_blamed_and_its_innocent_neighbours_are_not(broker, database_url):
    # Given a worker that died running a suspect of an earlier crash beside an innocent job
    earlier_crash = str(uuid.uuid4())
    ids = _held_by_dead_worker(database_url, [(True, earlier_crash, 0), (True, None, 0)])
    broker.rescue_once()
    # Then the suspect is blamed; the job beside it is requeued with no crash, not a suspect
    assert _rows(database_url, ids) == [("queued", 1, True, None), ("queued", 0, False, None)]


def test_a_message_blamed_past_max_crashes_is_rejected_with_the_reason(broker, database_url):
    max_crashes = broker.settings.max_crashes
    ids = _held_by_dead_worker(database_url, [(True, None, max_crashes)])
    broker.rescue_once()
    [(state, crashes, _, error)] = _rows(database_url, ids)
    assert (state, crashes) == ("rejected", max_crashes + 1)
    assert f"its worker process died while running it {max_crashes + 1} times" in error


def test_suspects_of_one_crash_run_one_at_a_time(broker, database_url):
    # Given two due suspects of the same crash
    crash = str(uuid.uuid4())
    messages = [mark.message(f"suspect-{i}") for i in range(2)]
    ids = [m.message_id for m in messages]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(messages))
        conn.execute("UPDATE dramatiq.queue SET suspect_of = %s WHERE message_id = ANY(%s::uuid[])", (crash, ids))
    # When a consumer with free slots claims
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    first = consumer.__next__()
    for _ in range(5):
        consumer.__next__()
    # Then only one of them is running; the other waits for it
    states = sorted(s for s, *_ in _rows(database_url, ids))
    assert first is not None and first.message_id in ids
    assert states == ["consumed", "queued"]
    # And once the first is settled, the other is claimed
    broker.emit_after("process_message", first, result=None)
    consumer.ack(first)
    assert broker.settler.flush(5)
    consumer.next_due_s = 0.0
    second = None
    for _ in range(20):
        second = second or consumer.__next__()
    assert second is not None and {first.message_id, second.message_id} == set(ids)
    broker.emit_after("process_message", second, result=None)
    consumer.ack(second)
    assert broker.settler.flush(5)
    consumer.close()


def test_a_live_workers_claims_are_never_taken_back(broker, database_url):
    # Given a message claimed by this (live) process, whose heartbeat is fresh
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    message = mark.send("live-claim")
    proxy = None
    for _ in range(20):
        proxy = proxy or consumer.__next__()
    assert proxy is not None and proxy.message_id == message.message_id
    # When rescue runs, here and in any other process
    broker.rescue_once()
    # Then the claim is untouched
    assert query(database_url, "SELECT state::text, crashes FROM dramatiq.queue WHERE message_id = %s",
                 (message.message_id,)) == [("consumed", 0)]
    broker.emit_after("process_message", proxy, result=None)
    consumer.ack(proxy)
    assert broker.settler.flush(5)
    consumer.close()


#: The server ends the sessions of this process's pool (heartbeats and rescue run on it).
#: The server ends the broker pool's sessions and takes no new ones (as a partition, or
#: a server refusing connections, would): a dead connection alone no longer makes an
#: outage, since the pool replaces it when it is handed out.
CUT_OFF = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-broker'
"""


def _allow_connections(admin_url: str, database_url: str, allowed: bool) -> None:
    from psycopg import sql as pgsql

    from tests.support.db import conninfo_dbname

    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(pgsql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
            pgsql.Identifier(conninfo_dbname(database_url)), pgsql.Literal(allowed)))


def test_a_process_back_from_an_outage_judges_nobody_for_a_whole_rescue_window(broker, database_url, admin_url):
    import time

    from tests.support.db import wait_for

    # Given this process cut off from the database (its sessions ended, none taken)
    broker.prove_alive()
    before = broker.outage.ended_at
    with psycopg.connect(database_url, autocommit=True) as keeper:
        _allow_connections(admin_url, database_url, False)
        try:
            assert keeper.execute(CUT_OFF).fetchone()[0] >= 1
            wait_for(lambda: broker.heartbeat_once() == {} and broker.outage.down, timeout_s=10, what="the outage")
            # and meanwhile a dead worker's started job, which rescue would requeue at once
            ids = _held_by_dead_worker(keeper, [(True, None, 0)])
        finally:
            _allow_connections(admin_url, database_url, True)
    # When this process gets the database back
    wait_for(lambda: broker.heartbeat_once() == {} and broker.outage.ended_at != before,
             timeout_s=10, what="the outage to end")
    back = broker.outage.ended_at
    # Then its rescue judges nobody at first: the others may still be proving they live
    assert _rows(database_url, ids)[0][0] == "consumed"
    # and rescues the dead worker's job once it has been back for a whole rescue window
    window = broker.settings.rescue_after_s
    wait_for(lambda: broker.heartbeat_once() is not None and _rows(database_url, ids)[0][0] == "queued",
             timeout_s=3 * window, interval_s=0.1, what="the job to be rescued")
    assert time.monotonic() - back >= window


@pytest.mark.parametrize("recorded_s, silent_s, server_s, rescued", [
    (600.0, 100, 3600, False),  # started with a longer window than the judge's, silent within it
    (600.0, 700, 3600, True),   # silent past its own window
    (600.0, 700, 100, False),   # the server became this database's within its window: it may not have reconnected
    (None, 100, 3600, True),    # a row of an older release: the judge's window alone
    (1.0, 2, 3600, False),      # a shorter window than the judge's: the judge's is longer
])
def test_a_process_is_rescued_only_once_silent_past_the_longer_of_its_own_window_and_the_judges(
        broker, database_url, recorded_s, silent_s, server_s, rescued):
    # Given a process started with the rescue window ``recorded_s`` (as its heartbeat
    # records it), silent for ``silent_s``, holding a started job; the judge's window is
    # the test broker's (3 s), the server this database's for ``server_s``
    assert broker.settings.rescue_after_s == 3
    [message_id] = _held_by_dead_worker(database_url, [(True, None, 0)])
    query(database_url, "UPDATE standmeet.worker_processes SET rescue_after_s = %s::float8,"
                        " heartbeat_at = now() - make_interval(secs => %s)"
                        " WHERE id = (SELECT worker_id FROM dramatiq.queue WHERE message_id = %s)",
          (recorded_s, silent_s, message_id))
    query(database_url, "UPDATE standmeet.server_epoch SET since = now() - make_interval(secs => %s)", (server_s,))
    # When this process's rescue runs
    broker.rescue_once()
    # Then the job goes back only once its process is silent past the longer window, and
    # the server has been this database's as long
    assert _rows(database_url, [message_id])[0][0] == ("queued" if rescued else "consumed")


def test_a_processs_heartbeat_records_the_rescue_window_it_was_started_with(broker, database_url):
    broker.prove_alive()
    assert query(database_url, "SELECT rescue_after_s FROM standmeet.worker_processes WHERE id = %s",
                 (broker.worker_id,)) == [(broker.settings.rescue_after_s,)]


def test_a_registration_committed_late_with_an_older_queue_list_hides_no_queue(database_url):
    # Given a process whose two consumers registered the queues known when each connected,
    # the longer list committed first
    worker = str(uuid.uuid4())
    row = {"worker_id": worker, "hostname": "here", "pid": 1, "rescue_after_s": 20.0}
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.HEARTBEAT, {**row, "queues": ["index", "mail", "notify"]})
        # When the shorter, older one commits after it
        conn.execute(sql.HEARTBEAT, {**row, "queues": ["index"]})
        [(queues,)] = conn.execute("SELECT queues FROM standmeet.worker_processes WHERE id = %s", (worker,)).fetchall()
        conn.execute("DELETE FROM standmeet.worker_processes WHERE id = %s", (worker,))
    # Then the process is still recorded as serving every queue
    assert queues == ["index", "mail", "notify"]


def test_rescue_judges_nobody_for_a_whole_window_after_the_server_changed_identity(broker, database_url):
    from tests.support.db import scalar, wait_for

    # Given the server's identity recorded as another's on an earlier timeline, as a
    # standby promoted in a primary's place finds the primary's (replicated) row
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE standmeet.server_epoch SET identity = 'the old primary/00000000', "
                     "since = now() - interval '1 day'")
        # and a dead worker's started job, which rescue would otherwise requeue at once
        ids = _held_by_dead_worker(conn, [(True, None, 0)])
        # When rescue runs on the new server
        assert broker.rescue_once() == {}
        seen_at = conn.execute("SELECT since FROM standmeet.server_epoch").fetchone()[0]
    # Then it recorded the new identity, and judged nobody: every process needs a whole
    # rescue window to reconnect and prove it lives
    assert scalar(database_url, "SELECT identity = standmeet.server_identity() FROM standmeet.server_epoch")
    assert _rows(database_url, ids)[0][0] == "consumed"
    # and rescues the dead worker's job once the new server has been this database's that long
    window = broker.settings.rescue_after_s
    wait_for(lambda: broker.rescue_once() is not None and _rows(database_url, ids)[0][0] == "queued",
             timeout_s=3 * window, interval_s=0.1, what="the job to be rescued")
    waited = scalar(database_url, "SELECT extract(epoch FROM mtime - %s)::float8 FROM dramatiq.queue "
                                  "WHERE message_id = %s", (seen_at, ids[0]))
    assert waited >= window


def test_a_process_never_rescues_its_own_claims_even_when_its_heartbeat_looks_old(broker, database_url):
    # Given a started job claimed by this process, whose heartbeat looks as old as a dead
    # one's (its heartbeat thread was held up, e.g. waiting for a connection)
    broker.prove_alive()
    message = mark.message("held-by-a-slow-heartbeat")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message], delay=60_000))
        conn.execute(HOLD, (broker.worker_id, True, None, 0, message.message_id))
        conn.execute("UPDATE standmeet.worker_processes SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
                     (broker.worker_id,))
        # When its own rescue runs
        broker.rescue_once()
        # Then its claim stays its own
        assert _rows(database_url, [message.message_id])[0][0] == "consumed"
        conn.execute("UPDATE dramatiq.queue SET state = 'done', worker_id = NULL WHERE message_id = %s",
                     (message.message_id,))
    broker.prove_alive()


def test_after_a_restart_rescue_waits_a_window_from_the_servers_start_not_from_the_first_look(
    broker, database_url
):
    from tests.support.db import scalar

    # Given the server's identity recorded with another start time on the same timeline,
    # as after a restart
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE standmeet.server_epoch SET identity = 'an earlier start/' "
                     "|| split_part(standmeet.server_identity(), '/', 2), since = now() - interval '1 day'")
        # and a dead worker's started job
        ids = _held_by_dead_worker(conn, [(True, None, 0)])
    # When rescue runs, the server having started long enough ago
    window = broker.settings.rescue_after_s
    if scalar(database_url, "SELECT pg_postmaster_start_time() > now() - make_interval(secs => %s)", (window,)):
        pytest.skip("the server itself started less than a rescue window ago")
    broker.rescue_once()
    # Then the restart is dated from the server's start, and the dead worker's job is rescued
    assert scalar(database_url, "SELECT since = pg_postmaster_start_time() FROM standmeet.server_epoch")
    assert _rows(database_url, ids)[0][0] == "queued"


#: A live process's row: its heartbeat just now.
LIVE_WORKER = "INSERT INTO standmeet.worker_processes (id, hostname, pid, queues) VALUES (%s, 'live', 2, '{index}')"
#: Messages other tests left waiting in the queue these tests claim from.
DROP_WAITING = "DELETE FROM dramatiq.queue WHERE queue_name = 'index' AND state = 'queued'"
MESSAGE_ROW = "SELECT state::text, worker_id::text, claims, crashes FROM dramatiq.queue WHERE message_id = %s"


def test_a_claim_a_live_process_made_while_rescue_judged_the_dead_ones_is_not_taken_back(broker, database_url):
    # Given a silent process holding a prefetched message, and a live process
    query(database_url, DROP_WAITING)
    [message_id] = _held_by_dead_worker(database_url, [(False, None, 0)])
    query(database_url, "UPDATE dramatiq.queue SET eta = now() WHERE message_id = %s", (message_id,))
    [(dead,)] = query(database_url, "SELECT worker_id::text FROM dramatiq.queue WHERE message_id = %s", (message_id,))
    live = str(uuid.uuid4())
    query(database_url, LIVE_WORKER, (live,))
    # and a rescue pass that has judged from its snapshot, held up before it locks a row
    # (by a lock on the server's epoch, which it reads first)
    rescued: list[dict[str, tuple[int, int]]] = []
    with psycopg.connect(database_url) as holding:
        holding.execute("LOCK TABLE standmeet.server_epoch IN ACCESS EXCLUSIVE MODE")
        judging = threading.Thread(target=lambda: rescued.append(broker.rescue_once()), name="test-rescue")
        judging.start()
        wait_for(lambda: lock_waits(database_url, statement="WITH epoch AS MATERIALIZED") == 1, timeout_s=10,
                 what="rescue waiting")
        # When, meanwhile, the silent process gives the message back and the live one claims and starts it
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.REQUEUE, {"ids": [message_id], "claims": [1], "worker_id": dead})
            claimed = conn.execute(sql.CLAIM, {"queue": "index", "n": 1, "n_start": 1, "worker_id": live,
                                               "claim_until_s": None, **claim_size_params(1 << 20)}).fetchall()
        assert [row[3] for row in claimed] == [message_id]
        holding.commit()
    judging.join(timeout=10)
    assert not judging.is_alive()

    # Then the live process's claim is untouched: not requeued, nobody blamed, no crash recorded
    assert rescued == [{}]
    assert query(database_url, MESSAGE_ROW, (message_id,)) == [("consumed", live, 2, 0)]
    assert query(database_url, "SELECT count(*) FROM standmeet.job_attempts WHERE message_id = %s",
                 (message_id,)) == [(0,)]


def test_runs_that_died_together_are_judged_together_when_one_was_locked_at_the_first_pass(broker, database_url):
    # Given a process that died running two jobs at once
    ids = _held_by_dead_worker(database_url, [(True, None, 0)] * 2)
    # When the first rescue pass meets the second one's row locked (another rescuer, an
    # operator's cancel), and a second pass runs once it is free
    with psycopg.connect(database_url) as holding:
        holding.execute("SELECT 1 FROM dramatiq.queue WHERE message_id = %s FOR UPDATE", (ids[1],))
        broker.rescue_once()
        holding.commit()
    broker.rescue_once()
    # Then both are suspects of that crash, and neither is blamed
    assert _rows(database_url, ids) == [("queued", 0, True, None)] * 2


def test_a_cut_off_process_taking_back_its_blame_keeps_the_rejection_of_a_run_that_followed(broker, database_url):
    # Given a job blamed on a process that was only cut off (rescue requeued it, a crash counted)
    query(database_url, DROP_WAITING)
    [message_id] = _held_by_dead_worker(database_url, [(True, None, 0)])
    [(cut_off,)] = query(database_url, "SELECT worker_id::text FROM dramatiq.queue WHERE message_id = %s",
                         (message_id,))
    broker.rescue_once()
    query(database_url, "UPDATE dramatiq.queue SET eta = now() WHERE message_id = %s", (message_id,))
    # and claimed again by this process, whose run then failed for good
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    proxy = None
    for _ in range(20):
        proxy = proxy or consumer.__next__()
    assert proxy is not None and proxy.message_id == message_id
    consumer.nack(proxy)
    assert broker.settler.flush(5)
    consumer.close()
    [(state, error)] = query(database_url, "SELECT state::text, error FROM dramatiq.queue WHERE message_id = %s",
                             (message_id,))
    assert state == "rejected"

    # When the cut-off process comes back and takes back the blame of the claim it lost
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute(sql.STILL_HELD, {"ids": [message_id], "claims": [1], "worker_id": cut_off}).fetchall() == []
        conn.execute(sql.CLEAR_BLAME, {"ids": [message_id], "claims": [1], "worker_id": cut_off})

    # Then its crash is taken back, and the run that followed keeps its rejection and reason
    assert query(database_url, "SELECT state::text, error, crashes FROM dramatiq.queue WHERE message_id = %s",
                 (message_id,)) == [("rejected", error, 0)]
