"""An outcome the database refuses for what its own row holds is set aside, rejected with
the reason; the other outcomes of its batch, and every later one, are written. Before, the
settler wrote the failing batch again first, forever: no outcome of that worker was
written again, and its heartbeats went on, so nothing rescued its jobs."""

from __future__ import annotations

import psycopg

from tests.support.db import query, scalar, wait_for
from tests.support.jobs import noop

#: A row Postgres refuses to record done: the test's stand-in for any outcome a unique,
#: check or data rule refuses (it raises as the unique index would).
REFUSE_DONE = """
CREATE OR REPLACE FUNCTION test_refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW."state" = 'done' AND NEW.message->'args'->>0 = 'refused-outcome' THEN
        RAISE unique_violation USING MESSAGE = 'refused by the test';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_refuse_done BEFORE UPDATE ON dramatiq.queue FOR EACH ROW EXECUTE FUNCTION test_refuse_done();
"""
FORGET = "DROP TRIGGER IF EXISTS test_refuse_done ON dramatiq.queue; DROP FUNCTION IF EXISTS test_refuse_done();"
STATE = "SELECT state::text, error FROM dramatiq.queue WHERE message_id = %s"


def test_an_outcome_the_database_refuses_is_set_aside_and_the_others_are_written(
        broker, database_url, start_worker):
    # Given a job whose outcome the database refuses, sent with others
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(REFUSE_DONE)
    try:
        refused = noop.send("refused-outcome")
        others = [noop.send(f"settled-beside-{n}") for n in range(5)]
        # When a worker runs them all
        start_worker(queues=["index"], threads=4)
        # Then the others are done, and the refused one is rejected with the reason
        for message in others:
            wait_for(lambda m=message: scalar(database_url, "SELECT state::text FROM dramatiq.queue"
                                                            " WHERE message_id = %s", (m.message_id,)) == "done",
                     timeout_s=20, what=f"{message.message_id} to be done")
        wait_for(lambda: query(database_url, STATE, (refused.message_id,))[0][0] == "rejected", timeout_s=20,
                 what="the refused outcome to be set aside")
        (state, error), = query(database_url, STATE, (refused.message_id,))
        assert error.startswith("its outcome (done) could not be written, set aside: UniqueViolation: "
                                "refused by the test"), error
        # And the worker goes on writing outcomes
        later = noop.send("settled-after")
        wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                                (later.message_id,)) == "done", timeout_s=20, what="a later job to be done")
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(FORGET)
