"""Observations written as a batch give the histogram exactly what one by one would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from middleware.metrics import observe_all

BUCKETS = (5, 10, 25, 50, 1000, float("inf"))
#: on a bound, between bounds, zero, past the last finite bound
VALUES = [0.0, 5.0, 5.000001, 9.9, 10.0, 25.0, 49.0, 999.0, 1000.0, 1000.5, 123456.0, 3.2, 3.2]


def _samples(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
    return sorted((s.name, sorted(s.labels.items()), s.value) for family in registry.collect()
                  for s in family.samples if not s.name.endswith("_created"))


def test_a_batch_of_observations_gives_every_bucket_count_and_sum_that_observing_each_gives():
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    a = Histogram("t_ms", "t", ("q",), buckets=BUCKETS, registry=one_by_one).labels("x")
    b = Histogram("t_ms", "t", ("q",), buckets=BUCKETS, registry=batched).labels("x")
    for value in VALUES:
        a.observe(value)
    observe_all(b, VALUES)
    assert _samples(batched) == _samples(one_by_one)


def test_a_histogram_not_laid_out_as_expected_is_given_each_observation():
    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, value: float) -> None:
            self.seen.append(value)

    plain = Plain()
    observe_all(plain, VALUES)
    assert plain.seen == VALUES
