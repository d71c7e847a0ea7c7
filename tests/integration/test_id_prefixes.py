"""A job id prefix (8+ hex digits, as `status` prints) names the one job whose id starts
with it; an ambiguous, short or malformed one is refused in one line; the lookup is a
range of the primary key, not a scan of the ids as text."""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest

from broker import ops
from tests.support.db import query
from tests.support.job_rows import drop_queue, put_jobs

QUEUE = "id_prefixes"
TWINS = ["0b5a1c2d-0000-4000-8000-000000000001", "0b5a1c2d-ffff-4000-8000-000000000002"]
ALONE = "0b5a1c2e-1234-4000-8000-000000000003"


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection]:
    put_jobs(database_url, QUEUE, ids=[*TWINS, ALONE])
    with psycopg.connect(database_url, autocommit=True) as c:
        yield c
    drop_queue(database_url, QUEUE)


@pytest.mark.parametrize("given", ["0b5a1c2e", "0B5A1C2E", "0b5a1c2e-", "0b5a1c2e-12", "0b5a1c2e1234", ALONE])
def test_a_unique_prefix_of_8_or_more_hex_digits_names_its_job(conn, given):
    assert ops.resolve_job_id(conn, given) == ALONE


def test_an_ambiguous_prefix_is_refused_naming_the_jobs_it_matches(conn):
    with pytest.raises(ops.OpsError) as refused:
        ops.resolve_job_id(conn, "0b5a1c2d")
    line = str(refused.value)
    assert "'0b5a1c2d' is ambiguous" in line and all(twin in line for twin in TWINS) and "give more" in line
    assert "\n" not in line
    assert ops.resolve_job_id(conn, "0b5a1c2d-f") == TWINS[1]


def test_an_ambiguous_prefix_names_only_the_first_few_matches(database_url, conn):
    many = [f"0c000000-0000-4000-8000-{n:012x}" for n in range(ops.AMBIGUOUS_SHOWN + 3)]
    put_jobs(database_url, QUEUE, ids=many)
    with pytest.raises(ops.OpsError) as refused:
        ops.resolve_job_id(conn, "0c000000")
    line = str(refused.value)
    assert sum(i in line for i in many) == ops.AMBIGUOUS_SHOWN and line.endswith("and more; give more of the id")


@pytest.mark.parametrize("given, says", [
    ("0b5a1c2", "'0b5a1c2' is not a job id: a prefix needs at least 8 hex digits"),
    ("0b5a", "at least 8 hex digits"),
    ("zzzzzzzz", "'zzzzzzzz' is not a job id or the start of one"),
    ("0b5a-1c2d", "is not a job id or the start of one"),
    ("0b5a1c2d%", "is not a job id or the start of one"),
    ("", "is not a job id or the start of one"),
    ("0b5a1c2f", "no job id starts with '0b5a1c2f'"),
])
def test_a_short_malformed_or_unmatched_prefix_is_refused_in_one_line(conn, given, says):
    with pytest.raises(ops.OpsError, match=says.replace("(", r"\(")) as refused:
        ops.resolve_job_id(conn, given)
    assert "\n" not in str(refused.value)


def test_a_whole_id_is_taken_as_it_is_and_ids_are_resolved_once_each(conn):
    missing = "0b5a1c2f-0000-4000-8000-000000000000"
    assert ops.resolve_job_id(conn, missing) == missing  # whether it exists is the caller's question
    assert ops.resolve_job_ids(conn, ["0b5a1c2e", ALONE, "0b5a1c2d-0"]) == [ALONE, TWINS[0]]


def test_the_list_filter_takes_a_prefix_of_any_length_as_a_range(conn):
    assert {j.id for j in ops.list_jobs(conn, queue=QUEUE, message_id="0b5a1c2")} == {*TWINS, ALONE}
    assert {j.id for j in ops.list_jobs(conn, queue=QUEUE, message_id="0b5a1c2d-f")} == {TWINS[1]}
    assert ops.count_jobs(conn, queue=QUEUE, message_id="0b5a1c2d") == 2
    with pytest.raises(ops.OpsError, match="is not a job id or the start of one"):
        ops.list_jobs(conn, message_id="0b5a_")


def test_a_prefix_is_looked_up_by_an_index_range_on_100k_jobs(database_url, conn):
    bulk = "id_prefixes_bulk"
    query(database_url, """
        INSERT INTO dramatiq.queue (message_id, queue_name, "state", message)
        SELECT gen_random_uuid(), %s, 'done', '{}'::jsonb FROM generate_series(1, 100000)
    """, (bulk,))
    try:
        conn.execute("ANALYZE dramatiq.queue")
        low, high = ops.id_range("0b5a1c2d", min_hex=ops.MIN_ID_PREFIX_HEX)
        (plan,) = conn.execute(b"EXPLAIN (FORMAT JSON) " + ops.JOB_IDS_IN_RANGE.encode(),
                               {"low": low, "high": high, "limit": ops.AMBIGUOUS_SHOWN + 1}).fetchone()
        text = json.dumps(plan)
        assert '"Index Name": "queue_pkey"' in text and "Seq Scan" not in text, text
        assert ops.resolve_job_id(conn, "0b5a1c2e") == ALONE
    finally:
        drop_queue(database_url, bulk)
