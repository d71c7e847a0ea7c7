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
from typing import NoReturn

from broker.budget import check_budget
from broker.embedded import resolve_database_url, stop_embedded
from broker.errors import ConfigError, StandmeetError
from broker.logging_setup import configure_logging, masked_url
from broker.migrate import migrate
from broker.settings import LOG_FORMATS, Settings

logger = logging.getLogger("standmeet")

#: Grace given to child processes beyond the worker shutdown timeout before SIGKILL.
CHILD_EXIT_GRACE_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format or _env_log_format(), level=logging.DEBUG if args.verbose else logging.INFO)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except StandmeetError as exc:
        print(f"standmeet-jobs: {exc}", file=sys.stderr)
        return 1


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line naming what was wrong (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="standmeet-jobs", description=__doc__.split("\n")[0])
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
    q = mail_sub.add_parser("test", help="send a test mail to ADDRESS through the notify queue")
    q.add_argument("address")
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
    q.add_argument("--secret", help="a whsec_… signing secret (default: a new one)")
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

    from broker import opscli

    opscli.add_commands(sub, wh)

    p = sub.add_parser("db", help="the database in use")
    p.add_argument("action", choices=["url", "stop"], help="print its URL, or stop the embedded server")
    p.set_defaults(func=cmd_db)
    return parser


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    url = resolve_database_url(settings)
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
    except json.JSONDecodeError as exc:
        print(f"standmeet-jobs: --payload is not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(payload, dict):
        print("standmeet-jobs: --payload must be a JSON object", file=sys.stderr)
        return 2
    import actors  # noqa: F401  (the routes and the broker)
    from broker.outbox import emit
    from broker.pgbroker import current_broker

    with psycopg.connect(current_broker().url) as conn, conn.transaction():
        event_id = emit(conn, args.topic, payload)
    print(event_id)
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"standmeet-jobs: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    title, _, body = text.partition("\n")
    import actors  # noqa: F401  (the broker and the actors)
    from actors.documents import write_document
    from broker.pgbroker import current_broker

    result = write_document(title.strip() or Path(args.file).stem, body, wait_s=args.wait_s)
    print(json.dumps(result))
    current_broker().close()
    return 0


def _actors() -> None:
    import actors  # noqa: F401  (configures the broker, declares actors and routes)


def cmd_mail_test(args: argparse.Namespace) -> int:
    _actors()
    from actors.mail import test_mail

    message = test_mail.send(args.address)
    print(f"queued test mail to {args.address} as job {message.message_id}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    import json

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


def cmd_sources_add(args: argparse.Namespace) -> int:
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
    _actors()
    from actors.webhooks import add_endpoint

    endpoint_id, secret = add_endpoint(args.url, [e.strip() for e in args.events.split(",") if e.strip()],
                                       secret=args.secret)
    print(endpoint_id if args.secret else f"{endpoint_id}\t{secret}")
    return 0


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
    logger.info("database: %s", masked_url(url))
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
    """Run the children until SIGTERM/SIGINT (forwarded as SIGTERM) or until one exits."""
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    children = [subprocess.Popen(cmd, env=env) for cmd in commands]
    for child, cmd in zip(children, commands, strict=True):
        logger.info("started pid %d: %s", child.pid, " ".join(cmd[1:]))
    code = 0
    try:
        while not stopping:
            exited = [c for c in children if c.poll() is not None]
            if exited:
                code = exited[0].returncode or 1
                logger.error("pid %d exited with %s; stopping the others", exited[0].pid, exited[0].returncode)
                break
            time.sleep(0.2)
        logger.info("stopping: SIGTERM to %s", ", ".join(str(c.pid) for c in children))
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + shutdown_s
        for child in children:
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
    return code


if __name__ == "__main__":
    sys.exit(main())
