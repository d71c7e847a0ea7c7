"""Per-queue concurrency limits hold in one process, whatever its thread count."""

from __future__ import annotations

from actors.queues import QUEUE_NAMES, QUEUES
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP

#: The highest number of runs of a queue that overlapped, from the rows the jobs wrote.
MAX_OVERLAP = """
SELECT a.queue, max((
    SELECT count(*) FROM test_runs b
    WHERE b.queue = a.queue AND b.started_at <= a.started_at AND b.finished_at > a.started_at
)) AS overlap
FROM test_runs a
WHERE a.label = %s
GROUP BY a.queue
"""


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


def test_a_queue_at_its_limit_starts_the_next_job_as_soon_as_one_finishes(broker, database_url, start_worker):
    # Given the maintenance queue (limit 1) with a row of short jobs
    for _ in range(10):
        SLEEP["maintenance"].send(50, "handoff")
    start_worker(queues=["maintenance"], threads=4)
    wait_for(
        lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'handoff' AND finished_at IS NOT NULL") == 10,
        timeout_s=30,
        what="the ten maintenance jobs",
    )
    # Then each job started right after the previous one finished: no back-off wait
    gaps = [
        row[0]
        for row in query(
            database_url,
            """
            SELECT EXTRACT(EPOCH FROM started_at - lag(finished_at) OVER (ORDER BY started_at))
            FROM test_runs WHERE label = 'handoff' ORDER BY started_at
            """,
        )[1:]
    ]
    assert max(gaps) < 0.25, gaps
