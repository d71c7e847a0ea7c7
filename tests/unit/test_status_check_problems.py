"""What ``status --check`` calls unhealthy, from a status document (no database)."""

from __future__ import annotations

from typing import Any

from broker.cli.ops import health_problems


def _queue(name: str, *, queued: int = 0, age: float | None = None, live_workers: int = 1,
           paused: bool = False) -> dict[str, Any]:
    return {"name": name, "queued": queued, "oldest_queued_age_s": age, "paused": paused,
            "live_workers": live_workers, "no_worker": live_workers == 0,
            "unserved": live_workers == 0 and queued > 0 and not paused}


def _doc(*queues: dict[str, Any], served: tuple[str, ...] = (), unrouted: tuple[tuple[str, int, float], ...] = ()
         ) -> dict[str, Any]:
    return {"queues": list(queues), "workers": [{"alive": True, "queues": list(served)}],
            "outbox": {"unrouted": [{"topic": t, "events": n, "oldest_age_s": a} for t, n, a in unrouted]}}


def test_due_work_no_live_worker_serves_fails_once_older_than_the_unserved_age_naming_queue_and_age():
    doc = _doc(_queue("reports", queued=53, age=75, live_workers=0), _queue("index", queued=2, age=75),
               served=("index",))
    assert health_problems(doc, max_age_s=300, required=[], unserved_max_age_s=60) == [
        "queue reports: 53 due job(s) and no live worker process serves it; the oldest has waited 75 s "
        "(more than 60 s)"]
    # younger than the age: not yet; paused: on purpose
    assert health_problems(doc, max_age_s=300, required=[], unserved_max_age_s=90) == []
    paused = _doc(_queue("reports", queued=53, age=75, live_workers=0, paused=True))
    assert health_problems(paused, max_age_s=300, required=[], unserved_max_age_s=60) == []


def test_a_required_queue_with_no_live_worker_fails_once_even_with_nothing_due():
    doc = _doc(_queue("maintenance", live_workers=0), _queue("reports", queued=1, age=120, live_workers=0))
    assert health_problems(doc, max_age_s=300, required=["maintenance", "reports"], unserved_max_age_s=60) == [
        "queue reports: 1 due job(s) and no live worker process serves it; the oldest has waited 120 s "
        "(more than 60 s)",
        "queue maintenance: no live worker process serves it"]


def test_events_no_live_process_routes_fail_once_older_than_the_unrouted_age_naming_the_topic():
    doc = _doc(unrouted=(("report.requested", 3, 400.0), ("fresh.topic", 1, 5.0)))
    assert health_problems(doc, max_age_s=300, required=[], unrouted_max_age_s=300) == [
        "outbox topic report.requested: 3 event(s) that no live process routes; the oldest has waited 400 s "
        "(more than 300 s)"]
