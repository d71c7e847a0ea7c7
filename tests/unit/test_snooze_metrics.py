"""A snooze is counted by its actor; one labelled lease-busy is counted as such too, whatever the actor."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY

from middleware.metrics import Metrics
from middleware.snooze import LEASE_BUSY, Snooze


def _count(name: str, actor: str) -> float:
    return REGISTRY.get_sample_value(name, {"queue_name": "q-snooze-metrics", "actor_name": actor}) or 0.0


def _skipped(actor: str, snooze: Snooze) -> None:
    message = SimpleNamespace(queue_name="q-snooze-metrics", actor_name=actor, _exception=snooze, failed=False,
                              standmeet_metrics_start=None)
    Metrics().after_skip_message(None, message)


def test_a_snooze_labelled_lease_busy_counts_as_lease_busy_and_any_other_only_as_a_snooze():
    before = {a: (_count("standmeet_snoozes_total", a), _count("standmeet_lease_busy_total", a))
              for a in ("sync.account", "reports.build")}
    _skipped("sync.account", Snooze(1.0, "sync.account: the account is busy", label=LEASE_BUSY))
    _skipped("reports.build", Snooze(1.0, "the printer is busy"))  # the words alone count for nothing
    assert _count("standmeet_snoozes_total", "sync.account") == before["sync.account"][0] + 1
    assert _count("standmeet_lease_busy_total", "sync.account") == before["sync.account"][1] + 1
    assert _count("standmeet_snoozes_total", "reports.build") == before["reports.build"][0] + 1
    assert _count("standmeet_lease_busy_total", "reports.build") == before["reports.build"][1]
