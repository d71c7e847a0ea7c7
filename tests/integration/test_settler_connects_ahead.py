"""A consuming process's settler opens its connection when consuming begins, not when the
first run ends. (A module of its own: the module's broker has claimed and settled
nothing before this test.)"""

from __future__ import annotations

from tests.support.db import scalar, wait_for

REGISTERED = "SELECT count(*) FROM standmeet.worker_processes WHERE id = %s"


def test_a_consuming_process_opens_its_settler_connection_before_any_run_ends(broker, database_url):
    # Given a broker that has claimed nothing: no connection of it has proved its process
    # alive (every claim and settle connection does so first)
    assert scalar(database_url, REGISTERED, (broker.worker_id,)) == 0
    # When it starts consuming a queue, its consumer not yet connected (nothing claimed)
    broker.claiming = True
    consumer = broker.consume("index", timeout=100)
    try:
        # Then the settler connects at once and proves the process alive on it: a drain's
        # first settle does not wait for a new connection while the claims after it wait
        wait_for(lambda: scalar(database_url, REGISTERED, (broker.worker_id,)) == 1, timeout_s=10,
                 what="the settler's connection, opened before any outcome")
        assert broker.settler.written == 0 and broker.settler.pending() == 0
        # and whoever asks for it meanwhile is given that same connection
        assert broker.settler._connection() is broker.settler._connection()
    finally:
        consumer.close()
