"""A process closed while its settler's connection still opens keeps no connection and
stays recorded as stopped. (A module of its own: no other broker on its database.)"""

from __future__ import annotations

import threading

from tests.conftest import configured_broker
from tests.support.db import query, scalar, wait_for
from tests.support.proxy import PostgresProxy

#: The settler sessions open on this database.
SETTLER_SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-settler'
"""


def test_a_process_closed_while_its_settler_connects_keeps_no_connection_and_stays_recorded_stopped(
    direct_database_url,
):
    # Given a process whose new connections take a second and a half to open (its pool
    # already holds one, as after any send), alone on its database
    proxy = PostgresProxy(direct_database_url)
    before = scalar(direct_database_url, SETTLER_SESSIONS)
    assert before == 0
    try:
        with configured_broker(proxy.url) as closing:
            closing.execute("SELECT 1")
            proxy.connect_delay_s = 1.5
            # When it starts consuming, then closes at once, its settler still connecting
            consumer = closing.consume("index", timeout=100)
            consumer.close()
            closing.close()
            worker_id = closing.worker_id
            settler_thread = closing.settler._thread
            assert settler_thread is not None
            wait_for(lambda: not settler_thread.alive, timeout_s=15, what="the settler's thread to end")
        # Then the connection that opened after the close was closed at once, having proved
        # nothing: no settler session is left, the process is not recorded as alive (a row
        # with no stop would look like a live process), and no wake-up listener started
        wait_for(lambda: scalar(direct_database_url, SETTLER_SESSIONS) == before, timeout_s=10,
                 what="no settler session left by the closed process")
        rows = query(direct_database_url, "SELECT stopped_at IS NOT NULL FROM standmeet.worker_processes WHERE id = %s",
                     (worker_id,))
        assert rows in ([], [(True,)]), rows
        assert not [t.name for t in threading.enumerate() if t.name == "wake-listener"]
    finally:
        proxy.close()
