from __future__ import annotations

import threading

from broker import detach


def test_a_detached_function_that_raises_is_absorbed_and_reported():
    done = threading.Event()

    def boom(stop: threading.Event) -> None:
        done.set()
        raise RuntimeError("helper failed")

    helper = detach.go("boom", boom)
    assert done.wait(5)
    assert helper.join(5)
    assert not helper.alive
    assert isinstance(helper.error, RuntimeError)


def test_a_loop_stops_when_asked_and_is_joined_within_the_timeout():
    ticks = threading.Semaphore(0)
    helper = detach.every("ticker", 0.01, ticks.release)
    assert ticks.acquire(timeout=5) and ticks.acquire(timeout=5)
    assert helper.stop(timeout_s=5)
    assert not helper.alive
    assert helper._thread.name == "ticker"


def test_a_failing_tick_does_not_end_the_loop():
    calls: list[int] = []
    second = threading.Event()

    def once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("first tick fails")
        second.set()

    helper = detach.every("flaky", 0.01, once)
    assert second.wait(5)
    assert helper.stop(timeout_s=5)
    assert helper.error is None
