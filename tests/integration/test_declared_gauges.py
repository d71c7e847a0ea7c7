"""An application's gauges (``broker.app.gauges``) are served with the runtime's, read at each scrape."""

from __future__ import annotations

import logging

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from broker import app
from broker.observability.metrics import DatabaseCollector


def _scrape(database_url: str) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(database_url))
    text = generate_latest(registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def declared() -> list[app.GaugeReader]:
    readers: list[app.GaugeReader] = []
    yield readers
    for read in readers:
        app.REGISTRY.gauge_readers.remove(read)


def test_a_declared_gauge_is_read_from_the_database_at_each_scrape_and_a_failing_one_left_out(
        broker, database_url, declared, caplog):
    def broken(conn: psycopg.Connection) -> list[GaugeMetricFamily]:
        conn.execute("SELECT * FROM no_such_table_of_the_app")
        return []

    def answer(conn: psycopg.Connection) -> list[GaugeMetricFamily]:
        (value,) = conn.execute("SELECT 40 + 2").fetchone()
        gauge = GaugeMetricFamily("app_answer", "What the application read.")
        gauge.add_metric([], value)
        return [gauge]

    declared.extend([app.gauges(broken), app.gauges(answer)])
    with caplog.at_level(logging.WARNING):
        scraped = _scrape(database_url)
    assert scraped["app_answer"] == 42
    assert scraped["standmeet_database_up"] == 1  # the runtime's gauges are served all the same
    assert any("could not be read" in r.getMessage() and "broken" in r.getMessage() for r in caplog.records)
