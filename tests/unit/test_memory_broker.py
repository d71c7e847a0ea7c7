"""The memory broker (``broker.testing``): this runtime's policies, in memory, in milliseconds.

Each test declares its own actors on a fresh memory broker and observes a policy from
inside the actors or from the broker's outcome lists; none touches a database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import dramatiq
import pytest
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.results import ResultMissing

from broker import deadline, services
from broker.errors import JobCancelled, ResultRefused
from broker.testing import MemoryBroker
from middleware import Lease, Snooze

ROOT = Path(__file__).resolve().parents[2]
#: How long a test waits at most for something it polls for (never reached when it works).
WAIT_S = 5.0


def start_worker(broker: MemoryBroker, *, threads: int = 8) -> dramatiq.Worker:
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=20)
    worker.start()
    broker.started_workers.append(worker)  # type: ignore[attr-defined]
    return worker


def poll(condition: Callable[[], object], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.001)


def test_a_queue_never_runs_more_than_its_max_workers_at_once(make_broker):
    broker = make_broker(queues={"mem_conc": 2})
    lock = threading.Lock()
    running: list[int] = [0]
    peak: list[int] = [0]
    entered = threading.Semaphore(0)
    gate = threading.Event()

    @dramatiq.actor(queue_name="mem_conc")
    def bounded(i: int) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        entered.release()
        gate.wait(WAIT_S)
        with lock:
            running[0] -= 1

    start_worker(broker, threads=8)
    for i in range(6):
        bounded.send(i)
    assert entered.acquire(timeout=WAIT_S) and entered.acquire(timeout=WAIT_S)
    # two run and hold their slots: a third must not start while 6 threads are idle
    assert not entered.acquire(timeout=0.1)
    assert peak[0] == 2
    gate.set()
    broker.join("mem_conc", timeout=5_000)
    assert peak[0] == 2
    assert len([m for m in broker.done if m.actor_name == "bounded"]) == 6


def test_a_snoozed_job_runs_again_after_its_delay_without_a_retry_counted(make_broker):
    broker = make_broker()
    seen: list[int] = []

    @dramatiq.actor(queue_name="mem_snooze")
    def waits_its_turn() -> None:
        seen.append(len(seen))
        if len(seen) == 1:
            raise Snooze(30, "not yet")

    message = waits_its_turn.send()
    assert broker.drain(advance=False) == 1
    assert seen == [0]
    (waiting,) = broker.waiting("mem_snooze")
    assert waiting.message_id == message.message_id and waiting.options["snoozes"] == 1
    broker.advance(29)
    assert broker.drain(advance=False) == 0  # not due yet
    broker.advance(1.5)
    assert broker.drain(advance=False) == 1
    assert seen == [0, 1]
    (done,) = broker.done
    assert done.message_id == message.message_id and "retries" not in done.options
    assert broker.dead_letters == []


def test_a_job_snoozed_past_its_cap_fails_with_the_reason(make_broker):
    broker = make_broker()

    @dramatiq.actor(queue_name="mem_snooze", max_snoozes=2)
    def never_ready() -> None:
        raise Snooze(5)

    never_ready.send()
    assert broker.drain() == 3
    (rejected,) = broker.dead_letters
    assert rejected.options["error"] == "snoozed 3 times, more than its cap of 2"
    assert broker.done == []


def test_a_failing_job_is_retried_with_back_off_then_rejected(make_broker):
    broker = make_broker(max_retries=2)
    attempts: list[float] = []

    @dramatiq.actor(queue_name="mem_retry")
    def flaky(succeed_on: int) -> None:
        attempts.append(broker.clock.monotonic())
        if len(attempts) < succeed_on:
            raise RuntimeError(f"attempt {len(attempts)} fails")

    flaky.send(3)
    assert broker.drain() == 3  # the back-offs (a minute and more) jumped, not waited
    assert broker.clock.advanced_s >= 60
    assert attempts[1] - attempts[0] >= 60  # min_backoff_ms=60_000
    (done,) = broker.done
    assert done.options["retries"] == 2 and "attempt 2 fails" in done.options["traceback"]

    attempts.clear()
    flaky.send(10)
    assert broker.drain() == 3  # the first run and max_retries=2 retries
    (rejected,) = broker.dead_letters
    assert isinstance(rejected._exception, RuntimeError)
    with pytest.raises(RuntimeError, match="attempt 3 fails"):
        broker.join("mem_retry")  # fail_fast, as Dramatiq's StubBroker


def test_a_job_past_its_time_limit_is_stopped_and_counts_as_a_failure(make_broker):
    broker = make_broker(max_retries=0)
    finished: list[bool] = []

    @dramatiq.actor(queue_name="mem_limit", time_limit=50)
    def endless() -> None:
        assert deadline.remaining_s() is not None and deadline.remaining_s() <= 0.05
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end:
            time.sleep(0.002)
        finished.append(True)

    started = time.monotonic()
    endless.send()
    assert broker.drain() == 1
    assert time.monotonic() - started < 1.0
    (rejected,) = broker.dead_letters
    assert isinstance(rejected._exception, TimeLimitExceeded) and finished == []


def test_a_time_limit_that_fires_as_the_job_ends_changes_nothing_of_its_outcome(make_broker, monkeypatch):
    # Given a time limit whose timer fires just as each job ends: its asynchronous
    # exception is on its way when the broker disarms the limit
    broker = make_broker(max_retries=1, min_backoff_ms=10, max_backoff_ms=10)
    (limit,) = [m for m in broker.middleware if hasattr(m, "disarm")]
    disarm = limit.disarm

    def fired_as_the_job_ended() -> None:
        if threading.get_ident() in limit.manager.deadlines:  # the limit's first disarm in a run
            limit.manager.add_timeout(threading.get_ident(), 0)
            assert limit.manager.fire_due() == [threading.get_ident()]
        disarm()

    monkeypatch.setattr(limit, "disarm", fired_as_the_job_ended)
    runs: list[str] = []

    @dramatiq.actor(queue_name="mem_late_limit")
    def ends(label: str) -> None:
        runs.append(label)
        if label == "fails" and runs.count(label) == 1:
            raise ValueError("the job's own failure")

    # When one job returns and another fails with its own error (then passes)
    ends.send("returns")
    ends.send("fails")
    broker.drain()
    # Then the one that returned is done on its only run, and the failure counted is the
    # job's own: one retry for its ValueError, none for the late time limit
    assert sorted(runs) == ["fails", "fails", "returns"]
    done = {m.args[0]: m for m in broker.done}
    assert "retries" not in done["returns"].options
    assert done["fails"].options["retries"] == 1 and "ValueError" in done["fails"].options["traceback"]
    assert broker.dead_letters == []


def test_a_keyed_lease_keeps_two_messages_of_one_key_apart(make_broker):
    broker = make_broker(queues={"mem_lease": 4})
    lease = Lease(key=lambda message: message.args[0], take="", release="", lease_s=lambda: 30.0,
                  busy_snooze_s=lambda: 2.0)
    holding = threading.Event()
    gate = threading.Event()
    runs: list[tuple[str, int]] = []

    @dramatiq.actor(queue_name="mem_lease", lease=lease)
    def one_per_key(key: str, n: int) -> None:
        runs.append((key, n))
        if n == 1:
            holding.set()
            gate.wait(WAIT_S)

    start_worker(broker)
    one_per_key.send("endpoint-a", 1)
    assert holding.wait(WAIT_S)
    second = one_per_key.send("endpoint-a", 2)
    one_per_key.send("endpoint-b", 3)  # another key is not held up
    poll(lambda: ("endpoint-b", 3) in runs, "the other key's message ran")
    poll(lambda: [m.options.get("snoozes") for m in broker.waiting("mem_lease")] == [1],
         "the second message of the busy key snoozed")
    assert ("endpoint-a", 2) not in runs
    gate.set()
    broker.join("mem_lease", timeout=5_000, advance=True)  # its snooze jumped, not waited
    assert runs[-1] == ("endpoint-a", 2)
    assert [m.message_id for m in broker.done][-1] == second.message_id


def test_a_unique_send_whose_key_is_live_returns_the_live_message(make_broker):
    broker = make_broker()
    ran: list[int] = []

    @dramatiq.actor(queue_name="mem_unique", unique=True)
    def rebuild(doc_id: int) -> None:
        ran.append(doc_id)

    first = rebuild.send(17)
    again = rebuild.send(17)
    other = rebuild.send(18)
    by_key = rebuild.send_with_options(args=(19,), unique_key="doc")
    by_same_key = rebuild.send_with_options(args=(20,), unique_key="doc")
    assert again.message_id == first.message_id
    assert other.message_id != first.message_id
    assert by_same_key.message_id == by_key.message_id
    assert broker.drain() == 3
    assert sorted(ran) == [17, 18, 19]
    assert rebuild.send(17).message_id != first.message_id  # done: the key is free again


def test_a_unique_key_with_a_period_holds_while_done_within_it(make_broker):
    broker = make_broker()

    @dramatiq.actor(queue_name="mem_unique", unique=True)
    def digest(user_id: int) -> None:
        pass

    first = digest.send_with_options(args=(1,), unique_period_s=3600)
    broker.drain()
    assert digest.send_with_options(args=(1,), unique_period_s=3600).message_id == first.message_id
    broker.advance(3600)  # the next period: a new key
    assert digest.send_with_options(args=(1,), unique_period_s=3600).message_id != first.message_id


def test_results_are_stored_never_for_a_snoozed_run_and_a_non_json_result_fails_the_job(make_broker):
    broker = make_broker()
    calls: list[int] = []

    @dramatiq.actor(queue_name="mem_results", store_results=True)
    def compute(x: int) -> int:
        calls.append(x)
        if len(calls) == 1:
            raise Snooze(10)
        return x * 2

    @dramatiq.actor(queue_name="mem_results", store_results=True)
    def a_set() -> set[int]:
        return {1, 2}

    message = compute.send(21)
    broker.drain(advance=False)
    with pytest.raises(ResultMissing):  # the snoozed run stored no None
        message.get_result(backend=broker.results)
    broker.drain()
    assert message.get_result(backend=broker.results) == 42

    refused = a_set.send()
    assert broker.drain() == 1  # failed for good: not retried
    (rejected,) = broker.dead_letters
    assert isinstance(rejected._exception, ResultRefused)
    assert "is not JSON" in rejected.options["error"]
    with pytest.raises(Exception, match="ResultRefused"):
        refused.get_result(backend=broker.results)


def test_a_delayed_message_runs_when_its_time_comes(make_broker):
    broker = make_broker()
    ran: list[str] = []

    @dramatiq.actor(queue_name="mem_delay")
    def later(what: str) -> None:
        ran.append(what)

    later.send_with_options(args=("in a minute",), delay=60_000)
    later.send("now")
    assert broker.drain(advance=False) == 1 and ran == ["now"]
    broker.advance(60)
    assert broker.drain(advance=False) == 1 and ran == ["now", "in a minute"]


def test_a_cancelled_message_is_dropped_waiting_and_stopped_running_without_a_retry(make_broker):
    broker = make_broker(queues={"mem_cancel": 2})
    checking = threading.Event()

    @dramatiq.actor(queue_name="mem_cancel")
    def long_job() -> None:
        checking.set()
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end:
            deadline.check()
            time.sleep(0.002)

    waiting = long_job.send_with_options(delay=60_000)
    assert broker.cancel(waiting.message_id) == "dropped"
    assert broker.waiting("mem_cancel") == []

    start_worker(broker)
    running = long_job.send()
    assert checking.wait(WAIT_S)
    assert broker.cancel(running.message_id) == "stopping"
    broker.join("mem_cancel", timeout=5_000, fail_fast=False)
    (rejected,) = broker.dead_letters
    assert rejected.message_id == running.message_id and isinstance(rejected._exception, JobCancelled)
    assert rejected.options["error"] == "cancelled by an operator: its run was stopped"  # failed for good, not retried
    assert broker.waiting("mem_cancel") == []
    assert broker.cancel("no-such-message") == "unknown"


def test_async_actors_run_on_the_event_loop_with_their_deadline(make_broker):
    broker = make_broker()
    seen: list[float | None] = []

    @dramatiq.actor(queue_name="mem_async", time_limit=2_000)
    async def fetch() -> None:
        seen.append(deadline.remaining_s())

    fetch.send()
    assert broker.drain() == 1
    assert seen[0] is not None and 0 < seen[0] <= 2.0


def test_pipelines_and_callbacks_sent_by_after_hooks_run_once_the_run_is_settled(make_broker):
    broker = make_broker()
    order: list[str] = []

    @dramatiq.actor(queue_name="mem_pipe")
    def first(x: int) -> int:
        order.append(f"first {x}")
        return x + 1

    @dramatiq.actor(queue_name="mem_pipe")
    def second(x: int) -> None:
        order.append(f"second {x}")

    (first.message(1) | second.message()).run()
    assert broker.drain() == 2
    assert order == ["first 1", "second 2"]


ACTOR_SUITE = """
import sys

class NoDatabaseDriver:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("psycopg", "psycopg_pool", "psycopg2"):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, NoDatabaseDriver())

import dramatiq
from broker.testing import memory_broker
from middleware import Lease, Snooze

broker = memory_broker(max_retries=1, min_backoff_ms=1000, max_backoff_ms=2000)
calls = []

@dramatiq.actor(queue_name="suite", store_results=True, unique=True)
def job(n):
    calls.append(n)
    if calls.count(n) == 1 and n == 1:
        raise Snooze(5)
    if calls.count(n) == 1 and n == 2:
        raise RuntimeError("once")
    return n

lease = Lease(key=lambda m: "k", take="", release="", lease_s=lambda: 1.0, busy_snooze_s=lambda: 1.0)

@dramatiq.actor(queue_name="suite", lease=lease)
def leased():
    calls.append("leased")

messages = [job.send(1), job.send(2), job.send(3), job.send(3)]
leased.send()
assert broker.drain() == 6, calls
assert [m.get_result(backend=broker.results) for m in messages] == [1, 2, 3, 3]
worker = dramatiq.Worker(broker, worker_timeout=20)
worker.start()
job.send(4)
broker.join("suite", timeout=5000)
worker.stop()
assert calls.count(4) == 1
# the engine's message checks, unique keys and queue declarations are shared (pure code); nothing that talks to Postgres
loaded = sorted(m for m in sys.modules if m.startswith(("psycopg", "broker.pg", "broker.engine."))
                and m not in ("broker.engine.codec", "broker.engine.unique", "broker.engine.queues", "broker.engine.runs"))
assert not loaded, loaded
assert "broker.engine.unique" in sys.modules  # the keys are the engine's own, not a copy
print("ok")
"""


def test_actor_tests_on_the_memory_broker_import_no_database_driver():
    # (with a database named in the environment, as in a project's CI: the memory broker ignores it)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none",
           "STANDMEET_LISTEN_DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none"}
    done = subprocess.run([sys.executable, "-c", ACTOR_SUITE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_the_worked_example_of_the_testing_docs_passes(monkeypatch):
    text = (ROOT / "docs" / "testing.md").read_text()
    example = text.split("### A worked example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    monkeypatch.setattr(dramatiq.broker, "global_broker", None)
    monkeypatch.setattr(services, "_current", services.installed())
    exec(compile(example, "docs/testing.md", "exec"), namespace)  # noqa: S102  (our own docs)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_")]
    started = time.monotonic()
    test(monkeypatch)  # type: ignore[operator]
    assert time.monotonic() - started < 1.0


def test_a_send_the_engine_would_refuse_is_refused_here_too_and_nothing_is_kept(make_broker):
    from broker.errors import InvalidMessage, MessageTooLarge

    broker = make_broker(message_max_bytes=1024)

    @dramatiq.actor(queue_name="mem_checks")
    def checked(text: str) -> None:
        pass

    # Then an option its run cannot use, arguments Postgres would not store, and a message
    # over STANDMEET_MESSAGE_MAX_BYTES are each refused in one line, as the engine refuses them
    with pytest.raises(InvalidMessage, match="max_retries"):
        checked.send_with_options(args=("a",), max_retries="3")
    with pytest.raises(InvalidMessage):
        checked.send("nul \u0000 inside")
    with pytest.raises(MessageTooLarge):
        checked.send("x" * 2048)
    assert broker.waiting("mem_checks") == []
    assert broker.drain() == 0


def test_unique_keys_are_the_engines_own(make_broker):
    from broker.engine.unique import unique_key_of

    broker = make_broker()

    @dramatiq.actor(queue_name="mem_keys", unique=True)
    def keyed(n: int) -> None:
        pass

    first, again = keyed.send(1), keyed.send(1)
    assert again.message_id == first.message_id
    # the key the memory broker holds is the one the Postgres broker would write
    assert broker._key_of[first.message_id][0] == unique_key_of(first, broker).digest
