"""The broker keeps Dramatiq's whole ``Broker`` contract, against the real Postgres.

Where a behaviour is documented by Dramatiq, the test says which page: "Broker API"
(dramatiq.Broker: declare_queue, enqueue, consume, join, flush), "Results"
(store_results, get_result, ResultFailure), "Composition" (pipelines, groups,
completion callbacks), "Rate limiting" (ConcurrentRateLimiter), and the actor
``priority`` option ("lower numbers mean higher priority").
"""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.errors import QueueJoinTimeout, QueueNotFound
from dramatiq.results import ResultFailure

from tests.support.contract_jobs import add, fail, group_done, ordered, slow, work
from tests.support.db import query, scalar, wait_for


def _labels(url: str, actor: str, prefix: str) -> list[str]:
    return [row[0] for row in query(url, "SELECT label FROM test_runs WHERE actor = %s AND label LIKE %s"
                                         " ORDER BY started_at, id", (actor, prefix + "%"))]


def test_declared_queues_are_listed_and_delays_need_no_delay_queues(broker):
    # "Broker API": declare_queue, get_declared_queues, get_declared_delay_queues
    broker.declare_queue("contract-extra")
    assert {"index", "notify", "webhook", "maintenance", "fetch", "contract-extra"} <= broker.get_declared_queues()
    assert broker.get_declared_delay_queues() == set()  # delays live in the eta column


def test_consuming_an_undeclared_queue_raises_queue_not_found(broker):
    # "Broker API": consume raises QueueNotFound for a queue that was never declared
    with pytest.raises(QueueNotFound):
        broker.consume("never-declared")


def test_a_delayed_message_waits_in_the_database_until_due(broker, database_url):
    message = work.send_with_options(args=("delayed",), delay=60_000)
    assert query(database_url, "SELECT state::text, eta > now() + interval '50 seconds' FROM dramatiq.queue"
                               " WHERE message_id = %s", (message.message_id,)) == [("queued", True)]
    broker.flush("index")


def test_flush_drops_the_waiting_messages_of_one_queue_and_flush_all_of_every_queue(broker, database_url):
    # "Broker API": flush(queue) and flush_all() drop the messages that wait
    index = work.send("flushed")
    fetch = slow.send(1)
    broker.flush("index")
    ids = [index.message_id, fetch.message_id]
    left = lambda: [r[0] for r in query(database_url, "SELECT message_id::text FROM dramatiq.queue"  # noqa: E731
                                                      " WHERE message_id = ANY(%s::uuid[])", (ids,))]
    assert left() == [fetch.message_id]
    broker.flush_all()
    assert left() == []
    with pytest.raises(QueueNotFound):
        broker.flush("never-declared")


def test_join_waits_until_the_queue_has_nothing_queued_delayed_or_running(broker, database_url, start_worker):
    # "Broker API": join(queue_name, *, timeout=None) in milliseconds
    start_worker(queues=["index"], threads=4)
    messages = [work.send(f"join-{i}", 100) for i in range(6)]
    broker.join("index", timeout=20_000)
    states = query(database_url, "SELECT DISTINCT state::text FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                   ([m.message_id for m in messages],))
    assert states == [("done",)]


@pytest.mark.slow  # waits out a real timer of a second or more
def test_join_raises_queue_join_timeout_past_its_timeout(broker, start_worker):
    start_worker(queues=["fetch"], threads=3)
    slow.send(2_000)
    with pytest.raises(QueueJoinTimeout):
        broker.join("fetch", timeout=200)
    broker.join("fetch", timeout=20_000)


def test_results_come_back_and_failures_come_back_as_result_failure(broker, start_worker):
    # "Results": store_results=True; get_result(block=True); a failure raises ResultFailure
    start_worker(queues=["index"], threads=4)
    assert add.send(2, 3).get_result(block=True, timeout=10_000) == 5
    with pytest.raises(ResultFailure) as info:
        fail.send("no luck").get_result(block=True, timeout=10_000)
    assert info.value.orig_exc_type == "ValueError" and info.value.orig_exc_msg == "no luck"


def test_a_pipeline_passes_each_result_to_the_next_step(broker, start_worker):
    # "Composition": pipelines; each step's result is appended to the next step's arguments
    start_worker(queues=["index"], threads=4)
    pipe = dramatiq.pipeline([add.message(1, 2), add.message(10), add.message(100)])
    pipe.run()
    assert pipe.get_result(block=True, timeout=10_000) == 113


def test_a_groups_completion_callback_runs_once_after_every_member(broker, database_url, start_worker):
    # "Composition": group(...).add_completion_callback(...) needs a rate-limiter backend
    start_worker(queues=["index"], threads=4)
    members = [work.message(f"grouped-{i}", 20) for i in range(5)]
    group = dramatiq.group(members)
    group.add_completion_callback(group_done.message("group-finished"))
    group.run()
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'group-finished'"),
             timeout_s=15, what="the completion callback")
    finished_members = scalar(database_url, "SELECT max(finished_at) FROM test_runs WHERE label LIKE 'grouped-%%'")
    callback_start = scalar(database_url, "SELECT started_at FROM test_runs WHERE label = 'group-finished'")
    assert callback_start >= finished_members
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'group-finished'") == 1


def test_a_lower_priority_number_is_claimed_first_among_due_messages(broker, database_url, start_worker):
    # actor priority: "lower numbers mean higher priority"; here per message, among due ones
    # Given, on a queue with one worker, three low-priority messages sent before three high
    for i in range(3):
        ordered.send_with_options(args=(f"prio-low-{i}",), priority=10)
    for i in range(3):
        ordered.send_with_options(args=(f"prio-high-{i}",), priority=0)
    # When a worker serves it
    start_worker(queues=["contract-prio"], threads=1)
    wait_for(lambda: len(_labels(database_url, "contract.ordered", "prio-")) == 6, timeout_s=15, what="six runs")
    # Then every high-priority message ran before any low-priority one
    order = _labels(database_url, "contract.ordered", "prio-")
    assert [label.split("-")[1] for label in order] == ["high"] * 3 + ["low"] * 3, order


def test_an_encoder_that_does_not_write_json_is_refused_with_a_clear_error(broker, database_url):
    from broker import configure
    from broker.errors import ConfigError

    previous = dramatiq.get_encoder()
    dramatiq.set_encoder(dramatiq.PickleEncoder())
    try:
        with pytest.raises(ConfigError, match="PickleEncoder.*JSON"):
            configure(broker.settings, url=database_url)
        with pytest.raises(ConfigError, match="PickleEncoder"):
            work.send("pickled")
    finally:
        dramatiq.set_encoder(previous)


class _Seen(dramatiq.Middleware):
    """Records the messages whose before-enqueue hook it saw."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def before_enqueue(self, broker, message, delay):
        self.seen.append(message.message_id)


def test_middleware_added_replaced_or_removed_after_messages_were_sent_sees_exactly_the_later_ones(broker):
    # Given a broker that has already dispatched signals (its hooks are cached)
    add.send(1, 1)
    first, second = _Seen(), _Seen()
    try:
        # When one middleware is added, then swapped in place for another, then removed
        broker.add_middleware(first)
        one = add.send(1, 2)
        broker.middleware[broker.middleware.index(first)] = second
        two = add.send(1, 3)
        broker.middleware.remove(second)
        add.send(1, 4)
    finally:
        broker.middleware[:] = [m for m in broker.middleware if m not in (first, second)]
    # Then each saw exactly the messages sent while it was in the list
    assert first.seen == [one.message_id]
    assert second.seen == [two.message_id]


def test_a_claimed_message_reads_as_the_message_it_carries(broker):
    from broker.engine.consumer import ClaimedMessage

    message = add.message(2, 3)
    claimed = ClaimedMessage(message, claim=1, claimed_at=0.0)
    claimed.options["retries"] = 1  # what the Retries middleware writes is the message's own
    assert (claimed.queue_name, claimed.actor_name, claimed.args, claimed.kwargs, claimed.message_id,
            claimed.message_timestamp) == (message.queue_name, message.actor_name, message.args,
                                           message.kwargs, message.message_id, message.message_timestamp)
    assert message.options["retries"] == 1
    assert claimed.asdict() == message.asdict()
    assert claimed == message
