"""A process with more than 1024 descriptors open still waits on its sockets.

``select()`` refuses a descriptor numbered 1024 or more ("filedescriptor out of range"):
a busy process (many connections, many sockets) gets such descriptors, and every pooled
connection then looked dead and every consumer's wait failed. The waits use ``poll``.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import pytest

from broker.pg import db
from broker.pg.pool import readable
from tests.support.db import scalar, wait_for
from tests.support.jobs import mark

#: Descriptors this test holds open, so that every new one is numbered above 1024.
HELD = 1100


@pytest.fixture
def many_descriptors() -> Iterator[list[int]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HELD + 200:
        pytest.skip(f"this process may open at most {hard} descriptors")
    if soft != resource.RLIM_INFINITY and soft < HELD + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(HELD + 1000, hard) if hard != resource.RLIM_INFINITY
                                                    else HELD + 1000, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(HELD)]
    try:
        yield held
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_descriptor_above_1024_is_waited_on(many_descriptors):
    read_end, write_end = os.pipe()
    try:
        assert read_end >= 1024
        assert readable([read_end], 0) == []
        os.write(write_end, b"x")
        assert readable([read_end], 1.0) == [read_end]
    finally:
        os.close(read_end)
        os.close(write_end)


def test_pooled_connections_and_a_worker_keep_working_above_1024_descriptors(
        broker, database_url, start_worker, many_descriptors):
    # Given a process holding over a thousand descriptors, so that its next sockets are
    # numbered above 1024
    # When a job borrows a pooled connection, and a worker claims, waits and runs jobs
    with db.connection() as conn:
        assert conn.fileno() >= 1024
        assert conn.execute("SELECT 1").fetchone() == (1,)
    start_worker(queues=["index"], threads=2)
    message = mark.send("above-1024")
    # Then the job runs, and the pool hands out its connection again (checked, not discarded)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'above-1024'") == 1,
             timeout_s=15, what="the job to run while the process holds many descriptors")
    with db.connection() as conn:
        assert conn.execute("SELECT 2").fetchone() == (2,)
    assert message.message_id
