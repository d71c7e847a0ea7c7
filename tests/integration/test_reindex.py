"""corpus.reindex: batches under a deadline; interrupted, it resumes; subscribers run."""

from __future__ import annotations

from actors import corpus
from actors.search import search_index
from tests.support.db import lock_waits, query, scalar, wait_for


def test_a_rebuild_cut_by_its_deadline_resumes_without_redoing_batches_and_tells_its_subscribers(
    broker, database_url, start_worker
):
    # Given 60 documents, and a rebuild whose margin (1 s of a 1 s limit) ends each run after one batch
    ids = [row[0] for row in query(
        database_url,
        "INSERT INTO standmeet.documents (title, body) SELECT 'doc ' || g, 'reindexword' || g"
        " FROM generate_series(1, 60) g RETURNING id")]
    start_worker(queues=["index"], threads=4)  # the worker runs the relay too (for the subscribers)
    before = scalar(database_url, "SELECT coalesce(max(id), 0) FROM standmeet.reindex_runs")  # runs are ours after it
    job = corpus.reindex.send_with_options(kwargs={"batch_size": 10, "margin_s": 1.0}, time_limit=1000)
    # When it runs to the end
    wait_for(lambda: scalar(database_url, "SELECT announced_at IS NOT NULL FROM standmeet.reindex_runs WHERE id > %s"
                                          " ORDER BY id DESC LIMIT 1", (before,)),
             timeout_s=30, what="the rebuild to finish and its subscriber to run")
    # Then it took several runs of the same job (snoozes, not retries) ...
    options = scalar(database_url, "SELECT message->'options' FROM dramatiq.queue WHERE message_id = %s", (job.message_id,))
    assert options.get("snoozes", 0) == 6, options  # six batches, then the run that finds none left
    assert options.get("retries", 0) == 0
    # ... and each batch was indexed once: consecutive, disjoint, covering every document
    batches = query(database_url, "SELECT first_id, last_id, documents FROM standmeet.reindex_batches WHERE run_id > %s"
                                  " ORDER BY first_id", (before,))
    assert sum(b[2] for b in batches) == 60
    assert [b[0] for b in batches] == sorted(ids)[::10]
    assert all(prev[1] < nxt[0] for prev, nxt in zip(batches, batches[1:], strict=False))
    (indexed, finished) = query(database_url, "SELECT indexed, finished_at IS NOT NULL FROM standmeet.reindex_runs"
                                              " WHERE id > %s", (before,))[0]
    assert (indexed, finished) == (60, True)
    assert len(search_index().search("reindexword37")) == 1


def test_two_rebuilds_starting_together_share_one_run(broker, database_url):
    import threading

    import psycopg

    # Given a rebuild opening its run, not committed yet (another process's job, mid-start)
    query(database_url, "UPDATE standmeet.reindex_runs SET finished_at = now() WHERE finished_at IS NULL")
    with psycopg.connect(database_url) as first:
        first.execute("SELECT 1")  # (its transaction open: the run is opened within it)
        first_run = corpus.open_run(first)
        # When a second rebuild starts meanwhile
        second_run: list[int] = []

        def start_second() -> None:
            with psycopg.connect(database_url, autocommit=True) as second:
                second_run.append(corpus.open_run(second))

        starting = threading.Thread(target=start_second, name="test-second-rebuild")
        starting.start()
        wait_for(lambda: not starting.is_alive() or lock_waits(database_url, event="advisory") == 1,
                 timeout_s=10, what="the second rebuild opening its run, or waiting for the first")
        first.commit()
    starting.join(timeout=10)
    assert not starting.is_alive()
    # Then it resumes the first one's run: one rebuild is open, not two
    assert second_run == [first_run]
    assert scalar(database_url, "SELECT count(*) FROM standmeet.reindex_runs WHERE finished_at IS NULL") == 1
