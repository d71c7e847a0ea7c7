"""The webhook operator commands, as real processes, with a worker delivering."""

from __future__ import annotations

import subprocess
import sys

from actors import settings as app_settings
from broker.settings import replace
from tests.support.db import query, scalar, wait_for
from tests.support.http import http_server
from tests.support.procs import ROOT


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", "webhooks", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_add_list_ping_disable_enable_and_replay(broker, database_url, subprocess_env, start_worker):
    env = {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",), webhook_busy_snooze_s=0.05))
    # a refused URL exits non-zero with the reason
    refused = cli(subprocess_env, "add", "http://127.0.0.1:9/h", "--events", "x")
    assert refused.returncode == 1 and "loopback address" in refused.stderr
    with http_server() as (url, server):
        added = cli(env, "add", url, "--events", "order.paid,order.refunded")
        assert added.returncode == 0, added.stderr
        fields = dict(line.split(": ", 1) for line in added.stdout.splitlines())
        endpoint, secret = int(fields["id"]), fields["secret"]
        assert secret.startswith("whsec_") and fields["url"] == url
        assert f"{endpoint}\t{url}\torder.paid,order.refunded\tenabled" in cli(env, "list").stdout
        # ping: two events through outbox -> fanout -> deliver
        start_worker(queues=["webhook"], threads=8)
        assert "emitted 2 webhook.ping event(s)" in cli(env, "ping", str(endpoint), "--count", "2").stdout
        wait_for(lambda: len(server.received) == 2, timeout_s=15, what="two pings delivered")
        # disabled: a new event is stored as skipped, and nothing is sent
        assert cli(env, "disable", str(endpoint)).returncode == 0
        import psycopg

        from actors import webhooks
        with psycopg.connect(database_url) as conn, conn.transaction():
            event = webhooks.emit_event(conn, "order.paid", {"order": 9})
        wait_for(lambda: query(database_url, "SELECT state FROM standmeet.webhook_deliveries WHERE event_id = %s",
                               (event,)) == [("skipped",)], timeout_s=15, what="a skipped delivery")
        assert "disabled (disabled by " in cli(env, "list").stdout and "(cli))" in cli(env, "list").stdout
        # enabled again, a replay of everything failed or skipped since then delivers it
        assert cli(env, "enable", str(endpoint)).returncode == 0
        replayed = cli(env, "replay", "--failed-since", "2000-01-01T00:00:00+00:00")
        assert replayed.stdout.strip() == "1 delivery(ies) queued again", replayed.stderr
        wait_for(lambda: len(server.received) == 3, timeout_s=15, what="the replayed delivery")
        delivery = scalar(database_url, "SELECT id FROM standmeet.webhook_deliveries WHERE event_id = %s", (event,))
        assert cli(env, "replay", str(delivery)).stdout.strip() == f"delivery {delivery} queued again"
        wait_for(lambda: len(server.received) == 4, timeout_s=15, what="one delivery replayed by id")
    # and each action is recorded, who and from where, as the dashboard's buttons record theirs
    recorded = query(database_url, "SELECT action, target, source, affected FROM standmeet.operator_actions"
                                   " WHERE action LIKE 'webhooks.%%' ORDER BY id")
    assert [(a, s, n) for a, _, s, n in recorded] == [("webhooks.disable", "cli", 1), ("webhooks.enable", "cli", 1),
                                                      ("webhooks.replay", "cli", 1), ("webhooks.replay", "cli", 1)]
    assert recorded[0][1] == {"endpoint_id": endpoint} and recorded[3][1]["delivery_id"] == delivery


def test_the_health_job_disables_an_endpoint_failing_for_five_days(broker, database_url, start_worker):
    from actors import webhooks

    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",)))
    sick, _ = webhooks.add_endpoint("http://127.0.0.1:9/sick", ["x"])
    recent, _ = webhooks.add_endpoint("http://127.0.0.1:9/recent", ["x"])
    query(database_url, "UPDATE standmeet.webhook_endpoints SET failing_since = now() - interval '6 days' WHERE id = %s", (sick,))
    query(database_url, "UPDATE standmeet.webhook_endpoints SET failing_since = now() - interval '1 day' WHERE id = %s", (recent,))
    start_worker(queues=["maintenance"], threads=1)
    webhooks.webhook_health.send()
    wait_for(lambda: scalar(database_url, "SELECT NOT enabled FROM standmeet.webhook_endpoints WHERE id = %s", (sick,)),
             timeout_s=15, what="the sick endpoint disabled")
    reason = scalar(database_url, "SELECT disabled_reason FROM standmeet.webhook_endpoints WHERE id = %s", (sick,))
    assert reason.startswith("failing continuously since")
    assert scalar(database_url, "SELECT enabled FROM standmeet.webhook_endpoints WHERE id = %s", (recent,))


def test_the_health_job_counts_fractions_of_a_day(broker, database_url, start_worker):
    from actors import webhooks

    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",), webhook_disable_after_days=0.5))
    day, hours = webhooks.add_endpoint("http://127.0.0.1:9/day", ["x"])[0], webhooks.add_endpoint("http://127.0.0.1:9/6h", ["x"])[0]
    query(database_url, "UPDATE standmeet.webhook_endpoints SET failing_since = now() - interval '1 day' WHERE id = %s", (day,))
    query(database_url, "UPDATE standmeet.webhook_endpoints SET failing_since = now() - interval '6 hours' WHERE id = %s", (hours,))
    start_worker(queues=["maintenance"], threads=1)
    message = webhooks.webhook_health.send()
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=15, what="the health job")
    enabled = dict(query(database_url, "SELECT id, enabled FROM standmeet.webhook_endpoints WHERE id IN (%s, %s)", (day, hours)))
    assert enabled == {day: False, hours: True}  # half a day is twelve hours, not zero
