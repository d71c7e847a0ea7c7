"""This application's ``standmeet-jobs`` commands, declared through ``broker.app.command``.

The runtime's command line loads the application's modules (``actors`` by default) for
any command it does not own, and these declarations add: ``emit``, ``write``, ``mail
test``, ``search``, ``reindex``, ``sources``, ``fetch-new`` and ``webhooks``. Bad input
is one line naming what was wrong, exit status 1, checked before the database is touched.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from actors import settings as app_settings
from actors.secretbox import DEFAULT_RESEAL_BATCH
from actors.webhook_views import MAX_ROW_ID, PING_MOST
from broker import app, ops
from broker.boot import bounded_int
from broker.cli import output as cliout
from broker.cli.common import ascii_number
from broker.errors import StandmeetError
from broker.services import current_broker
from broker.settings import Settings

#: How long ``mail test`` waits for the outcome, and for the SMTP server to answer a probe.
MAIL_TEST_WAIT_S = 12.0
SMTP_PROBE_TIMEOUT_S = 5.0
#: ``search --limit`` bounds.
MAX_SEARCH_LIMIT = 1000
#: The longest a command waits for an outcome (``write --wait-s``, ``mail test --wait-s``):
#: the bound of STANDMEET_RECEIPT_WAIT_S.
MAX_WAIT_S = 3_600.0


def _usage(args: argparse.Namespace) -> int:
    print("standmeet-jobs: this command needs an action; see --help", file=sys.stderr)
    return 2


def cmd_emit(args: argparse.Namespace) -> int:
    import psycopg

    try:
        payload = json.loads(args.payload)
    except (json.JSONDecodeError, RecursionError) as exc:
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        print(f"standmeet-jobs: --payload is not JSON: {what}", file=sys.stderr)
        return 1
    except ValueError as exc:  # JSON, but a number Python refuses to read (an integer past its digit limit)
        limit = sys.get_int_max_str_digits()
        what = (f"it holds an integer of more than {limit} digits: give it as a string" if "limit" in str(exc)
                else (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        print(f"standmeet-jobs: --payload cannot be read: {what}", file=sys.stderr)
        return 1
    if not isinstance(payload, dict):
        print("standmeet-jobs: --payload must be a JSON object", file=sys.stderr)
        return 1
    from broker.outbox import check_payload

    check_payload(args.topic, payload)  # before any connection: bad input is named first
    _actors()
    from broker.outbox import emit
    from broker.services import current_broker

    with psycopg.connect(current_broker().url) as conn, conn.transaction():
        event_id = emit(conn, args.topic, payload)
    print(event_id)
    return 0


def _wait_s(option: str, value: float | None) -> float | None:
    """A wait option: finite, from 0 to MAX_WAIT_S seconds (None: the default)."""
    if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_WAIT_S):
        raise StandmeetError(f"{option} {value!r} must be a finite number of seconds from 0 to {MAX_WAIT_S:g}")
    return value


def cmd_write(args: argparse.Namespace) -> int:
    from pathlib import Path

    wait_s = _wait_s("--wait-s", args.wait_s)
    settings = app_settings.current()
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
    from broker.services import current_broker

    result = write_document(title.strip() or Path(args.file).stem, body, wait_s=wait_s)
    print(json.dumps(result), flush=True)  # the answer is out before the connections close
    current_broker().close()
    return 0


def _actors() -> None:
    """Check the database: reachable and migrated (one line naming the cause if not)."""
    from broker.pg.preflight import check_database

    check_database(current_broker().url)


MAIL_OUTCOME = """
SELECT "state"::text, error, message->'options'->>'traceback' FROM dramatiq.queue WHERE message_id = %s
"""


def cmd_mail_test(args: argparse.Namespace) -> int:
    import smtplib

    wait_s = _wait_s("--wait-s", args.wait_s)
    assert wait_s is not None
    settings = app_settings.current()
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
    from broker.pg import db

    message = test_mail.send(args.address)
    end = time.monotonic() + wait_s
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

    check_url(url, allowed_networks=app_settings.current().allowed_networks)


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

    events = [e.strip() for e in args.events.split(",") if e.strip()]
    endpoint_id, secret = add_endpoint(args.url, events, secret=given)
    added = {"id": endpoint_id, "url": args.url, "events": events,
             "secret": None if given else secret}  # a given secret is never echoed
    if args.json:
        print(json.dumps(added))
        return 0
    print(f"id: {endpoint_id}\nurl: {args.url}\nevents: {','.join(events)}")
    print(f"secret: {secret}" if not given else "secret: (as given; not shown)")
    return 0


def cmd_webhooks_rotate_secrets(args: argparse.Namespace) -> int:
    from actors.secretbox import reseal_all

    _actors()
    report = reseal_all(batch_size=args.batch_size,
                        on_unreadable=lambda where: print(f"standmeet-jobs: {where} cannot be decrypted by any key "
                                                          f"of {app_settings.VARIABLE}; left as it is",
                                                          file=sys.stderr, flush=True))
    print(f"re-encrypted {report.resealed} secret(s) with the first key of {app_settings.VARIABLE}; "
          f"{report.current} already were; {len(report.unreadable)} could not be decrypted")
    return 1 if report.unreadable else 0


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
    """Each endpoint, enabled or not, and why it fails: tab-separated fields, each printable on one line."""
    from actors.webhook_views import webhook_endpoints
    from broker.cli.output import printable

    with cliout.operator_connection(Settings.from_env()) as conn:
        endpoints = webhook_endpoints(conn)
    for e in endpoints:
        state = "enabled" if e.enabled else f"disabled ({printable(e.disabled_reason)})"
        why = printable(e.why_failing) if e.enabled and e.why_failing else None
        counts = f"\t{e.pending} pending, {e.failed} failed" if e.pending or e.failed else ""
        last = ""
        if e.last_outcome and e.last_outcome != "ok" and not why:
            last = f"\tlast attempt: {printable(e.last_outcome)}" + (f" HTTP {e.last_status}" if e.last_status else "") \
                + (f": {printable(e.last_error)}" if e.last_error else "")
        types = ",".join(printable(t) for t in e.event_types)
        print(f"{e.id}\t{printable(e.url)}\t{types}\t{state}" + (f"\t{why}" if why else "") + last + counts)
    return 0


#: The keys of ``webhooks deliveries --json`` (a contract for outside checks).
DELIVERY_KEYS = ("id", "endpoint_id", "event", "state", "attempts", "last_status", "last_error")


def cmd_webhooks_deliveries(args: argparse.Namespace) -> int:
    """Deliveries, newest first, with their event, state, attempts and last error."""
    from actors.webhook_views import webhook_deliveries
    from broker import ops

    with cliout.operator_connection(Settings.from_env()) as conn:
        deliveries = webhook_deliveries(conn, args.endpoint, limit=args.limit)
    if args.json:
        print(json.dumps([{**{k: getattr(d, k) for k in DELIVERY_KEYS}, "event_id": d.event_id,
                           "updated_at": ops.jsonable(d.updated_at)} for d in deliveries], indent=2))
        return 0
    cliout.print_table(("id", "endpoint", "event", "state", "attempts", "last status", "last error", "updated"),
                       [(d.id, d.endpoint_id, d.event, d.state, d.attempts,
                         "" if d.last_status is None else d.last_status, d.last_error or "", cliout.when(d.updated_at))
                        for d in deliveries])
    return 0


def cmd_webhooks_toggle(args: argparse.Namespace) -> int:
    _actors()
    from actors.webhooks import WebhookError, set_enabled_in
    from broker.pg import db

    by = cliout.operator_name()
    with db.connection() as conn, conn.transaction():  # recorded as the dashboard's button records it
        if not set_enabled_in(conn, args.id, args.enabled, reason=f"disabled by {by} (cli)"):
            raise WebhookError(f"no webhook endpoint {args.id}")
        ops.record_action(conn, action="webhooks.enable" if args.enabled else "webhooks.disable",
                          target={"endpoint_id": args.id}, by=by, source="cli", affected=1)
    print(f"endpoint {args.id} {'enabled' if args.enabled else 'disabled'}")
    return 0


def cmd_webhooks_replay(args: argparse.Namespace) -> int:

    _actors()
    from actors.webhooks import WebhookError, replay_failed, replay_in
    from broker.pg import db

    by = cliout.operator_name()
    if args.delivery is not None:
        with db.connection() as conn, conn.transaction():  # a new delivery message, recorded as the dashboard's
            message_id = replay_in(conn, args.delivery)
            if message_id is None:
                raise WebhookError(f"no webhook delivery {args.delivery}")
            ops.record_action(conn, action="webhooks.replay",
                              target={"delivery_id": args.delivery, "message_ids": [message_id]},
                              by=by, source="cli", affected=1)
        print(f"delivery {args.delivery} queued again")
    elif args.failed_since:
        try:  # an ISO time (UTC when it names no zone, as every time the CLI takes) or an age: 2h, 1d
            since = ops.parse_since(args.failed_since)
        except (ops.OpsError, OverflowError):
            print(f"standmeet-jobs: --failed-since {args.failed_since!r} is neither an ISO time nor an age like "
                  "15m, 2h or 1d", file=sys.stderr)
            return 2
        assert since is not None
        replayed = replay_failed(since)
        with db.connection() as conn, conn.transaction():
            ops.record_action(conn, action="webhooks.replay", target={"failed_since": since.isoformat()},
                              by=by, source="cli", affected=replayed)
        print(f"{replayed} delivery(ies) queued again")
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


def _setup_emit(p: argparse.ArgumentParser) -> None:
    p.add_argument("topic", help="the event's topic (see actors/routes.py)")
    p.add_argument("--payload", default="{}", help="the payload, a JSON object")
    p.set_defaults(func=cmd_emit)


def _setup_write(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a text file: its first line is the title, the rest the body")
    p.add_argument("--wait-s", type=float, default=None,
                   help=f"how long to wait for the index, 0 to {MAX_WAIT_S:g} (default: STANDMEET_RECEIPT_WAIT_S)")
    p.set_defaults(func=cmd_write)


def _setup_mail(p: argparse.ArgumentParser) -> None:
    mail_sub = p.add_subparsers(metavar="ACTION")
    q = mail_sub.add_parser("test", help="send a test mail to ADDRESS through the notify queue, wait for the outcome")
    q.add_argument("address")
    q.add_argument("--wait-s", type=float, default=MAIL_TEST_WAIT_S,
                   help=f"how long to wait for a worker to send it (default {MAIL_TEST_WAIT_S:g})")
    q.set_defaults(func=cmd_mail_test)


def _setup_search(p: argparse.ArgumentParser) -> None:
    p.add_argument("words", nargs="+")
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(func=cmd_search)


def _setup_reindex(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=cmd_reindex)


def _setup_sources(p: argparse.ArgumentParser) -> None:
    src_sub = p.add_subparsers(metavar="ACTION")
    q = src_sub.add_parser("add", help="register a job source (subject to the request-forgery guard)")
    q.add_argument("url")
    q.add_argument("--kind", choices=["json", "rss"], required=True)
    q.add_argument("--time-limit-s", type=float, default=60.0, help="this source's fetch time limit")
    q.set_defaults(func=cmd_sources_add)
    q = src_sub.add_parser("list", help="each source with its last fetch and error")
    q.set_defaults(func=cmd_sources_list)


def _setup_fetch_new(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=cmd_fetch_new)


def _setup_webhooks(p: argparse.ArgumentParser) -> None:
    wh = p.add_subparsers(metavar="ACTION")
    q = wh.add_parser("add", help="register an endpoint; prints its id, url, events (and its secret when generated)")
    q.add_argument("url")
    q.add_argument("--events", required=True, help="event types, comma-separated ('*' for all)")
    q.add_argument("--secret", help="a whsec_… signing secret, or - to read it from stdin (default: a new one)")
    q.add_argument("--secret-file", metavar="PATH", help="read the whsec_… signing secret from this file")
    q.add_argument("--json", action="store_true",
                   help='one JSON object: {"id", "url", "events", "secret"} (secret null when given)')
    q.set_defaults(func=cmd_webhooks_add)
    q = wh.add_parser("rotate-secrets", help="re-encrypt every stored secret with the first key of "
                      "STANDMEET_SECRET_KEY (idempotent); exits 1 naming any secret no key decrypts")
    q.add_argument("--batch-size", type=int, default=DEFAULT_RESEAL_BATCH, metavar="N",
                   help=f"endpoints re-encrypted per transaction (default {DEFAULT_RESEAL_BATCH})")
    q.set_defaults(func=cmd_webhooks_rotate_secrets)
    q = wh.add_parser("list", help="the endpoints, enabled or not, and why")
    q.set_defaults(func=cmd_webhooks_list)
    for action in ("disable", "enable"):
        q = wh.add_parser(action, help=f"{action} an endpoint")
        q.add_argument("id", type=int)
        q.set_defaults(func=cmd_webhooks_toggle, enabled=action == "enable")
    q = wh.add_parser("replay", help="deliver again: one delivery, or every failed one since a time")
    q.add_argument("delivery", type=int, nargs="?", help="a delivery id")
    q.add_argument("--failed-since", help="an ISO time (UTC unless it names a zone), e.g. 2026-11-29T10:00:00, "
                                          "or an age: 15m, 2h, 1d")
    q.set_defaults(func=cmd_webhooks_replay)
    q = wh.add_parser("ping", help="emit N webhook.ping events for an endpoint through the normal path")
    q.add_argument("id", type=int)
    q.add_argument("--count", type=ascii_number(bounded_int(low=1, high=PING_MOST)), default=1,
                   help=f"how many (1 to {PING_MOST})")
    q.set_defaults(func=cmd_webhooks_ping)
    q = wh.add_parser("deliveries", help="deliveries with their event, state, attempts and last error")
    q.add_argument("endpoint", type=ascii_number(bounded_int(low=1, high=MAX_ROW_ID)), nargs="?",
                   help="only this endpoint's")
    q.add_argument("--limit", type=ascii_number(bounded_int(low=1, high=ops.MAX_LIMIT)), default=100,
                   help=f"at most this many (1 to {ops.MAX_LIMIT}; default 100)")
    q.add_argument("--json", action="store_true", help="a JSON list")
    q.set_defaults(func=cmd_webhooks_deliveries)


app.command("emit", "emit one event through the outbox, in its own transaction; print its id", setup=_setup_emit, run=_usage)
app.command("write", "store a document, index it, wait for the index; print one JSON object", setup=_setup_write, run=_usage)
app.command("mail", "mail through the notify queue", setup=_setup_mail, run=_usage)
app.command("search", "query the search index (STANDMEET_SEARCH_BACKEND)", setup=_setup_search, run=_usage)
app.command("reindex", "enqueue a rebuild of the whole search index", setup=_setup_reindex, run=_usage)
app.command("sources", "job sources of the fetch queue", setup=_setup_sources, run=_usage)
app.command("fetch-new", "enqueue one fetch for every source with none pending (jobs.fetch_new)", setup=_setup_fetch_new, run=_usage)
app.command("webhooks", "webhook endpoints and deliveries", setup=_setup_webhooks, run=_usage)
