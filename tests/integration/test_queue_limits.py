"""Per-queue concurrency limits hold in one process, whatever its thread count.

Two layers hold a queue to its limit: the consumer hands out at most ``limit`` claimed
messages at once (``QueueState``), and the ``QueueConcurrency`` middleware's semaphore
lets at most ``limit`` of them run. Each layer is tested here with the other one
unable to help, so that removing either one alone fails a test.
"""

from __future__ import annotations

import linecache
import sys
import threading
import time

import psycopg
import pytest

from actors.queues import QUEUE_NAMES, QUEUES
from tests.conftest import configured_broker, slow_polls
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP

#: The maintenance queue's fallback poll and its test consumer's wait, in seconds: far
#: above the hand-off latency asserted, so only the wake-up of a finished job passes.
LONG_S = 30.0
HANDOFF_S = 5.0

#: The highest number of runs of a queue that overlapped, from the rows the jobs wrote.
MAX_OVERLAP = """
SELECT a.queue, max((
    SELECT count(*) FROM test_runs b
    WHERE b.queue = a.queue AND b.label = a.label
      AND b.started_at <= a.started_at AND b.finished_at > a.started_at
)) AS overlap
FROM test_runs a
WHERE a.label = %s
GROUP BY a.queue
"""

#: Hold a message's row, so that its settle waits (the settler's UPDATE blocks on it).
LOCK_ROW = "SELECT 1 FROM dramatiq.queue WHERE message_id = %s FOR UPDATE"
STATE = "SELECT state::text FROM dramatiq.queue WHERE message_id = %s"
STARTED = """
SELECT count(*) FROM dramatiq.queue
WHERE message_id = ANY(%s::uuid[]) AND state = 'consumed' AND started_at IS NOT NULL
"""
FORGET = "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
STARTED_ROW = "SELECT state::text, started_at IS NOT NULL FROM dramatiq.queue WHERE message_id = %s"


@pytest.fixture(scope="module")
def broker(database_url):
    with configured_broker(database_url, **slow_polls(LONG_S, "maintenance")) as configured:
        yield configured


def _waiting_in_select(thread: threading.Thread) -> bool:
    """The thread is blocked in the consumer's wait (its poll, in ``pgpool.readable``
    called on its connection and wake pipe), not about to look again."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_back is None:
        return False
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    caller = linecache.getline(frame.f_back.f_code.co_filename, frame.f_back.f_lineno)
    return "poller.poll(" in line and "readable([conn.fileno(), self.state.wake_fd]" in caller


def _finish(broker, consumer, proxy) -> None:
    """What the worker does when a job returns: after-hooks, then the ack."""
    broker.emit_after("process_message", proxy, result=None)
    consumer.ack(proxy)


@pytest.mark.slow  # waits out a real timer of a second or more
def test_each_queue_runs_at_most_its_limit_and_reaches_it(broker, database_url, start_worker):
    # Given 20 slow jobs on each of the five queues
    jobs_per_queue = 20
    for queue in QUEUE_NAMES:
        for _ in range(jobs_per_queue):
            SLEEP[queue].send(150, "limits")
    # When one process with 32 threads drains them
    start_worker(queues=list(QUEUE_NAMES), threads=32)
    wait_for(
        lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'limits' AND finished_at IS NOT NULL")
        == jobs_per_queue * len(QUEUE_NAMES),
        timeout_s=60,
        what="all 100 jobs to finish",
    )
    # Then the concurrency each queue reached, as the database saw it, is exactly its limit
    observed = dict(query(database_url, MAX_OVERLAP, ("limits",)))
    expected = {queue: QUEUES[queue][0] for queue in QUEUE_NAMES}
    assert observed == expected




def test_a_queue_at_its_limit_starts_its_next_job_the_moment_one_finishes(broker, database_url):
    # Given the maintenance queue (limit 1, one more prefetched) with two jobs claimed by
    # its consumer: the first running, the second waiting in the buffer
    state = broker.queue_states["maintenance"]
    assert (state.limit, state.prefetch, state.settings.poll_s) == (1, 1, LONG_S)
    first_message = SLEEP["maintenance"].send(0, "handoff-first")
    second_message = SLEEP["maintenance"].send(0, "handoff-second")
    broker.claiming = True
    consumer = broker.consume("maintenance", timeout=int(LONG_S * 1000))
    first = consumer.__next__()
    assert first is not None and first.message_id == first_message.message_id
    # And the consumer's thread waiting for its next job, which no NOTIFY, poll or
    # timeout would end within 30 s
    handed: list[tuple[object, float]] = []

    def next_job() -> None:
        deadline = time.monotonic() + 2 * LONG_S
        while not handed and time.monotonic() < deadline:
            proxy = consumer.__next__()
            if proxy is not None:
                handed.append((proxy, time.monotonic()))

    thread = threading.Thread(target=next_job, name="test-consumer", daemon=True)
    thread.start()
    wait_for(lambda: _waiting_in_select(thread), timeout_s=10, what="the consumer to wait")
    # And the first job's settle held back (its row locked), so that its write cannot
    # wake the consumer either
    with psycopg.connect(database_url) as holder:
        holder.execute(LOCK_ROW, (first.message_id,))
        # When the first job finishes
        ended = time.monotonic()
        _finish(broker, consumer, first)
        # Then the second starts at once, before the first one's settle is even written
        thread.join(HANDOFF_S)
        assert handed, f"the next job did not start within {HANDOFF_S} s of the previous one's end"
        second, started = handed[0]
        assert second.message_id == second_message.message_id
        assert scalar(database_url, STATE, (first.message_id,)) == "consumed"
        print(f"hand-off: the next job started {1000 * (started - ended):.1f} ms after one finished")
    # And once the settler gets through, the second is recorded as started (a prefetched
    # message that started can be blamed if its process dies)
    assert broker.settler.flush(10)
    assert query(database_url, STARTED_ROW, (second.message_id,)) == [("consumed", True)]
    _finish(broker, consumer, second)
    assert broker.settler.flush(10)
    assert [scalar(database_url, STATE, (m.message_id,)) for m in (first, second)] == ["done", "done"]
    consumer.close()


def test_a_consumer_hands_out_no_more_than_its_queues_limit_at_once(broker, database_url):
    # Given six due jobs on the fetch queue (limit 3, one more prefetched)
    state = broker.queue_states["fetch"]
    assert (state.limit, state.prefetch) == (3, 1)
    ids = [SLEEP["fetch"].send(0, "handout").message_id for _ in range(6)]
    broker.claiming = True
    consumer = broker.consume("fetch", timeout=50)
    # When its consumer is asked for a job twenty times while none finishes
    handed = [p for p in (consumer.__next__() for _ in range(20)) if p is not None]
    # Then it handed out exactly its limit, and the database shows that many started
    assert len(handed) == 3, [p.message_id for p in handed]
    assert broker.settler.flush(5)
    assert scalar(database_url, STARTED, (ids,)) == 3
    for proxy in handed:
        _finish(broker, consumer, proxy)
    buffered = state.take_buffer()
    broker.requeue([c.message for c in buffered], [c.number for c in buffered])
    assert broker.settler.flush(5)
    consumer.close()
    query(database_url, FORGET, (ids,))


@pytest.mark.slow  # waits out a real timer of a second or more
def test_the_middleware_holds_a_queue_to_its_limit_when_its_consumer_hands_out_more(
    broker, database_url, start_worker
):
    # Given the fetch queue (limit 3) whose consumer in this process hands out up to 8
    # at once, as if the consumer's own bound were gone
    state = broker.queue_states["fetch"]
    assert broker.queue_settings("fetch").max_workers == 3
    state.limit = 8
    try:
        # When one process with 16 threads drains 16 slow jobs of that queue
        for _ in range(16):
            SLEEP["fetch"].send(300, "middleware-bound")
        start_worker(queues=["fetch"], threads=16)
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'middleware-bound'"
                                              " AND finished_at IS NOT NULL") == 16,
                 timeout_s=60, what="the 16 jobs to finish")
    finally:
        state.limit = 3
    # Then, as the jobs' own rows show, never more than 3 ran at once, and 3 did
    assert dict(query(database_url, MAX_OVERLAP, ("middleware-bound",))) == {"fetch": 3}
