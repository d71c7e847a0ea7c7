"""What a process holds of a queue, and the back-off every retry loop waits with."""

from __future__ import annotations

import random

import dramatiq
import pytest

from broker.backoff import Backoff
from broker.engine.queues import Claim, QueueState
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


def test_finished_runs_not_yet_settled_count_against_claims_beyond_one_limit_and_one_claim_batch():
    # Given two slots, a prefetch of two (claims of at least one at a time), and seven
    # runs that ended one after another while the settler wrote none of them
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=2))
    assert state.claim_batch == 1
    for i in range(7):
        state.hold(_claim(i))
        state.finished(state.next_buffered().key)
    assert state.unsettled == 7
    # Then nothing more is claimed: rows consumed in the database are at most
    # 2 x limit + prefetch + claim batch = 7, however far the settler is behind
    assert state.free() == 0 and not state.should_claim()
    # When four are written, the three still unwritten are within the slack (one limit
    # and one claim batch): they hold up no claim, and the whole room is free again
    state.settled(4)
    assert state.unsettled == 3
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
    import broker.engine.broker as pgbroker

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
    import broker.engine.broker as pgbroker

    clock = [1000.0]
    monkeypatch.setattr(pgbroker.time, "monotonic", lambda: clock[0])
    state = QueueState(QueueSettings("q", max_workers=8, time_limit_s=60, prefetch_setting=2))
    _run_through(state, [_claim(i) for i in range(40)], 0.002, clock)
    assert state.prefetch == 2



def _busy_queue(monkeypatch, *, run_s: float) -> tuple[QueueState, list[float], list[Claim], list[Claim]]:
    """A queue of limit 2 whose jobs took ``run_s`` each, both slots running, and as many
    claims buffered as its prefetch allows; the clock is the test's."""
    import broker.engine.broker as pgbroker

    clock = [1000.0]
    monkeypatch.setattr(pgbroker.time, "monotonic", lambda: clock[0])
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=60, prefetch_setting=-1))
    _run_through(state, [_claim(i) for i in range(40)], run_s, clock)
    running = [_claim(500), _claim(501)]
    for claim in running:
        state.hold(claim)
        assert state.next_buffered() is claim
    waiting = [_claim(1000 + i, started=False) for i in range(state.prefetch)]
    for claim in waiting:
        state.hold(claim)
    return state, clock, running, waiting


def test_a_short_stall_of_the_process_gives_nothing_back(monkeypatch):
    # Given a queue of 0.5 ms jobs holding its ceiling of prefetched claims
    state, clock, running, waiting = _busy_queue(monkeypatch, run_s=0.0005)
    assert len(waiting) == PREFETCH_MOST
    # When the process stalls for 60 ms with both jobs running, which then end
    clock[0] += 0.060
    assert state.take_excess() == []
    for claim in running:
        state.finished(claim.key)
    # Then every claim stays in line: the buffer would still empty within a second
    assert state.take_excess() == [] and len(state.buffer) == PREFETCH_MOST
    state.drain_wake()


def test_what_jobs_turned_slow_would_hold_past_a_second_goes_back_last_in_line_first(monkeypatch):
    # Given a queue of fast jobs holding its ceiling of prefetched claims
    state, clock, running, waiting = _busy_queue(monkeypatch, run_s=0.0001)
    # When a job of 10 s ends: the mean run time is now about a second
    clock[0] += 10.0
    state.finished(running[0].key)
    handed = state.next_buffered()
    assert handed is waiting[0]
    # Then what would wait past a second goes, the last in line first; the buffer keeps
    # its floor, the prefetch shrinks to it, and nothing more would be claimed
    excess = state.take_excess()
    assert excess == waiting[:0:-1][: len(waiting) - 2]
    assert list(state.buffer) == waiting[1:2] == [waiting[1]]
    assert state.prefetch == 1 and state.free() <= 0
    state.drain_wake()


def test_claims_behind_jobs_that_hang_go_back_once_no_slot_has_freed_for_a_second(monkeypatch):
    # Given a queue of fast jobs holding its ceiling, both slots running
    state, clock, running, waiting = _busy_queue(monkeypatch, run_s=0.0001)
    # When neither job ends for 0.9 s, nothing goes; after 1.5 s, the buffer is cut down
    clock[0] += 0.9
    assert state.take_excess() == []
    clock[0] += 0.6
    excess = state.take_excess()
    assert len(excess) == PREFETCH_MOST - 1 and list(state.buffer) == waiting[:1]
    assert state.prefetch == 1
    state.drain_wake()


def test_claims_being_given_back_are_never_started_here_and_count_until_confirmed(monkeypatch):
    state, clock, running, waiting = _busy_queue(monkeypatch, run_s=0.0001)
    clock[0] += 2.0
    excess = state.take_excess()
    assert excess
    # When the give-back's outcome is unknown (the connection broke), and slots free up
    for claim in running:
        state.finished(claim.key)
    started = [state.next_buffered() for _ in range(4)]
    # Then only the claim kept in the buffer starts; the others are offered again, still held
    assert started == [waiting[0], None, None, None]
    assert state.take_excess() == excess
    assert all(c.key in state.in_flight for c in excess)
    # And once the give-back is confirmed, they no longer count
    state.release([c.key for c in excess])
    assert state.take_excess() == [] and not any(c.key in state.in_flight for c in excess)
    # (at shutdown, whatever is still being given back goes with the buffer)
    state.returning.append(excess[0])
    assert state.take_buffer() == [excess[0]]
    state.drain_wake()


def test_an_explicit_prefetch_is_never_cut(monkeypatch):
    import broker.engine.broker as pgbroker

    clock = [1000.0]
    monkeypatch.setattr(pgbroker.time, "monotonic", lambda: clock[0])
    state = QueueState(QueueSettings("q", max_workers=1, time_limit_s=60, prefetch_setting=5))
    for i in range(6):
        state.hold(_claim(i))
    assert state.next_buffered() is not None
    clock[0] += 60.0
    assert state.take_excess() == [] and len(state.buffer) == 5
    state.drain_wake()


def _pipe_bytes(state: QueueState) -> int:
    import os

    try:
        return len(os.read(state.wake_fd, 4096))
    except BlockingIOError:
        return 0


def test_runs_ending_while_the_consumer_sleeps_wake_it_with_one_pipe_write():
    # Given a consumer asleep on the wake pipe, three runs going and nothing buffered
    state = QueueState(QueueSettings("q", max_workers=3, time_limit_s=1, prefetch_setting=0))
    for i in range(3):
        state.hold(_claim(i))
    running = [state.next_buffered() for _ in range(3)]
    assert state.going_to_sleep()
    # When all three end, and the settler writes their outcomes, before the consumer is back
    for claim in running:
        state.finished(claim.key, hand_off=True)
    state.settled(3)
    # Then the pipe holds one wake, and the consumer, back, sees room for all three
    assert _pipe_bytes(state) == 1
    state.awake()
    state.clear_freed()  # as the consumer does once it has read the pipe
    assert state.free() == 3 and state.should_claim()
    # And its next sleep is woken again by the next end
    state.hold(_claim(9))
    claim = state.next_buffered()
    assert state.going_to_sleep()
    state.finished(claim.key, hand_off=True)
    assert _pipe_bytes(state) == 1


def test_a_claim_connection_failing_during_a_check_leaves_the_queue_in_doubt():
    state = QueueState(QueueSettings("q", max_workers=2, time_limit_s=1, prefetch_setting=1))
    # Given a failure, and a check that began after it
    state.doubt()
    doubts = state.in_doubt()
    assert doubts is not None
    # When another consumer's connection of the queue fails while that check runs
    state.doubt()
    state.checked(doubts)
    # Then the queue is still in doubt, until a check begun after the second failure ends
    later = state.in_doubt()
    assert later is not None
    state.checked(later)
    assert state.in_doubt() is None
