"""The operators' commands (status, jobs, queues, webhook deliveries), run as real
processes against real workers."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import dramatiq

from actors import settings as app_settings
from broker.settings import replace
from tests.support.db import query, scalar, wait_for
from tests.support.http import http_server
from tests.support.job_rows import drop_queue, put_jobs
from tests.support.jobs import SLEEP, noop
from tests.support.procs import ROOT, running, worker_cmd


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


@dramatiq.actor(actor_name="opscli.broken", queue_name="index", max_retries=0)
def broken(order: int) -> None:
    raise ValueError(f"order {order} has no lines")


def _state(url: str, message_id: str) -> str:
    return str(scalar(url, "SELECT state FROM dramatiq.queue WHERE message_id = %s", (message_id,)))


def _settled(url: str, message_id: str) -> str:
    return wait_for(lambda: (s := _state(url, message_id)) in ("done", "rejected") and s,
                    timeout_s=15, what=f"job {message_id} to finish")


def test_status_reports_queues_workers_and_periodic_jobs_and_check_fails_on_what_is_wrong(
        broker, database_url, subprocess_env, tmp_path):
    with running(worker_cmd(), subprocess_env, log=tmp_path / "worker.log") as worker:
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.worker_processes"
                                              " WHERE pid = %s AND stopped_at IS NULL", (worker.pid,)),
                 timeout_s=20, what="the worker process to register")
        doc = json.loads(ok(cli(subprocess_env, "status", "--json")))
        healthy = cli(subprocess_env, "status", "--check")
        nobody = cli(subprocess_env, "status", "--check", "--queues", "index", "reports")
        assert "index" in ok(cli(subprocess_env, "status"))
    names = {q["name"]: q for q in doc["queues"]}
    assert {"index", "notify", "webhook", "maintenance", "fetch"} <= set(names)
    for key in ("name", "queued", "delayed", "running", "prefetched", "rejected", "oldest_queued_age_s", "paused"):
        assert key in names["index"]
    (me,) = [w for w in doc["workers"] if w["pid"] == worker.pid]
    for key in ("id", "host", "pid", "queues", "last_heartbeat_age_s", "running"):
        assert key in me
    assert me["alive"] and "index" in me["queues"]
    assert {p["job"] for p in doc["periodic"]} >= {"rescue", "prune-messages"}
    assert healthy.returncode == 0 and "healthy" in healthy.stdout, healthy.stderr
    assert nobody.returncode == 1
    assert "queue reports: no live worker process serves it" in nobody.stderr
    # a due job that waited too long fails the check, and says which queue
    noop.send("stale")
    query(database_url, "UPDATE dramatiq.queue SET eta = now() - interval '10 minutes' WHERE queue_name = 'index'"
                        " AND state = 'queued'")
    stale = cli(subprocess_env, "status", "--check", "--max-age-s", "60")
    assert stale.returncode == 1
    assert "unhealthy: queue index: the oldest due job has waited 60" in stale.stderr
    assert "(more than 60 s)" in stale.stderr


def test_jobs_are_listed_shown_retried_and_cancelled_from_the_command_line(
        broker, database_url, subprocess_env, start_worker):
    start_worker(queues=["index"], threads=4)
    failed = broken.send(77)
    _settled(database_url, failed.message_id)

    listed = json.loads(ok(cli(subprocess_env, "jobs", "list", "--state", "rejected", "--queue", "index",
                               "--actor", "opscli.broken", "--json")))
    assert [j["id"] for j in listed] == [failed.message_id]
    assert set(listed[0]) == {"id", "queue", "actor", "state", "retries", "enqueued_at", "error"}
    assert listed[0]["error"] == "ValueError: order 77 has no lines"
    assert failed.message_id in ok(cli(subprocess_env, "jobs", "list", "--since", "1h"))

    shown = json.loads(ok(cli(subprocess_env, "jobs", "show", failed.message_id, "--json")))
    assert shown["state"] == "rejected" and "args" not in shown and shown["args_hidden"] is True
    assert "ValueError: order 77 has no lines" in shown["traceback"]
    assert [e["event"] for e in shown["timeline"]][-1] == "rejected"
    with_args = json.loads(ok(cli(subprocess_env, "jobs", "show", failed.message_id, "--show-args", "--json")))
    assert with_args["args"] == [77]
    table = ok(cli(subprocess_env, "jobs", "show", failed.message_id))
    assert "hidden (--show-args)" in table and "Traceback" in table

    assert ok(cli(subprocess_env, "jobs", "retry", failed.message_id)).strip() == "retried 1 job(s)"
    wait_for(lambda: scalar(database_url, "SELECT claims FROM dramatiq.queue WHERE message_id = %s",
                            (failed.message_id,)) == 2 and _state(database_url, failed.message_id) == "rejected",
             timeout_s=15, what="the retried job to run again")
    assert ok(cli(subprocess_env, "jobs", "retry", "--state", "rejected", "--queue", "index")) == "retried 1 job(s)\n"
    _settled(database_url, failed.message_id)
    retried_by = scalar(database_url, "SELECT retried_by FROM dramatiq.queue WHERE message_id = %s",
                        (failed.message_id,))
    assert "@" in retried_by

    later = noop.send_with_options(args=("cancel-me",), delay=60_000)
    assert ok(cli(subprocess_env, "jobs", "cancel", later.message_id)).strip() == "cancelled 1 job(s)"
    assert _state(database_url, later.message_id) == "rejected"
    again = cli(subprocess_env, "jobs", "cancel", later.message_id)
    assert again.returncode == 1 and "cancelled already" in again.stderr
    done = noop.send("done-one")
    _settled(database_url, done.message_id)
    not_rejected = cli(subprocess_env, "jobs", "retry", done.message_id)
    assert not_rejected.returncode == 1 and "is done, not rejected" in not_rejected.stderr
    # every action was recorded, by whom and from where
    actions = query(database_url, "SELECT action, affected, source FROM standmeet.operator_actions ORDER BY id")
    assert ("jobs.retry", 1, "cli") in actions and ("jobs.cancel", 1, "cli") in actions


def test_bad_input_is_one_line_naming_what_was_wrong(broker, subprocess_env):
    for args, says in [
        (("jobs", "show", "17"), "'17' is not a job id: a prefix needs at least 8 hex digits"),
        (("jobs", "show", "00000000-0000-0000-0000-000000000000"), "no job 00000000-0000-0000-0000-000000000000"),
        (("jobs", "show", "ffffffff"), "no job id starts with 'ffffffff'"),
        (("jobs", "cancel", "0b5a"), "'0b5a' is not a job id: a prefix needs at least 8 hex digits"),
        (("jobs", "retry", "0b5a-zz"), "'0b5a-zz' is not a job id or the start of one"),
        (("jobs", "retry"), "give job ids, or --state rejected"),
        (("jobs", "retry", "--state", "cancelled"), "add --include-cancelled"),
        (("queues", "pause", "indx"), "unknown queue 'indx'"),
        (("jobs", "list", "--queue", "indx"), "unknown queue 'indx': no job, pause or worker process names it;"),
        (("jobs", "retry", "--state", "rejected", "--queue", "indx"), "unknown queue 'indx'"),
        (("jobs", "cancel", "--queue", "indx"), "unknown queue 'indx'"),
        (("jobs", "list", "--search", "x" * 501), "search: the text to search arguments for must be at most 500"),
    ]:
        result = cli(subprocess_env, *args)
        assert result.returncode == 1, (args, result.stdout)
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert "unknown queue" not in says or "known: " in result.stderr  # the fix: the names it knows
    # arguments the parser refuses: one line too (exit 2, as argparse does)
    for args, says in [
        (("jobs", "list", "--state", "failed"), "standmeet-jobs jobs list: argument --state: invalid choice: 'failed'"),
        (("jobs", "list", "--since", "last tuesday"),
         "standmeet-jobs jobs list: argument --since: since 'last tuesday' is neither an ISO time"),
    ]:
        result = cli(subprocess_env, *args)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1
        assert result.stderr.startswith(says), result.stderr


def test_a_queue_known_only_from_its_old_jobs_is_not_refused(broker, database_url, subprocess_env):
    # Given a queue whose only job finished three days ago (no declaration, worker or pause names it)
    (old,) = put_jobs(database_url, "long_ago", rejected_with="gone")
    query(database_url, "UPDATE dramatiq.queue SET mtime = now() - interval '3 days' WHERE message_id = %s", (old,))
    try:
        listed = json.loads(ok(cli(subprocess_env, "jobs", "list", "--queue", "long_ago", "--json")))
    finally:
        drop_queue(database_url, "long_ago")
    assert [j["id"] for j in listed] == [old]


def test_cancel_is_final_no_filtered_retry_touches_a_cancelled_job_unless_told(broker, database_url, subprocess_env):
    # Given two rejected jobs of a queue, and a third, delayed 10 minutes, that an operator
    # cancels by the 8 characters `status` shows
    queue = "cancel_final"
    rejected = put_jobs(database_url, queue, 2, rejected_with="ValueError: broken")
    (later,) = put_jobs(database_url, queue, delay_ms=600_000)
    try:
        assert ok(cli(subprocess_env, "jobs", "cancel", later[:8])).strip() == "cancelled 1 job(s)"
        # When every rejected job of the queue is retried
        retried = ok(cli(subprocess_env, "jobs", "retry", "--state", "rejected", "--queue", queue, "--since", "1h"))
        # Then the cancelled one is skipped, and the command says so and why
        assert retried.splitlines() == [
            "retried 2 job(s)",
            "skipped 1 cancelled job(s): cancel is final (--include-cancelled retries them too, or name each by "
            "its id)"]
        states = dict(query(database_url, "SELECT message_id::text, state::text FROM dramatiq.queue"
                                          " WHERE queue_name = %s", (queue,)))
        assert states == {rejected[0]: "queued", rejected[1]: "queued", later: "rejected"}
        assert scalar(database_url, "SELECT cancelled_at IS NOT NULL FROM dramatiq.queue WHERE message_id = %s",
                      (later,))
        assert ok(cli(subprocess_env, "jobs", "retry", "--state", "cancelled", "--queue", queue,
                      "--include-cancelled")).splitlines()[0] == "retried 1 job(s)"
        assert ok(cli(subprocess_env, "jobs", "cancel", later)).strip() == "cancelled 1 job(s)"
        # And a retry that names it by its id retries it, saying it had been cancelled
        named = ok(cli(subprocess_env, "jobs", "retry", later[:10]))
        assert named.splitlines() == ["retried 1 job(s)",
                                      f"job {later} had been cancelled: retried all the same (named by its id)"]
        assert _state(database_url, later) == "queued"
    finally:
        drop_queue(database_url, queue)


def test_a_unique_id_prefix_of_8_hex_digits_is_taken_wherever_a_job_id_is(broker, database_url, subprocess_env):
    queue = "id_prefix_cli"
    twins = put_jobs(database_url, queue, ids=["0b5a1c2d-0000-4000-8000-000000000001",
                                               "0b5a1c2d-0000-4000-8000-000000000002"], rejected_with="broken")
    (alone,) = put_jobs(database_url, queue, ids=["0b5a1c2e-0000-4000-8000-000000000003"], rejected_with="broken")
    try:
        assert json.loads(ok(cli(subprocess_env, "jobs", "show", "0b5a1c2e", "--json")))["id"] == alone
        ambiguous = cli(subprocess_env, "jobs", "show", "0b5a1c2d")
        assert ambiguous.returncode == 1 and len(ambiguous.stderr.strip().splitlines()) == 1
        assert "'0b5a1c2d' is ambiguous: it matches " + ", ".join(twins) in ambiguous.stderr
        assert ok(cli(subprocess_env, "jobs", "retry", "0b5a1c2e", alone)).strip() == "retried 1 job(s)"
        assert ok(cli(subprocess_env, "jobs", "cancel", "0B5A1C2E")).strip() == "cancelled 1 job(s)"
        ambiguous = cli(subprocess_env, "jobs", "cancel", twins[1][:-1])  # 35 characters, still both
        assert ambiguous.returncode == 1 and "is ambiguous" in ambiguous.stderr
        assert ok(cli(subprocess_env, "jobs", "retry", twins[1])).strip() == "retried 1 job(s)"
    finally:
        drop_queue(database_url, queue)
    actions = query(database_url, "SELECT target FROM standmeet.operator_actions WHERE action = 'jobs.cancel'"
                                  " ORDER BY id DESC LIMIT 1")
    assert actions == [({"message_ids": [alone]},)]  # the whole id is recorded


def test_jobs_show_hides_the_arguments_of_every_message_its_options_carry(broker, database_url, subprocess_env):
    # Given a job whose next pipeline step, and a step after it, carry arguments of their own
    pipe = {"queue_name": "index", "actor_name": "next.step", "args": ["secret-arg"], "kwargs": {"token": "secret-kw"},
            "options": {"pipe_target": {"actor_name": "last.step", "args": ["deeper-secret"], "kwargs": {}}}}
    (job,) = put_jobs(database_url, "pipes", args=["own-secret"], options={"pipe_target": pipe},
                      rejected_with="broken")
    try:
        table = ok(cli(subprocess_env, "jobs", "show", job))
        doc = ok(cli(subprocess_env, "jobs", "show", job, "--json"))
        revealed = ok(cli(subprocess_env, "jobs", "show", job, "--show-args", "--json"))
    finally:
        drop_queue(database_url, "pipes")
    # Then without --show-args none of their arguments is shown, while what runs next is
    for shown in (table, doc):
        assert not any(secret in shown for secret in ("own-secret", "secret-arg", "secret-kw", "deeper-secret"))
        assert "next.step" in shown and "last.step" in shown
    options = json.loads(doc)["options"]["pipe_target"]
    assert options["args"] == options["kwargs"] == options["options"]["pipe_target"]["args"] == "(hidden)"
    # And --show-args shows them all
    assert all(secret in revealed for secret in ("own-secret", "secret-arg", "secret-kw", "deeper-secret"))


def test_a_paused_queue_is_not_claimed_by_any_process_and_resumes_within_a_second(
        broker, database_url, subprocess_env, tmp_path):
    cmd = worker_cmd("--queues", "notify", "index")
    with running(cmd, subprocess_env, log=tmp_path / "w1.log") as w1, \
            running(cmd, subprocess_env, log=tmp_path / "w2.log") as w2:
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.worker_processes"
                                              " WHERE pid IN (%s, %s) AND stopped_at IS NULL", (w1.pid, w2.pid)) == 2,
                 timeout_s=20, what="both worker processes to register")
        assert ok(cli(subprocess_env, "queues", "pause", "notify")).strip() == "queue notify paused"
        queues = json.loads(ok(cli(subprocess_env, "status", "--json")))["queues"]
        assert {q["name"]: q["paused"] for q in queues}["notify"] is True
        waiting = [SLEEP["notify"].send(10, f"paused-{n}") for n in range(4)]
        # both processes keep working on the other queue meanwhile
        others = [noop.send(f"meanwhile-{n}") for n in range(6)]
        for message in others:
            assert _settled(database_url, message.message_id) == "done"
        assert {_state(database_url, m.message_id) for m in waiting} == {"queued"}
        assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label LIKE 'paused-%%'") == 0

        assert ok(cli(subprocess_env, "queues", "resume", "notify")).strip() == "queue notify resumed"
        for message in waiting:
            assert _settled(database_url, message.message_id) == "done"
    resumed_at = scalar(database_url, "SELECT max(at) FROM standmeet.operator_actions WHERE action = 'queues.resume'")
    first_start = scalar(database_url, "SELECT min(started_at) FROM test_runs WHERE label LIKE 'paused-%%'")
    assert (first_start - resumed_at).total_seconds() < 1.0


def test_webhook_deliveries_show_attempts_status_and_error_and_list_says_why_an_endpoint_fails(
        broker, database_url, subprocess_env, start_worker):
    import psycopg

    from actors import webhooks

    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",)))
    with http_server(status=503) as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["order.paid"])
        worker = start_worker(queues=["webhook"], threads=4)
        with psycopg.connect(database_url) as conn, conn.transaction():
            event = webhooks.emit_event(conn, "order.paid", {"order": 5})
        wait_for(lambda: scalar(database_url, "SELECT attempts FROM standmeet.webhook_deliveries WHERE event_id = %s",
                                (event,)), timeout_s=15, what="a first attempt")
        # no second attempt while the commands below read the first (its retry would find
        # the server gone and record another error)
        worker.stop(timeout=10_000)
    deliveries = json.loads(ok(cli(subprocess_env, "webhooks", "deliveries", str(endpoint), "--json")))
    (delivery,) = deliveries
    assert {k: delivery[k] for k in ("endpoint_id", "event", "attempts", "last_status")} == {
        "endpoint_id": endpoint, "event": "order.paid", "attempts": 1, "last_status": 503}
    assert set(delivery) >= {"id", "endpoint_id", "event", "state", "attempts", "last_status", "last_error"}
    assert delivery["last_error"]
    assert str(delivery["id"]) in ok(cli(subprocess_env, "webhooks", "deliveries"))
    listed = ok(cli(subprocess_env, "webhooks", "list"))
    (line,) = [ln for ln in listed.splitlines() if ln.startswith(f"{endpoint}\t")]
    assert "enabled\tfailing since" in line and "HTTP 503" in line


def test_the_runtimes_operator_commands_do_not_import_the_application(broker, subprocess_env):
    # webhooks are the application's: `webhooks list` and `webhooks deliveries` load it
    script = ("import sys, broker.cli\n"
              "for argv in (['status', '--json'], ['jobs', 'list', '--json'], ['queues', 'list']):\n"
              "    assert broker.cli.main(argv) == 0, argv\n"
              "print('imported actors:', any(m == 'actors' or m.startswith('actors.') for m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script], env=subprocess_env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("imported actors: False")


def test_an_endpoint_is_disabled_enabled_and_its_skipped_delivery_replayed(broker, database_url, start_worker):
    import psycopg

    from actors import webhook_views, webhooks

    with app_settings.overridden(allowed_networks=("127.0.0.0/8",)), http_server() as (url, server), \
            psycopg.connect(database_url, autocommit=True) as conn:
        endpoint, _ = webhooks.add_endpoint(url, ["order.shipped"])
        assert webhooks.set_enabled_in(conn, endpoint, False, reason="maintenance window")
        (status,) = [e for e in webhook_views.webhook_endpoints(conn) if e.id == endpoint]
        assert status.why_failing == "disabled: maintenance window"
        start_worker(queues=["webhook"], threads=4)
        with conn.transaction():
            event = webhooks.emit_event(conn, "order.shipped", {"order": 8})
        wait_for(lambda: scalar(database_url, "SELECT state FROM standmeet.webhook_deliveries WHERE event_id = %s",
                                (event,)) == "skipped", timeout_s=15, what="a skipped delivery")
        assert webhooks.set_enabled_in(conn, endpoint, True)
        assert not webhooks.set_enabled_in(conn, 999_999, True)
        delivery = scalar(database_url, "SELECT id FROM standmeet.webhook_deliveries WHERE event_id = %s", (event,))
        with conn.transaction():
            assert webhooks.replay_in(conn, delivery) is not None
            assert webhooks.replay_in(conn, 999_999) is None
        wait_for(lambda: server.received, timeout_s=15, what="the replayed delivery")
        wait_for(lambda: scalar(database_url, "SELECT state FROM standmeet.webhook_deliveries WHERE id = %s",
                                (delivery,)) == "succeeded", timeout_s=15, what="the delivery to succeed")


def test_status_says_which_queue_has_no_worker_and_which_topic_no_process_routes_and_check_fails_after_their_ages(
        broker, database_url, subprocess_env, tmp_path):
    from dramatiq.message import Message

    from broker.engine import sql, sql_enqueue
    from broker.engine.codec import enqueue_params

    env = {**subprocess_env, "STANDMEET_QUEUE_UNSERVED_MAX_AGE_S": "30", "STANDMEET_OUTBOX_UNROUTED_MAX_AGE_S": "30"}
    with running(worker_cmd(), subprocess_env, log=tmp_path / "worker.log") as worker:
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE pid = %s"
                                              " AND stopped_at IS NULL", (worker.pid,)),
                 timeout_s=20, what="the worker process and its relay to register")
        # Given due jobs of a queue no live worker serves (a module no process loads), and an
        # event of a topic no live process routes, both fresh
        query(database_url, sql_enqueue.ENQUEUE, enqueue_params(
            [Message(queue_name="reports_nobody", actor_name="reports.none", args=(i,), kwargs={}, options={})
             for i in range(3)]))
        query(database_url, sql.EMIT, {"topic": "nobody.routes", "payload": "{}", "routes": None})
        try:
            text = ok(cli(env, "status"))
            doc = json.loads(ok(cli(env, "status", "--json")))
            fresh = cli(env, "status", "--check")
            # When they have waited longer than the documented ages
            query(database_url, "UPDATE dramatiq.queue SET eta = now() - interval '2 minutes'"
                                " WHERE queue_name = 'reports_nobody'")
            query(database_url, "UPDATE standmeet.outbox SET created_at = now() - interval '2 minutes'"
                                " WHERE topic = 'nobody.routes'")
            stale = cli(env, "status", "--check")
        finally:
            query(database_url, "DELETE FROM dramatiq.queue WHERE queue_name = 'reports_nobody';"
                                " DELETE FROM standmeet.outbox WHERE topic = 'nobody.routes'")
    # Then status says so, in text and JSON
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("reports_nobody")]
    assert "no worker" in line
    assert "outbox: 1 event(s) of topic nobody.routes that no live process routes" in text
    queues = {q["name"]: q for q in doc["queues"]}
    assert queues["reports_nobody"]["unserved"] is True and queues["reports_nobody"]["live_workers"] == 0
    assert queues["index"]["live_workers"] >= 1 and queues["index"]["no_worker"] is False
    assert [(t["topic"], t["events"]) for t in doc["outbox"]["unrouted"]] == [("nobody.routes", 1)]
    # --check passes while they are fresh, and fails naming each once they are older than the ages
    assert fresh.returncode == 0 and "healthy" in fresh.stdout, fresh.stderr
    assert stale.returncode == 1
    assert ("unhealthy: queue reports_nobody: 3 due job(s) and no live worker process serves it; the oldest has "
            "waited 12") in stale.stderr and "(more than 30 s)" in stale.stderr
    assert ("unhealthy: outbox topic nobody.routes: 1 event(s) that no live process routes; the oldest has "
            "waited 12") in stale.stderr


def test_a_failed_outbox_event_is_listed_and_retried_from_the_command_line(
        broker, database_url, subprocess_env, tmp_path):
    # Given a failed event of a topic a live worker routes (failed as relays failed unknown topics)
    (event_id,) = query(database_url, "INSERT INTO standmeet.outbox (topic, payload, error) VALUES"
                                      " ('test.ping', '{\"label\": \"cli-retried\"}', 'UnknownTopic: no route')"
                                      " RETURNING id")[0]
    listed = json.loads(ok(cli(subprocess_env, "outbox", "list", "--failed", "--json")))
    assert [{k: e[k] for k in ("id", "topic", "state", "error")} for e in listed] == [
        {"id": event_id, "topic": "test.ping", "state": "failed", "error": "UnknownTopic: no route"}]
    assert set(listed[0]) == {"id", "topic", "state", "created_at", "age_s", "error"}
    assert str(event_id) in ok(cli(subprocess_env, "outbox", "list"))
    with running(worker_cmd(), subprocess_env, log=tmp_path / "worker.log"):
        # When an operator retries it
        assert ok(cli(subprocess_env, "outbox", "retry", str(event_id))).strip() == "retried 1 event(s)"
        # Then a relay that routes it relays it, and its job runs once
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'cli-retried'"),
                 timeout_s=20, what="the retried event's job")
    assert query(database_url, "SELECT error, relayed_at IS NOT NULL FROM standmeet.outbox WHERE id = %s",
                 (event_id,)) == [(None, True)]
    again = cli(subprocess_env, "outbox", "retry", str(event_id))
    assert again.returncode == 1 and f"outbox event {event_id} is relayed, not failed: not retried" in again.stderr
    assert ok(cli(subprocess_env, "outbox", "retry", "--failed", "--topic", "test.ping")).strip() \
        == "retried 0 event(s)"
    for args, says in [(("outbox", "retry"), "give event ids, or --failed"),
                       (("outbox", "retry", "abc"), "'abc' is not an outbox event id"),
                       (("outbox", "retry", "1", "--failed"), "not both")]:
        result = cli(subprocess_env, *args)
        assert result.returncode == 1 and says in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    actions = query(database_url, "SELECT target, affected, source FROM standmeet.operator_actions"
                                  " WHERE action = 'outbox.retry' ORDER BY id")
    assert actions[0] == ({"event_ids": [event_id]}, 1, "cli")


def test_jobs_are_found_by_text_in_their_error_and_a_filtered_retry_takes_only_those(broker, database_url,
                                                                                       subprocess_env):
    # Given rejected jobs of a queue, two of them timed out upstream
    timeouts = put_jobs(database_url, "cli_errors", 2, rejected_with="Traceback …\nTimeoutError: upstream took 30 s")
    (other,) = put_jobs(database_url, "cli_errors", rejected_with="ValueError: no lines")
    try:
        # When an operator searches the errors, whatever the case, then retries what matched
        listed = json.loads(ok(cli(subprocess_env, "jobs", "list", "--queue", "cli_errors", "--error",
                                   "timeouterror", "--json")))
        retried = ok(cli(subprocess_env, "jobs", "retry", "--state", "rejected", "--queue", "cli_errors",
                         "--error", "TimeoutError"))
        too_long = cli(subprocess_env, "jobs", "list", "--error", "x" * 201)
        # Then only the two are listed, and retried
        assert {j["id"] for j in listed} == set(timeouts)
        assert all(j["error"] == "TimeoutError: upstream took 30 s" for j in listed)
        assert "retried 2 job(s)" in retried
        assert [_state(database_url, m) for m in [*timeouts, other]] == ["queued", "queued", "rejected"]
        target = query(database_url, "SELECT target FROM standmeet.operator_actions WHERE action = 'jobs.retry'"
                                     " ORDER BY id DESC LIMIT 1")[0][0]
        assert target["error"] == "TimeoutError"
        assert too_long.returncode == 2 and len(too_long.stderr.strip().splitlines()) == 1
        assert "at most 200 characters" in too_long.stderr
    finally:
        drop_queue(database_url, "cli_errors")


def test_status_gives_each_queues_last_hour_and_jobs_show_every_attempt(broker, database_url, subprocess_env,
                                                                        start_worker):
    # Given a worker that ran jobs, three of which failed for good
    start_worker(queues=["index"], threads=2)
    failed = [broken.send(n) for n in range(3)]
    done = [noop.send(f"status-history-{n}") for n in range(4)]
    for message in [*failed, *done]:
        _settled(database_url, message.message_id)
    doc = json.loads(ok(cli(subprocess_env, "status", "--json")))
    text = ok(cli(subprocess_env, "status"))
    shown = json.loads(ok(cli(subprocess_env, "jobs", "show", failed[0].message_id, "--json")))
    # Then status --json sums the last hour of each queue from the history
    assert doc["history"]["window_s"] == 3600
    (index,) = [q for q in doc["history"]["queues"] if q["name"] == "index"]
    assert index["rejected"] >= 3 and index["failures"] >= 3 and index["done"] >= 4
    assert index["throughput_per_s"] == round(index["done"] / 3600, 3)
    for key in ("wait_p50_ms", "wait_p95_ms", "run_p50_ms", "run_p95_ms"):
        assert index[key] is not None and index[key] >= 0
    assert index["wait_p50_ms"] <= index["wait_p95_ms"] and index["run_p50_ms"] <= index["run_p95_ms"]
    # and status prints a line for it
    assert re.search(r"last hour index: \d+ done \([\d.]+/s\), \d+ failures; wait p50 [\d.]+ m?s p95 [\d.]+ m?s; "
                     r"run p50 [\d.]+ m?s p95 [\d.]+ m?s", text), text
    # and jobs show lists the failed job's attempt with its own error
    assert [(a["attempt"], a["outcome"]) for a in shown["attempts"]] == [(1, "rejected")]
    assert "order 0 has no lines" in shown["attempts"][0]["error"]


def test_the_operators_commands_know_the_applications_queues_before_any_worker_ran(subprocess_env, admin_url):
    from tests.support import db as testdb

    # Given a database just migrated: no job, no worker, no pause anywhere
    name = testdb.unique_name("smt_declared")
    with testdb.psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(testdb.sql.SQL("CREATE DATABASE {}").format(testdb.sql.Identifier(name)))
    try:
        env = {**subprocess_env, "DATABASE_URL": testdb.with_dbname(admin_url, name)}
        ok(cli(env, "migrate"))
        # When an operator pauses a queue the application declares, and checks the health
        paused = cli(env, "queues", "pause", "notify")
        check = cli(env, "status", "--check")
        # Then the queue is paused, and every declared queue is reported as served by nobody
        assert paused.returncode == 0 and "queue notify paused" in paused.stdout, paused.stderr
        assert check.returncode == 1
        for queue in ("index", "notify", "webhook", "fetch"):
            assert f"queue {queue}: no live worker process serves it" in check.stderr, check.stderr
        # and a queue the application no longer declares is forgotten at its next migrate
        testdb.query(env["DATABASE_URL"], "INSERT INTO standmeet.declared_queues (name) VALUES ('renamed-away')")
        ok(cli(env, "migrate"))
        assert "renamed-away" not in cli(env, "status", "--check").stderr
        assert testdb.scalar(env["DATABASE_URL"], "SELECT count(*) FROM standmeet.declared_queues"
                                                  " WHERE name = 'renamed-away'") == 0
    finally:
        testdb.drop_database(admin_url, name)


def test_retrying_a_named_unique_job_whose_key_a_live_message_holds_says_so_and_exits_1(
        broker, database_url, subprocess_env):
    import psycopg

    from broker import ops
    from tests.support import unique_jobs

    # Given a unique job an operator cancelled, and the same call sent again (it holds the key)
    first = unique_jobs.unique.send("named-and-held")
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert ops.cancel_jobs(conn, message_ids=[first.message_id], by="test") == 1
    unique_jobs.unique.send("named-and-held")
    # When the operator retries the cancelled one by its id
    result = cli(subprocess_env, "jobs", "retry", first.message_id)
    # Then it is left alone, said on stderr, and the command fails
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "retried 0 job(s)" in result.stdout
    assert "skipped 1 unique job(s): a live message holds each one's key" in result.stderr


def test_ctrl_c_during_a_slow_listing_says_interrupted_in_one_line_and_leaves_no_query_running(
        broker, database_url, subprocess_env):
    import signal

    import psycopg

    # Given a listing that waits for a table another session holds locked
    with psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE dramatiq.queue IN ACCESS EXCLUSIVE MODE")
        listing = subprocess.Popen([sys.executable, "-m", "broker.cli", "jobs", "list", "--search", "slow"],
                                   env=subprocess_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        try:
            wait_for(lambda: scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name ="
                                                  " 'standmeet-cli' AND wait_event_type = 'Lock'") == 1,
                     timeout_s=30, what="the listing to wait for the lock")
            # When the operator presses Ctrl-C
            listing.send_signal(signal.SIGINT)
            _, stderr = listing.communicate(timeout=30)
        finally:
            if listing.poll() is None:
                listing.kill()
                listing.wait()
        # Then it says so in one line, exits 130, and its query is gone from the server
        assert listing.returncode == 130, stderr
        assert stderr.strip().splitlines()[-1] == "standmeet-jobs: interrupted" and "Traceback" not in stderr, stderr
        assert scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'standmeet-cli'"
                                    " AND state = 'active'") == 0
