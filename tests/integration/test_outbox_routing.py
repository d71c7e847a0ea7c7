"""A relay takes only what its process routes, says so in ``standmeet.relays``, never stops
on an error, and a failed event can be given back to the relays; an event no live relay
routes is visible (``broker.ops``, the metrics)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from broker import emit, ops
from broker.engine import sql
from broker.observability.metrics import DatabaseCollector
from broker.outbox import MESSAGE_NAMESPACE, Relay, relay_once, route, routed_topics
from broker.outbox import relay as outbox
from broker.pg import pool as pgpool
from tests.conftest import configured_broker
from tests.support.db import query, scalar, wait_for

#: A topic no process of this test routes: another module set's (``run reports``).
FOREIGN = "elsewhere.report.requested"
#: The relay's fallback poll here: far above every latency asserted.
LONG_POLL_S = 30.0
RESCUE_AFTER_S = 3.0


def _nul(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ("\x00" if payload.get("nul") else payload["label"],), {}


route("test.routing.nul", "test.noop", _nul)


@pytest.fixture(scope="module")
def broker(database_url: str) -> Iterator[Any]:
    with configured_broker(database_url, relay_poll_s=LONG_POLL_S) as configured:
        yield configured


@pytest.fixture
def clean(database_url: str) -> Iterator[None]:
    query(database_url, "DELETE FROM standmeet.outbox; DELETE FROM standmeet.relays")
    yield


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as c:
        yield c


@pytest.fixture
def relays() -> Iterator[list[Relay]]:
    started: list[Relay] = []
    yield started
    for relay in started:
        relay.stop()


def _foreign_event(conn: psycopg.Connection[Any], label: str) -> int:
    """What another module set's ``emit`` writes (this process has no route for it)."""
    row = conn.execute(sql.EMIT, {"topic": FOREIGN, "payload": f'{{"label": "{label}"}}',
                                "routes": '["elsewhere.record"]'}).fetchone()
    assert row is not None
    return int(row[0])


def _message_id(event_id: int) -> str:
    return str(uuid.uuid5(MESSAGE_NAMESPACE, f"{event_id}/0"))


def _event(url: str, event_id: int) -> tuple[Any, ...]:
    (row,) = query(url, "SELECT relayed_at IS NOT NULL, error, relayed_by::text FROM standmeet.outbox"
                        " WHERE id = %s", (event_id,))
    return row


def _start(relays: list[Relay], database_url: str, **kwargs: Any) -> Relay:
    relay = Relay(database_url, batch=200, poll_s=LONG_POLL_S, heartbeat_s=0.5, **kwargs).start()
    relays.append(relay)
    return relay


def test_a_relay_takes_only_the_topics_it_routes_and_leaves_the_others_untouched(
        broker, database_url, clean, conn):
    # Given events of a topic this process routes and of one it does not, interleaved
    with conn.transaction():
        ours = [emit(conn, "test.ping", {"label": f"ours-{i}"}) for i in range(3)]
        theirs = [_foreign_event(conn, f"theirs-{i}") for i in range(3)]
    # When a relay pass runs here
    result = relay_once(conn, limit=200)
    # Then it took and relayed ours only; theirs are pending, with no error, for a process that routes them
    assert (result.claimed, result.messages, result.failed, result.given_back) == (3, 3, 0, 0)
    assert [_event(database_url, e)[:2] for e in ours] == [(True, None)] * 3
    assert [_event(database_url, e) for e in theirs] == [(False, None, None)] * 3
    assert FOREIGN not in routed_topics() and "test.ping" in routed_topics()
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                  ([_message_id(e) for e in theirs],)) == 0


def test_a_relay_records_its_topics_with_a_heartbeat_and_stops_promptly_recorded_as_stopped(
        broker, database_url, clean, conn, relays):
    relay = _start(relays, database_url)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = %s", (relay.id,)),
             timeout_s=10, what="the relay to register")
    (topics, _pid) = query(database_url, "SELECT topics, pid FROM standmeet.relays WHERE id = %s", (relay.id,))[0]
    assert topics == routed_topics() and "test.ping" in topics and FOREIGN not in topics
    first = scalar(database_url, "SELECT heartbeat_at FROM standmeet.relays WHERE id = %s", (relay.id,))
    wait_for(lambda: scalar(database_url, "SELECT heartbeat_at FROM standmeet.relays WHERE id = %s",
                            (relay.id,)) > first, timeout_s=5, what="a second heartbeat")
    (alive,) = [r for r in ops.relay_overview(conn, rescue_after_s=RESCUE_AFTER_S) if r.id == relay.id]
    assert alive.alive and alive.topics == topics
    # its 30 s poll and 0.5 s heartbeat are no reason to wait: stop is prompt
    started = time.monotonic()
    assert relay.stop(timeout_s=5)
    assert time.monotonic() - started < 1.0
    assert scalar(database_url, "SELECT stopped_at IS NOT NULL FROM standmeet.relays WHERE id = %s", (relay.id,))


def test_a_relay_draining_a_backlog_stops_between_two_passes_recorded_as_stopped(
        broker, database_url, clean, conn, relays):
    # Given a backlog of 10,000 events and a relay taking one a pass (far more passes than
    # its stop's wait could see through)
    with conn.transaction():
        for i in range(10_000):
            emit(conn, "test.ping", {"label": f"backlog-{i}"})
    relay = Relay(database_url, batch=1, poll_s=LONG_POLL_S, heartbeat_s=0.5).start()
    relays.append(relay)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE relayed_at IS NOT NULL") > 10,
             timeout_s=10, what="the relay to be draining")
    # When it is stopped in the middle of it
    assert relay.stop(timeout_s=5)
    # Then it stopped, recorded as stopped, the rest of the backlog left pending
    assert scalar(database_url, "SELECT stopped_at IS NOT NULL FROM standmeet.relays WHERE id = %s", (relay.id,))
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE relayed_at IS NULL") > 0


def test_an_event_no_live_relay_routes_is_shown_unrouted_until_one_that_routes_it_is_alive(
        broker, database_url, clean, conn, relays):
    # Given a live relay of this process, and events of a topic it does not route
    relay = _start(relays, database_url)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = %s", (relay.id,)),
             timeout_s=10, what="the relay to register")
    with conn.transaction():
        first = _foreign_event(conn, "a")
        _foreign_event(conn, "b")
    conn.execute("UPDATE standmeet.outbox SET created_at = now() - interval '90 seconds' WHERE id = %s", (first,))
    # Then operators see the topic as unrouted, with its events and the oldest's age
    (unrouted,) = ops.unrouted_topics(conn, rescue_after_s=RESCUE_AFTER_S)
    assert (unrouted.topic, unrouted.events) == (FOREIGN, 2) and 89 < unrouted.oldest_age_s < 120
    listed = ops.list_outbox_events(conn, rescue_after_s=RESCUE_AFTER_S)
    assert [e.state for e in listed] == ["unrouted", "unrouted"]
    # and so do the metrics
    samples = _scrape(database_url)
    assert samples[("standmeet_outbox_unrouted", (("topic", FOREIGN),))] == 2
    assert samples[("standmeet_outbox_unrouted_oldest_age_seconds", (("topic", FOREIGN),))] > 89
    assert samples[("standmeet_relays_alive", ())] >= 1
    # When a relay of a process that routes the topic registers (another module set's)
    conn.execute(outbox.RELAY_HEARTBEAT, {"id": str(uuid.uuid4()), "hostname": "reports-host", "pid": 1,
                                          "topics": [FOREIGN], "routes": None, "rescue_after_s": None})
    # Then the topic is routed: pending, not unrouted
    assert ops.unrouted_topics(conn, rescue_after_s=RESCUE_AFTER_S) == []
    assert {e.state for e in ops.list_outbox_events(conn, rescue_after_s=RESCUE_AFTER_S)} == {"pending"}
    # and once that relay stopped, unrouted again
    conn.execute("UPDATE standmeet.relays SET stopped_at = now() WHERE hostname = 'reports-host'")
    assert [t.topic for t in ops.unrouted_topics(conn, rescue_after_s=RESCUE_AFTER_S)] == [FOREIGN]
    # our relay never touched them
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE topic = %s AND relayed_at IS NULL"
                                " AND error IS NULL", (FOREIGN,)) == 2


def test_a_failed_event_is_relayed_again_once_retried(broker, database_url, clean, conn, relays):
    # Given an event a relay failed (as every relay did to topics it did not route)
    with conn.transaction():
        event_id = emit(conn, "test.ping", {"label": "retried-event"})
    conn.execute("UPDATE standmeet.outbox SET error = 'UnknownTopic: no route for topic' WHERE id = %s", (event_id,))
    relay = _start(relays, database_url)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = %s", (relay.id,)),
             timeout_s=10, what="the relay to register")
    assert _event(database_url, event_id) == (False, "UnknownTopic: no route for topic", None)
    (failed,) = ops.list_outbox_events(conn, failed=True, rescue_after_s=RESCUE_AFTER_S)
    assert (failed.id, failed.state, failed.error) == (event_id, "failed", "UnknownTopic: no route for topic")
    assert ops.outbox_overview(conn, rescue_after_s=RESCUE_AFTER_S).failed == 1
    # When an operator retries it (a pending event is not a failed one: left alone)
    assert ops.retry_outbox_events(conn, ids=[event_id, 999_999]) == 1
    # Then the live relay, woken at commit (its poll is 30 s), relays it
    wait_for(lambda: _event(database_url, event_id)[0], timeout_s=5, what="the retried event to be relayed")
    assert _event(database_url, event_id) == (True, None, relay.id)
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = %s",
                  (_message_id(event_id),)) == 1
    assert ops.retry_outbox_events(conn, ids=[event_id]) == 0


def test_the_relay_loop_survives_any_error_saying_so_once_and_once_when_it_recovers(
        broker, database_url, clean, conn, relays, monkeypatch, caplog):
    # Given a relay whose passes raise a bug's error (not a database one) four times
    real = outbox.relay_once
    failures = {"left": 4}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("a bug in a pass")
        return real(*args, **kwargs)

    monkeypatch.setattr(outbox, "relay_once", flaky)
    caplog.set_level(logging.INFO, logger="standmeet.broker.outbox")
    relay = _start(relays, database_url)
    # When an event is emitted
    with conn.transaction():
        event_id = emit(conn, "test.ping", {"label": "after-the-bug"})
    # Then the loop lived through every failure and relays it
    wait_for(lambda: _event(database_url, event_id)[0], timeout_s=20, what="the event to be relayed")
    assert failures["left"] == 0 and relay._thread.alive
    lines = [r for r in caplog.records if r.name == "standmeet.broker.outbox"]
    failing = [r for r in lines if "a pass failed" in r.getMessage()]
    again = [r for r in lines if "relaying again" in r.getMessage()]
    assert len(failing) == 1 and "RuntimeError: a bug in a pass" in failing[0].getMessage()
    assert failing[0].exc_info is None  # one line, not a traceback
    assert len(again) == 1 and "4 failed attempt(s)" in again[0].getMessage()


def test_a_relay_that_cannot_listen_polls_at_the_unlistened_interval(
        broker, database_url, clean, conn, relays, monkeypatch):
    # Given a connection that cannot LISTEN (a transaction pooler with no LISTEN URL)
    monkeypatch.setattr(pgpool, "listen_url", lambda url: None)
    relay = _start(relays, database_url)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = %s", (relay.id,)),
             timeout_s=10, what="the relay to register")
    assert not relay.listening
    # When an event is written with no NOTIFY to wake anyone
    (event_id,) = conn.execute("INSERT INTO standmeet.outbox (topic, payload) VALUES ('test.ping', %s)"
                               " RETURNING id", ('{"label": "polled"}',)).fetchone()
    started = time.monotonic()
    # Then it is relayed at the poll of pgpool, not at the relay's 30 s
    wait_for(lambda: _event(database_url, event_id)[0], timeout_s=5, what="the polled event")
    assert time.monotonic() - started < 2.0
    started = time.monotonic()
    assert relay.stop(timeout_s=5) and time.monotonic() - started < 1.0


def test_an_event_postgres_refuses_is_failed_alone_with_the_reason_and_the_rest_are_relayed(
        broker, database_url, clean, conn, relays, caplog):
    # Given events, one of which makes a message Postgres cannot store (jsonb takes no \u0000)
    with conn.transaction():
        events = [emit(conn, "test.routing.nul", {"label": f"refused-{i}", "nul": i == 2}) for i in range(5)]
    caplog.set_level(logging.INFO, logger="standmeet.broker.outbox")
    # When the relay loop runs
    _start(relays, database_url)
    # Then that event is failed with the reason, and every other one is relayed
    wait_for(lambda: all(_event(database_url, e)[0] for e in events if e != events[2]), timeout_s=15,
             what="the other events to be relayed")
    relayed, error, _ = _event(database_url, events[2])
    assert not relayed and error.startswith("UntranslatableCharacter: ")
    assert [r.getMessage() for r in caplog.records if f"outbox event {events[2]} cannot be relayed" in r.getMessage()]


def _scrape(database_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(database_url, rescue_after_s=RESCUE_AFTER_S))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_an_event_a_newer_release_routes_to_more_actors_is_left_to_a_relay_that_knows_them_all(
        broker, database_url, clean, conn, relays):
    from broker.outbox.routes import ROUTES

    # Given this process's relay alive, routing test.ping to its actors
    relay = _start(relays, database_url)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = %s", (relay.id,)),
             timeout_s=10, what="the relay to register")
    ours = sorted(r.actor for r in ROUTES["test.ping"])
    newer = [*ours, "test.mark"]
    # and two events of test.ping: one emitted here, one by a newer release that also routes it
    # to another actor (as a rolling deploy has them side by side)
    with conn.transaction():
        same = emit(conn, "test.ping", {"label": "same-routes"})
        ahead = conn.execute(sql.EMIT, {"topic": "test.ping", "payload": '{"label": "newer-routes"}',
                                        "routes": route_actors_of(newer)}).fetchone()[0]
    # When a relay pass runs here (beside this process's running relay)
    relay_once(conn, limit=200)
    # Then the event whose routes it knows is relayed, and the newer one left pending,
    # untouched (relaying it would write no message for the actor it does not know)
    wait_for(lambda: _event(database_url, same)[:2] == (True, None), timeout_s=10, what="the known event relayed")
    assert scalar(database_url, "SELECT messages FROM standmeet.outbox WHERE id = %s", (same,)) == len(ours)
    assert _event(database_url, ahead) == (False, None, None)
    # and operators see it unrouted: no live relay knows all its routes
    assert [(t.topic, t.events) for t in ops.unrouted_topics(conn, rescue_after_s=RESCUE_AFTER_S)] == [("test.ping", 1)]
    assert [e.state for e in ops.list_outbox_events(conn, rescue_after_s=RESCUE_AFTER_S)] == ["unrouted"]
    # When a relay of the newer release is alive, it is pending for it, and a pass there takes it
    conn.execute(outbox.RELAY_HEARTBEAT, {"id": str(uuid.uuid4()), "hostname": "newer-host", "pid": 1,
                                          "topics": ["test.ping"],
                                          "routes": '{"test.ping": ' + route_actors_of(newer) + "}",
                                          "rescue_after_s": None})
    assert ops.unrouted_topics(conn, rescue_after_s=RESCUE_AFTER_S) == []
    from tests.support.jobs import _ping

    route("test.ping", "test.mark", _ping)  # (this process becomes the newer release)
    try:
        relayed = relay_once(conn, limit=200, topics=["test.ping"])
    finally:
        ROUTES["test.ping"] = [r for r in ROUTES["test.ping"] if r.actor != "test.mark"]
    assert (relayed.claimed, relayed.messages) == (1, 2) and _event(database_url, ahead)[:2] == (True, None)
    assert sorted(r.actor for r in ROUTES["test.ping"]) == ours


def route_actors_of(actors: list[str]) -> str:
    import json

    return json.dumps(sorted(actors), separators=(",", ":"))


def test_an_event_whose_routes_no_live_relay_knows_all_of_is_relayed_to_the_known_ones_once_old_enough(
        broker, database_url, clean, conn, relays, caplog):
    from broker.outbox.routes import ROUTES

    # Given this process's relay alive, and events of test.ping emitted by a release that
    # also routed it to an actor since removed (none of that release is left)
    relay = _start(relays, database_url)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = %s", (relay.id,)),
             timeout_s=10, what="the relay to register")
    ours = sorted(r.actor for r in ROUTES["test.ping"])
    with_removed = route_actors_of([*ours, "test.removed_since"])
    with conn.transaction():
        old = conn.execute(sql.EMIT, {"topic": "test.ping", "payload": '{"label": "old"}',
                                      "routes": with_removed}).fetchone()[0]
        young = conn.execute(sql.EMIT, {"topic": "test.ping", "payload": '{"label": "young"}',
                                        "routes": with_removed}).fetchone()[0]
        conn.execute("UPDATE standmeet.outbox SET created_at = now() - interval '1 hour' WHERE id = %s", (old,))
    # When relay passes run
    with caplog.at_level(logging.WARNING, logger="standmeet.broker.outbox.relay"):
        relay_once(conn, limit=200)
        # (the relay that took it, this pass or the process's own relay, says so once it committed)
        wait_for(lambda: _event(database_url, old)[0] and any("relayed without" in r.getMessage()
                                                               for r in caplog.records),
                 timeout_s=10, what="the old event relayed and the routes it went without logged")
    # Then the one older than STANDMEET_OUTBOX_UNROUTED_MAX_AGE_S (300 s) is relayed to the
    # routes known, saying which it went without; the young one still waits (unrouted)
    assert scalar(database_url, "SELECT messages FROM standmeet.outbox WHERE id = %s", (old,)) == len(ours)
    assert [r.getMessage() for r in caplog.records if "relayed without" in r.getMessage()] == [
        "1 outbox event(s) of test.ping relayed without their routes to test.removed_since: no live process routes them"]
    assert _event(database_url, young) == (False, None, None)
    assert [e.id for e in ops.list_outbox_events(conn, rescue_after_s=RESCUE_AFTER_S) if e.state == "unrouted"] == [young]


def test_an_old_event_is_not_relayed_without_a_route_while_a_relay_that_knows_it_was_alive_within_the_max_age(
        broker, database_url, clean, conn, relays, caplog):
    from broker.outbox.routes import ROUTES

    # Given this process's relay alive (an older release's, in a rolling deploy), and a
    # newer release's relay that routes test.ping to one more actor, stopped a moment ago
    # (restarting)
    relay = _start(relays, database_url)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = %s", (relay.id,)),
             timeout_s=10, what="the relay to register")
    newer = route_actors_of([*sorted(r.actor for r in ROUTES["test.ping"]), "test.newer_route"])
    newer_relay = str(uuid.uuid4())
    conn.execute(outbox.RELAY_HEARTBEAT, {"id": newer_relay, "hostname": "newer-host", "pid": 1,
                                          "topics": ["test.ping"], "routes": '{"test.ping": ' + newer + "}",
                                          "rescue_after_s": None})
    conn.execute(outbox.RELAY_STOPPED, {"id": newer_relay})
    # and an event the newer release emitted an hour ago (a backlog older than the max age)
    with conn.transaction():
        event = conn.execute(sql.EMIT, {"topic": "test.ping", "payload": '{"label": "backlog"}',
                                        "routes": newer}).fetchone()[0]
        conn.execute("UPDATE standmeet.outbox SET created_at = now() - interval '1 hour' WHERE id = %s", (event,))
    # When a relay pass runs here
    with caplog.at_level(logging.WARNING, logger="standmeet.broker.outbox.relay"):
        relay_once(conn, limit=200)
    # Then the event waits for the newer release's relay: it is not relayed without its route
    assert _event(database_url, event) == (False, None, None)
    assert not [r for r in caplog.records if "relayed without" in r.getMessage()]
    # When that relay has been gone for longer than the max age (the release was rolled back)
    conn.execute("UPDATE standmeet.relays SET stopped_at = now() - interval '1 hour',"
                 " heartbeat_at = now() - interval '1 hour' WHERE id = %s", (newer_relay,))
    # Then the next pass relays it to the routes known, saying which it went without
    with caplog.at_level(logging.WARNING, logger="standmeet.broker.outbox.relay"):
        relay_once(conn, limit=200)
        wait_for(lambda: _event(database_url, event)[0], timeout_s=10, what="the event relayed without its route")
    assert [r.getMessage() for r in caplog.records if "relayed without" in r.getMessage()] == [
        "1 outbox event(s) of test.ping relayed without their routes to test.newer_route: no live process routes them"]


def test_a_running_relay_that_knows_the_route_counts_while_rescue_would_even_with_a_max_age_below_its_heartbeat(
        broker, database_url, clean, conn, relays, monkeypatch):
    from broker.outbox.routes import ROUTES
    from broker.settings import replace

    # Given a max age of 2 s, below a relay's heartbeat, and rescue after 20 s
    monkeypatch.setattr(broker, "settings", replace(broker.settings, outbox_unrouted_max_age_s=2.0,
                                                    rescue_after_s=20.0))
    # and a newer release's relay, running, that routes test.ping to one more actor: its
    # last heartbeat 6 s ago (between two beats)
    newer = route_actors_of([*sorted(r.actor for r in ROUTES["test.ping"]), "test.newer_route"])
    newer_relay = str(uuid.uuid4())
    conn.execute(outbox.RELAY_HEARTBEAT, {"id": newer_relay, "hostname": "newer-host", "pid": 1,
                                          "topics": ["test.ping"], "routes": '{"test.ping": ' + newer + "}",
                                          "rescue_after_s": None})
    conn.execute("UPDATE standmeet.relays SET heartbeat_at = now() - interval '6 seconds' WHERE id = %s",
                 (newer_relay,))
    # and an event it emitted a minute ago
    with conn.transaction():
        event = conn.execute(sql.EMIT, {"topic": "test.ping", "payload": '{"label": "between-beats"}',
                                        "routes": newer}).fetchone()[0]
        conn.execute("UPDATE standmeet.outbox SET created_at = now() - interval '1 minute' WHERE id = %s", (event,))
    # When a relay pass of this (older) release runs
    relay_once(conn, limit=200)
    # Then the event waits for the running relay that knows its route
    assert _event(database_url, event) == (False, None, None)


def test_a_running_relay_started_with_a_longer_rescue_window_counts_as_long_as_its_own_window_says(
        broker, database_url, clean, conn, monkeypatch):
    from broker.outbox.routes import ROUTES
    from broker.settings import replace

    # Given this (older) release's relay judging with rescue after 20 s and a max age of 2 s
    monkeypatch.setattr(broker, "settings", replace(broker.settings, outbox_unrouted_max_age_s=2.0,
                                                    rescue_after_s=20.0))
    # and a newer release's relay, running, started with rescue after 600 s (a heartbeat
    # every 120 s), that routes test.ping to one more actor: its last beat 100 s ago
    newer = route_actors_of([*sorted(r.actor for r in ROUTES["test.ping"]), "test.newer_route"])
    newer_relay = str(uuid.uuid4())
    conn.execute(outbox.RELAY_HEARTBEAT, {"id": newer_relay, "hostname": "newer-host", "pid": 1,
                                          "topics": ["test.ping"], "routes": '{"test.ping": ' + newer + "}",
                                          "rescue_after_s": 600.0})
    conn.execute("UPDATE standmeet.relays SET heartbeat_at = now() - interval '100 seconds' WHERE id = %s",
                 (newer_relay,))
    # and an event it emitted a minute ago
    with conn.transaction():
        event = conn.execute(sql.EMIT, {"topic": "test.ping", "payload": '{"label": "long-window"}',
                                        "routes": newer}).fetchone()[0]
        conn.execute("UPDATE standmeet.outbox SET created_at = now() - interval '1 minute' WHERE id = %s", (event,))
    # When a relay pass of this release runs
    relay_once(conn, limit=200)
    # Then the event waits for the relay that knows its route, which operators see alive
    assert _event(database_url, event) == (False, None, None)
    [newer_status] = [r for r in ops.relay_overview(conn, rescue_after_s=20.0) if r.id == newer_relay]
    assert newer_status.alive
    assert ops.unrouted_topics(conn, rescue_after_s=20.0) == []
    # When it has been silent past its own window
    conn.execute("UPDATE standmeet.relays SET heartbeat_at = now() - interval '700 seconds' WHERE id = %s",
                 (newer_relay,))
    # Then it is gone: the event is relayed to the routes known
    relay_once(conn, limit=200)
    wait_for(lambda: _event(database_url, event)[0], timeout_s=10, what="the event relayed without its route")


def test_a_relays_heartbeat_records_its_processs_rescue_window_and_at_least_twice_its_pace(
        broker, database_url, clean, conn):
    relay = Relay(database_url, topics=["test.ping"], heartbeat_s=30.0)
    try:
        relay.heartbeat()
        relay._heartbeat_s = 30.0  # (as its loop sets it)
        relay.heartbeat()
    finally:
        relay.close()
    assert broker.settings.rescue_after_s < 60
    assert scalar(database_url, "SELECT rescue_after_s FROM standmeet.relays WHERE id = %s", (relay.id,)) == 60.0


def test_a_relay_pass_takes_no_more_than_its_limit_whatever_plan_the_statistics_lead_to(
        broker, database_url, clean, conn):
    # Given statistics gathered while the outbox held a single event (the planner then joins
    # the pass's rows in a plan that reads its subquery again for each row it marks)
    emit(conn, "test.ping", {"label": "nearly-empty"})
    conn.execute("ANALYZE standmeet.outbox")
    # and nine pending events now
    with conn.transaction():
        for n in range(8):
            emit(conn, "test.ping", {"label": f"backlog-{n}"})

    # When one pass of two runs
    result = relay_once(conn, limit=2, topics=["test.ping"])

    # Then it took two, and left seven pending for the next passes
    assert result.claimed == 2
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE relayed_at IS NULL") == 7


def test_a_relay_draining_a_long_backlog_proves_itself_alive_between_passes(
        broker, database_url, clean, conn, monkeypatch):
    # Given a backlog of nine events for a relay taking two a pass, its heartbeat due each time
    with conn.transaction():
        for n in range(9):
            emit(conn, "test.ping", {"label": f"backlog-{n}"})
    relay = Relay(database_url, batch=2, topics=["test.ping"])
    beats: list[float] = []
    monkeypatch.setattr(relay, "heartbeat", lambda: beats.append(time.monotonic()))
    relay._heartbeat_s = 0.0  # (as its loop sets it, but due at every pass)
    try:
        # When it drains them
        assert relay.drain_once() == 9
    finally:
        relay.close()
    # Then it beat between its passes (four full ones), not only before the drain
    assert len(beats) == 4


def test_an_event_another_relay_relayed_while_this_one_looked_for_the_refused_one_is_not_failed(
        broker, database_url, clean, conn, monkeypatch):
    # Given an event this relay's pass cannot write (Postgres refuses the data it was given) ...
    with conn.transaction():
        event = emit(conn, "test.ping", {"label": "relayed-elsewhere"})
    relay_rows, relay_pass = outbox._relay_rows, outbox.relay_once
    other = psycopg.connect(database_url, autocommit=True)
    elsewhere: list[Any] = []

    def refused(conn: Any, state: Any, rows: Any) -> None:
        raise psycopg.errors.DataError("refused in this process")

    def this_relays_pass(conn: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(outbox, "_relay_rows", refused)
        try:
            return relay_pass(conn, **kwargs)
        except psycopg.errors.DataError:
            # ... and another relay (another process, another release) relays it between
            # this relay's refused pass and its setting the event aside
            monkeypatch.setattr(outbox, "_relay_rows", relay_rows)
            elsewhere.append(relay_pass(other, topics=["test.ping"]))
            raise
        finally:
            monkeypatch.setattr(outbox, "_relay_rows", relay_rows)

    monkeypatch.setattr(outbox, "relay_once", this_relays_pass)
    relay = Relay(database_url, topics=["test.ping"])
    try:
        # When this relay looks for the event Postgres refused, to set it aside
        relay._set_aside_refused_event(psycopg.errors.DataError("refused"))
    finally:
        relay.close()
        other.close()
    # Then the event stays relayed, with no error: its message was written, once
    assert [r.claimed for r in elsewhere] == [1]
    relayed, error, _ = _event(database_url, event)
    assert relayed and error is None
