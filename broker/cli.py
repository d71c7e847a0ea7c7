"""``standmeet-jobs``: the operator's command line (a process entry point).

    standmeet-jobs migrate            create or update the schema (idempotent)
    standmeet-jobs check [--queues]   the start-up connection budget (R7); non-zero if over
    standmeet-jobs run                migrate, then run worker processes (python -m
                                      broker.worker) for every queue and the scheduler
                                      until Ctrl-C / SIGTERM
    standmeet-jobs emit / write       an event through the outbox; a document, waited for
    standmeet-jobs mail test ADDRESS  a test mail through the notify queue
    standmeet-jobs search WORDS | reindex
    standmeet-jobs sources add URL --kind json|rss | sources list | fetch-new
    standmeet-jobs dashboard          the web dashboard (loopback:8420 unless told)
    standmeet-jobs db url|stop        the database in use; stop the embedded server
    standmeet-jobs status | jobs … | queues …   what runs and what failed; retry, cancel,
                                      pause (see broker/opscli.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from broker.budget import check_budget
from broker.embedded import resolve_database_url, stop_embedded
from broker.errors import ConfigError, StandmeetError
from broker.logging_setup import configure_logging
from broker.migrate import migrate
from broker.settings import LOG_FORMATS, Settings

logger = logging.getLogger("standmeet")

#: Grace given to child processes beyond the worker shutdown timeout before SIGKILL.
CHILD_EXIT_GRACE_S = 5.0
#: A second Ctrl-C forces the exit only this long after the first signal.
FORCE_AFTER_S = 1.0
#: A crashed child is restarted after a back-off that doubles (reset once it ran a while).
RESTART_MIN_BACKOFF_S = 1.0
RESTART_MAX_BACKOFF_S = 30.0
RESTART_RESET_AFTER_S = 60.0
#: How long ``mail test`` waits for the outcome, and for the SMTP server to answer a probe.
MAIL_TEST_WAIT_S = 12.0
SMTP_PROBE_TIMEOUT_S = 5.0
#: ``search --limit`` bounds.
MAX_SEARCH_LIMIT = 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format or _env_log_format(), level=logging.DEBUG if args.verbose else logging.INFO)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    os.environ.setdefault("PGCONNECT_TIMEOUT", "5")  # libpq: an unreachable server answers in seconds
    try:
        return int(args.func(args) or 0)
    except StandmeetError as exc:
        print(f"standmeet-jobs: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a database error past the preflight: one line, no traceback
        import psycopg

        if not isinstance(exc, psycopg.Error):
            raise
        from broker.preflight import first_line

        print(f"standmeet-jobs: database error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="standmeet-jobs", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help="text (default) or json, one object a line (also STANDMEET_LOG_FORMAT)")
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("migrate", help="create or update the database schema")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("check", help="check the connection budget (R7); exit 1 when over")
    p.add_argument("--queues", nargs="*", help="queues this process would serve (default: all)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("run", help="migrate, then run the workers and the scheduler")
    p.add_argument("--queues", nargs="*", help="queues to serve (default: all)")
    p.add_argument("--processes", type=int, default=1, help="worker processes (default 1)")
    p.add_argument(
        "--threads", type=int, default=0,
        help="threads per worker process (default: the sum of the served queues' limits)",
    )
    p.add_argument(
        "--worker-shutdown-timeout", type=int, default=None, metavar="MS",
        help="how long a worker waits for running jobs on SIGTERM, in milliseconds "
        "(default: STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S, 20 s)",
    )
    p.add_argument("--no-scheduler", action="store_true", help="do not start the scheduler process")
    p.add_argument("--module", action="append", dest="modules", metavar="MODULE",
                   help="a module declaring actors, for the workers to import (repeatable; default: actors)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS,
                   help="text or json, for this process and its children")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("emit", help="emit one event through the outbox, in its own transaction; print its id")
    p.add_argument("topic", help="the event's topic (see actors/routes.py)")
    p.add_argument("--payload", default="{}", help="the payload, a JSON object")
    p.set_defaults(func=cmd_emit)

    p = sub.add_parser("write", help="store a document, index it, wait for the index; print one JSON object")
    p.add_argument("file", help="a text file: its first line is the title, the rest the body")
    p.add_argument("--wait-s", type=float, default=None, help="how long to wait for the index (default 2)")
    p.set_defaults(func=cmd_write)

    p = sub.add_parser("mail", help="mail through the notify queue")
    mail_sub = p.add_subparsers(metavar="ACTION")
    q = mail_sub.add_parser("test", help="send a test mail to ADDRESS through the notify queue, wait for the outcome")
    q.add_argument("address")
    q.add_argument("--wait-s", type=float, default=MAIL_TEST_WAIT_S,
                   help=f"how long to wait for a worker to send it (default {MAIL_TEST_WAIT_S:g})")
    q.set_defaults(func=cmd_mail_test)

    p = sub.add_parser("search", help="query the search index (STANDMEET_SEARCH_BACKEND)")
    p.add_argument("words", nargs="+")
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("reindex", help="enqueue a rebuild of the whole search index")
    p.set_defaults(func=cmd_reindex)

    p = sub.add_parser("sources", help="job sources of the fetch queue")
    src_sub = p.add_subparsers(metavar="ACTION")
    q = src_sub.add_parser("add", help="register a job source (subject to the request-forgery guard)")
    q.add_argument("url")
    q.add_argument("--kind", choices=["json", "rss"], required=True)
    q.add_argument("--time-limit-s", type=float, default=60.0, help="this source's fetch time limit")
    q.set_defaults(func=cmd_sources_add)
    q = src_sub.add_parser("list", help="each source with its last fetch and error")
    q.set_defaults(func=cmd_sources_list)

    p = sub.add_parser("fetch-new", help="enqueue one fetch for every source with none pending (jobs.fetch_new)")
    p.set_defaults(func=cmd_fetch_new)

    p = sub.add_parser("webhooks", help="webhook endpoints and deliveries")
    wh = p.add_subparsers(metavar="ACTION")
    q = wh.add_parser("add", help="register an endpoint; prints its id (and its secret when generated)")
    q.add_argument("url")
    q.add_argument("--events", required=True, help="event types, comma-separated ('*' for all)")
    q.add_argument("--secret", help="a whsec_… signing secret, or - to read it from stdin (default: a new one)")
    q.add_argument("--secret-file", metavar="PATH", help="read the whsec_… signing secret from this file")
    q.set_defaults(func=cmd_webhooks_add)
    q = wh.add_parser("list", help="the endpoints, enabled or not, and why")
    q.set_defaults(func=cmd_webhooks_list)
    for action in ("disable", "enable"):
        q = wh.add_parser(action, help=f"{action} an endpoint")
        q.add_argument("id", type=int)
        q.set_defaults(func=cmd_webhooks_toggle, enabled=action == "enable")
    q = wh.add_parser("replay", help="deliver again: one delivery, or every failed one since a time")
    q.add_argument("delivery", type=int, nargs="?", help="a delivery id")
    q.add_argument("--failed-since", help="an ISO time, e.g. 2026-11-29T10:00:00+00:00")
    q.set_defaults(func=cmd_webhooks_replay)
    q = wh.add_parser("ping", help="emit N webhook.ping events for an endpoint through the normal path")
    q.add_argument("id", type=int)
    q.add_argument("--count", type=int, default=1)
    q.set_defaults(func=cmd_webhooks_ping)

    p = sub.add_parser("dashboard", help="serve the web dashboard (see and steer the jobs in a browser)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; others need STANDMEET_DASHBOARD_PASSWORD)")
    p.add_argument("--port", type=int, default=8420, help="port (default 8420)")
    p.add_argument("--read-only", action="store_true", help="show everything, change nothing")
    p.set_defaults(func=cmd_dashboard)

    from broker import opscli

    opscli.add_commands(sub, wh)

    p = sub.add_parser("db", help="the database in use")
    p.add_argument("action", choices=["url", "stop"], help="print its URL, or stop the embedded server")
    p.set_defaults(func=cmd_db)
    return parser


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    url = resolve_database_url(settings)
    from broker import log_database

    log_database(settings, url)
    applied = migrate(url)
    if applied:
        for m in applied:
            print(f"applied {m.version:04d}_{m.name}")
    else:
        print("schema up to date")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    budget = check_budget(settings, args.queues or None)
    print(f"ok: {budget.describe()}")
    print(f"broker pool: {budget.broker_pool_size} connections for {budget.consumers} consumers and acks")
    return 0


def cmd_emit(args: argparse.Namespace) -> int:
    import json

    import psycopg

    try:
        payload = json.loads(args.payload)
    except (json.JSONDecodeError, RecursionError) as exc:
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        print(f"standmeet-jobs: --payload is not JSON: {what}", file=sys.stderr)
        return 1
    if not isinstance(payload, dict):
        print("standmeet-jobs: --payload must be a JSON object", file=sys.stderr)
        return 1
    from broker.outbox import check_payload

    check_payload(args.topic, payload)  # before any connection: bad input is named first
    _actors()
    from broker.outbox import emit
    from broker.pgbroker import current_broker

    with psycopg.connect(current_broker().url) as conn, conn.transaction():
        event_id = emit(conn, args.topic, payload)
    print(event_id)
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    settings = Settings.from_env()
    try:
        size = Path(args.file).stat().st_size
        if size > settings.document_max_bytes:  # refused before reading it all
            print(f"standmeet-jobs: {args.file} is {size} bytes, over the limit of {settings.document_max_bytes} "
                  "(STANDMEET_DOCUMENT_MAX_BYTES)", file=sys.stderr)
            return 1
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"standmeet-jobs: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    title, _, body = text.partition("\n")
    from actors.documents import check_document

    check_document(title, body, max_bytes=settings.document_max_bytes)
    _actors()
    from actors.documents import write_document
    from broker.pgbroker import current_broker

    result = write_document(title.strip() or Path(args.file).stem, body, wait_s=args.wait_s)
    print(json.dumps(result))
    current_broker().close()
    return 0


def _actors() -> None:
    """Check the database (reachable, migrated: one line if not), then configure the broker."""
    from broker.preflight import check_database

    check_database(resolve_database_url(Settings.from_env()))
    import actors  # noqa: F401  (configures the broker, declares actors and routes)


MAIL_OUTCOME = """
SELECT "state"::text, error, message->'options'->>'traceback' FROM dramatiq.queue WHERE message_id = %s
"""


def cmd_mail_test(args: argparse.Namespace) -> int:
    import smtplib

    settings = Settings.from_env()
    server = f"{settings.smtp_host}:{settings.smtp_port}"
    try:  # the server first: an unreachable one is named at once, worker or not
        with smtplib.SMTP(settings.smtp_host, settings.smtp_port,
                          timeout=min(SMTP_PROBE_TIMEOUT_S, settings.smtp_timeout_s)) as smtp:
            smtp.noop()
    except (OSError, smtplib.SMTPException) as exc:
        print(f"standmeet-jobs: cannot reach the SMTP server {server} (STANDMEET_SMTP_HOST, STANDMEET_SMTP_PORT): "
              f"{exc or type(exc).__name__}", file=sys.stderr)
        return 1
    _actors()
    from actors.mail import test_mail
    from broker import db

    message = test_mail.send(args.address)
    end = time.monotonic() + max(0.0, args.wait_s)
    while True:
        with db.connection() as conn:
            row = conn.execute(MAIL_OUTCOME, (message.message_id,)).fetchone()
        state, error, traceback = row if row else (None, None, None)
        if state == "done":
            print(f"sent test mail to {args.address} through {server} (job {message.message_id})")
            return 0
        if state == "rejected" or traceback:
            reason = (traceback or error or "failed").strip().splitlines()[-1]
            print(f"standmeet-jobs: the test mail to {args.address} through {server} failed: {reason}",
                  file=sys.stderr)
            return 1
        if time.monotonic() >= end:
            print(f"standmeet-jobs: no worker sent the test mail within {args.wait_s:g} s (job {message.message_id} "
                  "is still queued): is `standmeet-jobs run` running?", file=sys.stderr)
            return 1
        time.sleep(0.05)


def cmd_search(args: argparse.Namespace) -> int:
    import json

    if not 1 <= args.limit <= MAX_SEARCH_LIMIT:
        print(f"standmeet-jobs: --limit must be from 1 to {MAX_SEARCH_LIMIT}, not {args.limit}", file=sys.stderr)
        return 1
    _actors()
    from actors.search import search_index

    for hit in search_index().search(" ".join(args.words), limit=args.limit):
        print(json.dumps({"id": hit.document_id, "title": hit.title, "rank": round(hit.rank, 4)}))
    return 0


def cmd_reindex(args: argparse.Namespace) -> int:
    _actors()
    from actors.corpus import reindex

    message = reindex.send()
    print(f"queued a rebuild of the index as job {message.message_id}")
    return 0


def _check_url_first(url: str) -> None:
    """Refuse a forbidden URL before touching the database (the guard runs again at add)."""
    from actors.netguard import check_url

    check_url(url, allowed_networks=Settings.from_env().allowed_networks)


def cmd_sources_add(args: argparse.Namespace) -> int:
    from actors.jobboards import check_time_limit

    check_time_limit(args.time_limit_s)
    _check_url_first(args.url)
    _actors()
    from actors.jobboards import add_source

    print(add_source(args.url, args.kind, time_limit_s=args.time_limit_s))
    return 0


def cmd_sources_list(args: argparse.Namespace) -> int:
    _actors()
    from actors.jobboards import list_sources

    for src in list_sources():
        fetched = src["last_fetch_at"].isoformat(timespec="seconds") if src["last_fetch_at"] else "never"
        print(f"{src['id']}\t{src['kind']}\t{src['url']}\tlast fetch {fetched}: {src['last_status'] or '-'}"
              f"\t{src['postings']} posting(s)" + (f"\terror: {src['last_error']}" if src["last_error"] else ""))
    return 0


def cmd_fetch_new(args: argparse.Namespace) -> int:
    _actors()
    from actors.jobboards import fetch_new

    print(f"queued {fetch_new()} fetch(es)")
    return 0


def cmd_webhooks_add(args: argparse.Namespace) -> int:
    given = _given_secret(args)
    _check_url_first(args.url)
    if given is not None:
        from actors.webhooks import check_new_secret

        check_new_secret(given)
    _actors()
    from actors.webhooks import add_endpoint

    endpoint_id, secret = add_endpoint(args.url, [e.strip() for e in args.events.split(",") if e.strip()],
                                       secret=given)
    print(endpoint_id if given else f"{endpoint_id}\t{secret}")
    return 0


def _given_secret(args: argparse.Namespace) -> str | None:
    """The secret from --secret-file, stdin (--secret -) or --secret; never echoed."""
    from pathlib import Path

    if args.secret is not None and args.secret_file is not None:
        raise StandmeetError("give --secret or --secret-file, not both")
    if args.secret_file is not None:
        try:
            return Path(args.secret_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise StandmeetError(f"cannot read the secret file {args.secret_file}: {exc.__class__.__name__}") from None
    if args.secret == "-":
        return sys.stdin.readline().strip()
    return args.secret


def cmd_webhooks_list(args: argparse.Namespace) -> int:
    from broker.opscli import print_endpoints

    print_endpoints(Settings.from_env())
    return 0


def cmd_webhooks_toggle(args: argparse.Namespace) -> int:
    _actors()
    from actors.webhooks import set_enabled

    set_enabled(args.id, args.enabled)
    print(f"endpoint {args.id} {'enabled' if args.enabled else 'disabled'}")
    return 0


def cmd_webhooks_replay(args: argparse.Namespace) -> int:
    from datetime import datetime

    _actors()
    from actors.webhooks import replay, replay_failed

    if args.delivery is not None:
        replay(args.delivery)
        print(f"delivery {args.delivery} queued again")
    elif args.failed_since:
        try:
            since = datetime.fromisoformat(args.failed_since)
        except ValueError:
            print(f"standmeet-jobs: --failed-since {args.failed_since!r} is not an ISO time", file=sys.stderr)
            return 2
        print(f"{replay_failed(since)} delivery(ies) queued again")
    else:
        print("standmeet-jobs: give a delivery id or --failed-since TIME", file=sys.stderr)
        return 2
    return 0


def cmd_webhooks_ping(args: argparse.Namespace) -> int:
    _actors()
    from actors.webhooks import ping

    events = ping(args.id, args.count)
    print(f"emitted {len(events)} webhook.ping event(s) for endpoint {args.id}")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from broker.dashboard import serve
    from broker.dashboard.security import check_bind

    settings = Settings.from_env()
    check_bind(args.host, settings.dashboard_password)  # before touching the database
    serve(settings, resolve_database_url(settings), host=args.host, port=args.port, read_only=args.read_only)
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    if args.action == "url":
        print(resolve_database_url(settings))
    elif stop_embedded(settings):
        print("embedded Postgres stopped")
    else:
        print("no embedded Postgres is running in", settings.embedded_dir)
    return 0


def _env_log_format() -> str:
    try:
        return Settings.from_env().log_format
    except ConfigError:
        return "text"  # the command reports the malformed setting itself


def cmd_run(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    queues = args.queues or list(settings.queues)
    budget = check_budget(settings, queues)
    url = resolve_database_url(settings)
    from broker import log_database

    log_database(settings, url)
    if not migrate(url):  # each migration applied logs its own line
        logger.info("schema up to date")
    logger.info("connection budget: %s", budget.describe())

    shutdown_ms = args.worker_shutdown_timeout
    if shutdown_ms is None:
        shutdown_ms = int(settings.worker_shutdown_timeout_s * 1000)
    threads = args.threads or sum(settings.queue(q).max_workers for q in queues)
    log_format = getattr(args, "log_format", None) or settings.log_format
    env = {**os.environ, "DATABASE_URL": url, "STANDMEET_LOG_FORMAT": log_format}
    worker = [
        sys.executable, "-m", "broker.worker", *(args.modules or []),
        "--threads", str(threads),
        "--worker-shutdown-timeout", str(shutdown_ms),
        *(["--queues", *queues] if args.queues else []),
    ]
    commands = [worker for _ in range(max(1, args.processes))]
    if not args.no_scheduler and importlib.util.find_spec("periodic.__main__") is not None:
        commands.append([sys.executable, "-m", "periodic"])
    with serving_metrics(settings, url, env):
        return supervise(commands, env=env, shutdown_s=shutdown_ms / 1000 + CHILD_EXIT_GRACE_S)


@contextmanager
def serving_metrics(settings: Settings, url: str, env: dict[str, str]) -> Iterator[None]:
    """With STANDMEET_METRICS_PORT: one /metrics for every child (prometheus_client's
    multiprocess mode, in a folder made here and removed after), plus the database
    gauges, computed here once per scrape."""
    if settings.metrics_port is None:
        yield
        return
    import shutil
    import tempfile

    from broker.metrics import registry_for, serve

    folder = tempfile.mkdtemp(prefix="standmeet-metrics-")
    env["PROMETHEUS_MULTIPROC_DIR"] = folder
    registry = registry_for(url, multiprocess_dir=folder, rescue_after_s=settings.rescue_after_s)
    try:
        server = serve(registry, settings.metrics_host, settings.metrics_port)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                          f"{exc.strerror or exc}") from exc
    logger.info("metrics: http://%s:%d/metrics", settings.metrics_host, server.port)
    try:
        yield
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _child_exited(pid: int, env: dict[str, str]) -> None:
    """A child is gone: its live gauges (jobs in progress) no longer count."""
    folder = env.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, folder)


def supervise(commands: list[list[str]], *, env: dict[str, str], shutdown_s: float) -> int:
    """Run the children until SIGTERM/SIGINT, restarting one that dies (with back-off).

    The first signal is forwarded as SIGTERM: each child gets its full shutdown timeout
    (a Ctrl-C also reaches them directly, through the process group; they wait all the
    same). A deliberate second Ctrl-C more than a second later forwards SIGINT, which
    makes them exit at once, and `run` exits 1.
    """
    first_signal_at: list[float] = []
    forced: list[bool] = []
    children: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, frame: object) -> None:
        now = time.monotonic()
        if not first_signal_at:
            first_signal_at.append(now)
            return
        if signum == signal.SIGINT and now - first_signal_at[0] > FORCE_AFTER_S and not forced:
            forced.append(True)
            logger.warning("second Ctrl-C: forcing the workers to exit now; running jobs are cut off")
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGINT)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    children.extend(subprocess.Popen(cmd, env=env) for cmd in commands)
    for child, cmd in zip(children, commands, strict=True):
        logger.info("started pid %d: %s", child.pid, " ".join(cmd[1:]))
    started_at = [time.monotonic()] * len(children)
    restart_at: list[float | None] = [None] * len(children)
    backoff = [RESTART_MIN_BACKOFF_S] * len(children)
    try:
        while not first_signal_at:
            now = time.monotonic()
            for n, child in enumerate(children):
                if restart_at[n] is None and child.poll() is not None:
                    ran = now - started_at[n]
                    if ran > RESTART_RESET_AFTER_S:
                        backoff[n] = RESTART_MIN_BACKOFF_S
                    logger.error("pid %d (%s) exited with %s after %.1f s; restarting it in %.1f s",
                                 child.pid, " ".join(commands[n][1:3]), child.returncode, ran, backoff[n])
                    restart_at[n] = now + backoff[n]
                    backoff[n] = min(backoff[n] * 2, RESTART_MAX_BACKOFF_S)
                due = restart_at[n]
                if due is not None and now >= due:
                    children[n] = subprocess.Popen(commands[n], env=env)
                    started_at[n], restart_at[n] = now, None
                    logger.info("restarted pid %d: %s", children[n].pid, " ".join(commands[n][1:]))
            time.sleep(0.2)
        alive = [c for c in children if c.poll() is None]
        logger.info("stopping: SIGTERM to %s; running jobs get up to %.0f s",
                    ", ".join(str(c.pid) for c in alive) or "none", shutdown_s - CHILD_EXIT_GRACE_S)
        for child in alive:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + shutdown_s
        for child in alive:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("pid %d did not stop in time; killing it", child.pid)
                child.kill()
                child.wait()
            _child_exited(child.pid, env)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 1 if forced else 0


if __name__ == "__main__":
    sys.exit(main())
