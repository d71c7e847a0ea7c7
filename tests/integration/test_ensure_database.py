"""``ensure_database``, which every process of a fresh machine calls for the embedded
default's database: processes starting together (``run``'s workers, test workers) all
find it made, none fails on another having made it at the same moment. Against the real
server."""

from __future__ import annotations

import threading

from broker.pg.embedded import ensure_database
from tests.support.db import drop_database, scalar, unique_name

STARTING_TOGETHER = 4


def test_processes_making_the_same_database_at_the_same_moment_all_find_it_made(admin_url):
    # Given a database no one has made yet, and callers released at the same instant
    name = unique_name("ensure_together")
    barrier = threading.Barrier(STARTING_TOGETHER)
    failures: list[BaseException] = []

    def start() -> None:
        barrier.wait(timeout=30)
        try:
            ensure_database(admin_url, name)
        except BaseException as exc:  # noqa: BLE001  (the test reports every failure)
            failures.append(exc)

    callers = [threading.Thread(target=start) for _ in range(STARTING_TOGETHER)]
    try:
        # When each makes sure it exists
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(timeout=60)
        # Then none failed, and the database is there
        assert not any(caller.is_alive() for caller in callers)
        assert failures == []
        assert scalar(admin_url, "SELECT count(*) FROM pg_database WHERE datname = %s", (name,)) == 1
    finally:
        drop_database(admin_url, name)


def test_a_database_that_exists_is_left_as_it_is(admin_url):
    name = unique_name("ensure_exists")
    try:
        ensure_database(admin_url, name)
        oid = scalar(admin_url, "SELECT oid FROM pg_database WHERE datname = %s", (name,))
        ensure_database(admin_url, name)
        assert scalar(admin_url, "SELECT oid FROM pg_database WHERE datname = %s", (name,)) == oid
    finally:
        drop_database(admin_url, name)
