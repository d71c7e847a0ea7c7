"""What a process holds of a queue, and the back-off every retry loop waits with."""

from __future__ import annotations

import random

import dramatiq
import pytest

from broker.backoff import Backoff
from broker.pgbroker import Claim, QueueState
from broker.settings import PREFETCH_MOST, QueueSettings


def _claim(i: int, number: int = 1, *, started: bool = True) -> Claim:
    message = dramatiq.Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={},
                               message_id=f"00000000-0000-0000-0000-{i:012d}")
    return Claim(message, number, started)


def test_a_queue_hands_out_at_most_its_limit_and_claims_at_most_limit_plus_prefetch():
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=1))
    assert state.free() == 3 and state.start_now() == 2
    for i in range(3):
        state.hold(_claim(i))
    assert state.free() == 0
    handed = [state.next_buffered(), state.next_buffered(), state.next_buffered()]
    assert handed[2] is None  # the third waits: two are running
    assert [c.key[0][-1] for c in handed[:2]] == ["0", "1"]
    state.finished(handed[0].key)
    assert state.free() == 1 and state.next_buffered() is not None


def test_two_claims_of_one_message_are_counted_apart():
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=0))
    first, second = _claim(7, 1), _claim(7, 2)
    state.hold(first)
    state.hold(second)
    assert state.next_buffered() is first and state.next_buffered() is second
    state.finished(first.key)
    assert state.running == {second.key} and state.in_flight == {second.key}


def test_start_now_counts_only_free_running_slots():
    state = QueueState(QueueSettings("q", max_workers=3, time_limit_s=1, prefetch_setting=3))
    state.hold(_claim(1))
    state.next_buffered()
    state.hold(_claim(2))
    assert state.start_now() == 1  # one running, one buffered: one more would start at once


def test_back_off_doubles_up_to_its_cap_with_jitter_and_resets():
    backoff = Backoff(start_s=0.1, cap_s=0.8, rng=random.Random(1))
    waits = [backoff.next_s() for _ in range(6)]
    steps = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    for wait, step in zip(waits, steps, strict=True):
        assert step / 2 <= wait <= step
    backoff.reset()
    assert backoff.next_s() <= 0.1


def test_back_off_refuses_bounds_that_make_no_sense():
    with pytest.raises(ValueError):
        Backoff(start_s=1.0, cap_s=0.5)


def test_a_queue_claims_again_for_an_idle_slot_or_a_batch_not_for_each_finished_job():
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=4))
    assert state.claim_batch == 2 and state.should_claim()  # empty: claim
    for i in range(6):
        state.hold(_claim(i))
    running = [state.next_buffered(), state.next_buffered()]
    assert not state.should_claim()  # full
    state.finished(running[0].key)
    state.next_buffered()
    # one slot of room, and a buffer that still feeds every running slot: not yet
    assert state.free() == 1 and not state.should_claim()
    state.finished(running[1].key)
    assert state.free() == 2 and state.should_claim()  # a batch's worth of room
    state.take_buffer()
    assert state.should_claim()  # nothing buffered, a slot would idle


def test_finished_runs_not_yet_settled_count_against_claims_beyond_one_limit_of_slack():
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=2))
    for round_ in range(3):  # three rounds of two runs end; the settler writes none
        for i in range(2):
            state.hold(_claim(10 * round_ + i))
        for _ in range(2):
            claim = state.next_buffered()
            state.finished(claim.key)
    assert state.unsettled == 6
    # rows consumed in the database: 6 unsettled; at most 2 x limit + prefetch = 6 held
    assert state.free() == 0 and not state.should_claim()
    state.settled(4)
    assert state.free() == 4 and state.should_claim()


def test_a_finished_run_hands_its_slot_to_the_next_buffered_claim_and_wakes_the_consumer_only_to_claim():
    # Given two slots, room for four more, both slots running and four claims buffered
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=4))
    for i in range(6):
        state.hold(_claim(i))
    running = [state.next_buffered(), state.next_buffered()]
    state.going_to_sleep()  # the consumer sleeps on the wake pipe
    # When a run ends, its thread takes the next buffered claim into the freed slot
    handed = state.finished(running[0].key, hand_off=True)
    assert handed is not None and handed.key[0].endswith("2")
    assert handed.key in state.running and len(state.running) == 2 and len(state.buffer) == 3
    # Then the consumer is left asleep: one slot of room is no batch, and no slot idles
    assert state.waiting and not state.freed
    # And when the next run ends there is room for a batch: the consumer is woken to claim
    state.finished(running[1].key, hand_off=True)
    assert state.freed
    state.drain_wake()


def test_a_finished_run_with_nothing_buffered_leaves_the_slot_to_the_consumer():
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=0))
    state.hold(_claim(1))
    first = state.next_buffered()
    assert state.finished(first.key, hand_off=True) is None
    assert state.freed and state.running == set()


def test_a_claim_that_could_not_be_started_goes_back_first_in_line():
    state = QueueState(QueueSettings("q", max_workers=1, time_limit_s=1, prefetch_setting=2))
    for i in range(3):
        state.hold(_claim(i))
    first = state.next_buffered()
    handed = state.finished(first.key, hand_off=True)
    assert handed is not None
    state.put_back(handed)
    assert state.running == set() and state.next_buffered() is handed
    state.drain_wake()


def _run_through(state: QueueState, claims: list[Claim], run_s: float, clock: list[float]) -> None:
    """Hand each claim out and finish it ``run_s`` later, on a clock the test moves."""
    for claim in claims:
        state.hold(claim)
        handed = state.next_buffered()
        assert handed is claim
        clock[0] += run_s
        state.finished(claim.key)


def test_by_default_the_prefetch_holds_what_finishes_soon_between_half_the_limit_and_its_ceiling(monkeypatch):
    import broker.pgbroker as pgbroker

    clock = [1000.0]
    monkeypatch.setattr(pgbroker.time, "monotonic", lambda: clock[0])
    state = QueueState(QueueSettings("q", max_workers=8, time_limit_s=60, prefetch_setting=-1))
    # Given a queue that starts with half its limit prefetched
    assert state.prefetch == 4
    # When its jobs take 2 ms each: 8 slots finish 200 within 50 ms
    _run_through(state, [_claim(i) for i in range(40)], 0.002, clock)
    # Then it prefetches its ceiling (no more)
    assert state.prefetch == PREFETCH_MOST == 128
    # And when they take 20 ms, it holds what 8 slots finish in 50 ms
    _run_through(state, [_claim(50 + i) for i in range(60)], 0.020, clock)
    assert state.prefetch == 20
    # And when its jobs then take 10 s each, it falls back to half the limit
    _run_through(state, [_claim(100 + i) for i in range(60)], 10.0, clock)
    assert state.prefetch == 4


def test_a_queue_with_many_workers_may_prefetch_twice_its_limit():
    assert QueueSettings("q", max_workers=100, time_limit_s=60).prefetch_ceiling == 200
    assert QueueSettings("q", max_workers=8, time_limit_s=60).prefetch_ceiling == PREFETCH_MOST


def test_a_prefetch_that_was_set_stays_as_set(monkeypatch):
    import broker.pgbroker as pgbroker

    clock = [1000.0]
    monkeypatch.setattr(pgbroker.time, "monotonic", lambda: clock[0])
    state = QueueState(QueueSettings("q", max_workers=8, time_limit_s=60, prefetch_setting=2))
    _run_through(state, [_claim(i) for i in range(40)], 0.002, clock)
    assert state.prefetch == 2


def test_when_the_prefetch_shrinks_below_half_the_buffer_the_last_in_line_are_given_back(monkeypatch):
    import broker.pgbroker as pgbroker

    clock = [1000.0]
    monkeypatch.setattr(pgbroker.time, "monotonic", lambda: clock[0])
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=60, prefetch_setting=-1))
    # Given a queue of fast jobs that prefetched its ceiling, one job running
    _run_through(state, [_claim(i) for i in range(40)], 0.0001, clock)
    assert state.prefetch == PREFETCH_MOST
    running = _claim(500)
    state.hold(running)
    assert state.next_buffered() is running
    waiting = [_claim(1000 + i, started=False) for i in range(100)]
    for claim in waiting:
        state.hold(claim)
    assert state.take_excess() == []  # within twice the prefetch: kept
    # When a job of 10 s ends: the prefetch falls to its floor (1)
    clock[0] += 10.0
    state.finished(running.key)
    assert state.prefetch == 1
    # Then all but the first in line are offered back, in order, and the buffer keeps one
    excess = state.take_excess()
    assert excess == waiting[1:]
    assert list(state.buffer) == waiting[:1]
    assert state.take_excess() == []
    # And claims that could not be given back wait last in line again, still held
    state.restore(excess)
    assert list(state.buffer) == waiting
    assert all(c.key in state.in_flight for c in waiting)
    state.drain_wake()
