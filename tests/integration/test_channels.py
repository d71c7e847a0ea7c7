"""Channel names: the SQL functions every statement notifies through and the names the
Python side listens on are the same, for any queue name a user may declare."""

from __future__ import annotations

import pytest

from broker.engine import sql
from broker.outbox.receipts import channel_for
from tests.support.db import query

QUEUE_NAMES = ["index", "mail", "reports-eu", "Crawl.v2", "q_1"]


@pytest.mark.parametrize("queue", QUEUE_NAMES)
def test_the_enqueue_channel_in_sql_is_the_one_consumers_listen_on(database_url: str, queue: str) -> None:
    [(in_sql,)] = query(database_url, "SELECT standmeet.enqueue_channel(%s)", (queue,))
    assert in_sql == sql.ENQUEUE_CHANNEL.format(queue=queue)


@pytest.mark.parametrize("queue", QUEUE_NAMES)
def test_the_receipt_channel_in_sql_is_the_one_waiters_listen_on(database_url: str, queue: str) -> None:
    [(in_sql,)] = query(database_url, "SELECT standmeet.receipt_channel(%s)", (queue,))
    assert in_sql == channel_for(queue) == sql.RECEIPT_CHANNEL.format(queue=queue)


def test_the_outbox_channel_in_sql_is_the_one_the_relay_listens_on(database_url: str) -> None:
    [(in_sql,)] = query(database_url, "SELECT standmeet.outbox_channel()")
    assert in_sql == sql.OUTBOX_CHANNEL


def test_no_statement_spells_a_channel_name_itself() -> None:
    # Every NOTIFY in the runtime's SQL goes through a channel function or a bound parameter.
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "broker"
    spelt = []
    for path in root.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for call in re.findall(r"pg_notify\(([^,]+),", line):
                if not (call.startswith("standmeet.") or call.startswith("%")):
                    spelt.append(f"{path.relative_to(root)}:{number}: {call}")
    assert spelt == []
