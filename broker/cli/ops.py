"""The operators' commands of ``standmeet-jobs``: status, jobs, queues, the outbox.

    standmeet-jobs status [--json] [--check [--max-age-s N] [--queues Q …]]
    standmeet-jobs jobs list [--state S] [--queue Q] [--actor A] [--since T] [--search TEXT] [--error TEXT] [--limit N] [--json]
    standmeet-jobs jobs show ID [--show-args] [--json]
    standmeet-jobs jobs retry ID … | jobs retry --state rejected [--queue Q] [--actor A] [--since T] [--error TEXT] [--include-cancelled]
    standmeet-jobs jobs cancel ID … | jobs cancel --queue Q [--state queued|delayed|running] [--actor A] [--error TEXT]
    standmeet-jobs queues list | pause Q | resume Q
    standmeet-jobs outbox list [--failed] [--topic T] [--limit N] [--json]
    standmeet-jobs outbox retry ID … | outbox retry --failed [--topic T]

A table by default (rich), ``--json`` for scripts. They read the database only (the
queries of :mod:`broker.ops`): they import neither the broker's consumers nor the
application. Every action is recorded in ``standmeet.operator_actions``. An
application's commands that show rows the same way use :mod:`broker.cli.output`.

What they print of a job, a queue, an actor or an event is printed as text:
never read as rich markup, control characters and direction overrides shown as escapes
(:func:`broker.cli.output.printable`). Wherever a job id is taken, a unique prefix of at least
:data:`broker.ops.MIN_ID_PREFIX_HEX` hex digits will do (``status`` prints 8). Every
number and age has a finite range, refused in one line naming the option (exit 2). Cancel
is final: a retry by filter leaves cancelled jobs alone unless ``--include-cancelled``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg

from broker import app, ops
from broker.boot import bounded_float, bounded_int
from broker.cli.common import ascii_digits, ascii_hex, ascii_number, filter_text
from broker.cli.output import (
    _age,
    _connect,
    _console,
    _error_text,
    _line,
    _row,
    _since,
    _table,
    _text,
    _when,
    operator_name,
)
from broker.errors import StandmeetError
from broker.ops import history
from broker.ops.redact import hidden_options
from broker.settings import MONTH_S, Settings

#: ``status --check`` fails when a queue's oldest due job has waited longer than this.
DEFAULT_MAX_AGE_S = 300.0
#: What ``status`` sums of the history: the last hour.
HISTORY_WINDOW = timedelta(hours=1)
#: The page sizes and offsets the commands take.
LIMIT = ascii_number(bounded_int(low=1, high=ops.MAX_LIMIT))
OFFSET = ascii_number(bounded_int(low=0, high=ops.MAX_OFFSET))


class UsageError(StandmeetError):
    """A command given wrong arguments (one line, exit 1)."""


def add_commands(sub: Any) -> None:
    """Add the operators' subcommands to ``standmeet-jobs`` (``sub``)."""
    p = sub.add_parser("status", help="queues, worker processes, periodic jobs and the outbox at a glance")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a due job waited too long, due work has no live worker "
                   "(STANDMEET_QUEUE_UNSERVED_MAX_AGE_S), a queue has no live worker, or outbox events no "
                   "live process routes waited too long (STANDMEET_OUTBOX_UNROUTED_MAX_AGE_S): health probes")
    p.add_argument("--max-age-s", type=ascii_number(bounded_float(low=0, high=MONTH_S)), default=DEFAULT_MAX_AGE_S,
                   help=f"with --check: the longest a due job may wait (default {DEFAULT_MAX_AGE_S:g})")
    p.add_argument("--queues", nargs="*",
                   help="with --check: the queues that need a live worker even with nothing due (default: the "
                   "declared ones); every queue with due work is checked whatever this says")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("jobs", help="list, show, retry and cancel jobs")
    jobs = p.add_subparsers(metavar="ACTION")
    q = jobs.add_parser("list", help="jobs, newest first")
    q.add_argument("--state", choices=ops.JOB_STATES)
    q.add_argument("--queue", type=filter_text)
    q.add_argument("--actor", type=filter_text)
    q.add_argument("--since", type=_since, help="enqueued since: an ISO time or an age (15m, 2h, 1d; at most 36500d)")
    q.add_argument("--search", type=filter_text, help="text in the job's arguments")
    q.add_argument("--error", type=_error_text, help="text in the job's error or last traceback (case-insensitive, "
                   f"at most {ops.MAX_ERROR_SEARCH_CHARS} characters; reads every job the other filters leave)")
    q.add_argument("--limit", type=LIMIT, default=50, help=f"at most this many (1 to {ops.MAX_LIMIT}; default 50)")
    q.add_argument("--offset", type=OFFSET, default=0, help=f"skip this many first (0 to {ops.MAX_OFFSET})")
    q.add_argument("--json", action="store_true", help="a JSON list")
    q.set_defaults(func=cmd_jobs_list)

    q = jobs.add_parser("show", help="one job: options, retries, error and traceback, timeline")
    q.add_argument("id", type=ascii_hex, help="the job's id, or a unique prefix of it (at least 8 hex digits)")
    q.add_argument("--show-args", action="store_true", help="show its arguments (hidden by default)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_jobs_show)

    q = jobs.add_parser("retry", help="send rejected jobs back to their queue, retries reset; cancelled ones "
                        "only when named by id or with --include-cancelled")
    q.add_argument("ids", nargs="*", metavar="ID", type=ascii_hex,
                   help="job ids, or unique prefixes of them (8+ hex digits)")
    q.add_argument("--state", choices=("rejected", "cancelled"), help="retry every job in this state …")
    q.add_argument("--queue", type=filter_text, help="… of this queue")
    q.add_argument("--actor", type=filter_text, help="… of this actor")
    q.add_argument("--since", type=_since, help="… enqueued since (an ISO time or an age: 15m, 2h, 1d)")
    q.add_argument("--error", type=_error_text, help="… whose error or last traceback contains this text")
    q.add_argument("--include-cancelled", action="store_true",
                   help="… cancelled ones included (cancel is final otherwise: they are skipped and counted)")
    q.set_defaults(func=cmd_jobs_retry)

    q = jobs.add_parser("cancel", help="a queued or delayed job never runs; a running one is not retried")
    q.add_argument("ids", nargs="*", metavar="ID", type=ascii_hex,
                   help="job ids, or unique prefixes of them (8+ hex digits)")
    q.add_argument("--state", choices=("queued", "delayed", "running"), help="cancel every job in this state …")
    q.add_argument("--queue", type=filter_text, help="… of this queue")
    q.add_argument("--actor", type=filter_text, help="… of this actor")
    q.add_argument("--since", type=_since, help="… enqueued since (an ISO time or an age)")
    q.add_argument("--error", type=_error_text, help="… whose error or last traceback contains this text")
    q.set_defaults(func=cmd_jobs_cancel)

    p = sub.add_parser("queues", help="list, pause and resume queues")
    queues = p.add_subparsers(metavar="ACTION")
    q = queues.add_parser("list", help="each queue's depth and whether it is paused")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_queues_list)
    q = queues.add_parser("pause", help="every process stops claiming from the queue (running jobs finish)")
    q.add_argument("queue")
    q.set_defaults(func=cmd_queues_pause)
    q = queues.add_parser("resume", help="every process claims from the queue again")
    q.add_argument("queue")
    q.set_defaults(func=cmd_queues_resume)

    p = sub.add_parser("outbox", help="events not relayed yet (pending, unrouted, failed); re-relay failed ones")
    outbox = p.add_subparsers(metavar="ACTION")
    q = outbox.add_parser("list", help="events not relayed, oldest first: pending, unrouted (no live process "
                          "routes their topic) or failed (with the reason)")
    q.add_argument("--failed", action="store_true", help="only failed events")
    q.add_argument("--topic", type=filter_text, help="only this topic's")
    q.add_argument("--limit", type=LIMIT, default=50, help=f"at most this many (1 to {ops.MAX_LIMIT}; default 50)")
    q.add_argument("--json", action="store_true", help="a JSON list")
    q.set_defaults(func=cmd_outbox_list)
    q = outbox.add_parser("retry", help="failed events back to pending: a relay that routes their topic "
                          "relays them again")
    q.add_argument("ids", nargs="*", metavar="ID", type=ascii_digits)
    q.add_argument("--failed", action="store_true", help="retry every failed event …")
    q.add_argument("--topic", type=filter_text, help="… of this topic")
    q.set_defaults(func=cmd_outbox_retry)


# -- status ------------------------------------------------------------------------------

def status_document(conn: psycopg.Connection[Any], settings: Settings) -> dict[str, Any]:
    """What ``status --json`` prints: queues (with their live workers), workers, periodic
    jobs, the outbox (its lag, failed events, topics no live process routes, relays)."""
    queues = ops.queue_overview(conn, rescue_after_s=settings.rescue_after_s)
    known = {q.name for q in queues}
    queues += [ops.QueueStatus(name, 0, 0, 0, 0, 0, 0, None, False) for name in settings.queues if name not in known]
    workers = ops.worker_overview(conn, rescue_after_s=settings.rescue_after_s)
    periodic = ops.periodic_overview(conn, app.periodic_jobs())
    outbox = ops.outbox_overview(conn, rescue_after_s=settings.rescue_after_s)
    now = ops.db_now(conn)
    last_hour = history.summary(conn, since=now - HISTORY_WINDOW, until=now)
    return {
        "queues": [ops.jsonable(q) for q in sorted(queues, key=lambda q: q.name)],
        "workers": [{**ops.jsonable(w), "running_jobs": [{"id": i, "actor": a} for i, a in w.running_jobs]}
                    for w in workers],
        "periodic": [ops.jsonable(p) for p in periodic],
        "unique_skips": [ops.jsonable(u) for u in ops.unique_skips(conn)],
        "outbox_lag_s": outbox.lag_s,
        "outbox": {**ops.jsonable(outbox), "routed_topics": outbox.routed_topics},
        "history": {"window_s": HISTORY_WINDOW.total_seconds(), "since": (now - HISTORY_WINDOW).isoformat(),
                    "queues": [s.as_json() for s in last_hour]},
    }


def health_problems(doc: dict[str, Any], *, max_age_s: float, required: Sequence[str],
                    unserved_max_age_s: float = 60.0, unrouted_max_age_s: float = 300.0) -> list[str]:
    """Why ``status --check`` fails: one line per problem (none: healthy). Every queue with
    due work is checked, whatever ``required`` says (the queues that need a live worker
    even with nothing due)."""
    problems = []
    unserved = set()
    for q in doc["queues"]:
        age = q["oldest_queued_age_s"]
        if q["unserved"] and age is not None and age > unserved_max_age_s:
            unserved.add(q["name"])
            problems.append(f"queue {q['name']}: {q['queued']} due job(s) and no live worker process serves it; "
                            f"the oldest has waited {age:.0f} s (more than {unserved_max_age_s:g} s)")
        elif age is not None and age > max_age_s and not q["paused"]:
            problems.append(f"queue {q['name']}: the oldest due job has waited {age:.0f} s (more than {max_age_s:g} s)")
    served = {name for w in doc["workers"] if w["alive"] for name in w["queues"]}
    for name in required:
        if name not in served and name not in unserved:
            problems.append(f"queue {name}: no live worker process serves it")
    for topic in doc["outbox"]["unrouted"]:
        if topic["oldest_age_s"] > unrouted_max_age_s:
            problems.append(f"outbox topic {topic['topic']}: {topic['events']} event(s) that no live process "
                            f"routes; the oldest has waited {topic['oldest_age_s']:.0f} s "
                            f"(more than {unrouted_max_age_s:g} s)")
    return problems


def cmd_status(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    with _connect(settings) as conn:
        doc = status_document(conn, settings)
        declared = sorted(set(settings.queues) | set(ops.declared_queues(conn))) if args.check else []
    problems = health_problems(doc, max_age_s=args.max_age_s, required=args.queues or declared,
                               unserved_max_age_s=settings.queue_unserved_max_age_s,
                               unrouted_max_age_s=settings.outbox_unrouted_max_age_s) if args.check else []
    if args.json:
        print(json.dumps({**doc, **({"problems": problems} if args.check else {})}, indent=2))
    else:
        _print_status(doc)
    if args.check:
        for problem in problems:
            print(f"unhealthy: {problem}", file=sys.stderr)
        if not args.json and not problems:
            print("healthy")
    return 1 if problems else 0


def _running(running: int, prefetched: int) -> str:
    """The running count, saying how many of them are claimed and not yet started."""
    return f"{running} ({prefetched} prefetched)" if prefetched else str(running)


def _print_status(doc: dict[str, Any]) -> None:
    out = _console()
    t = _table("queue", "queued", "delayed", "running", "rejected 24h", "done 5m", "done 1h", "oldest due",
               "workers", "paused")
    for q in doc["queues"]:
        _row(t, q["name"], q["queued"], q["delayed"], _running(q["running"], q["prefetched"]), q["rejected"],
             q["done_5m"], q["done_1h"], _age(q["oldest_queued_age_s"]),
             _serving(q), f"paused by {q['paused_by'] or '?'}" if q["paused"] else "")
    out.print(t)
    t = _table("worker", "host", "pid", "queues", "started", "heartbeat", "alive", "running")
    for w in doc["workers"]:
        jobs = ", ".join(f"{j['actor']} {j['id'][:8]}" for j in w["running_jobs"][:4])
        more = f" +{len(w['running_jobs']) - 4}" if len(w["running_jobs"]) > 4 else ""
        _row(t, w["id"][:8], w["host"], w["pid"], ",".join(w["queues"]), _when(w["started_at"]),
             _age(w["last_heartbeat_age_s"]) + " ago", "yes" if w["alive"] else "no",
             _running(w["running"], w["prefetched"]) + (f": {jobs}{more}" if jobs else ""))
    out.print(t)
    t = _table("periodic job", "schedule", "last run", "next due", "last state")
    for p in doc["periodic"]:
        _row(t, p["job"], p["schedule"] or "", _when(p["last_run"]), _when(p["next_due"]), p["last_state"] or "")
    out.print(t)
    for u in doc["unique_skips"]:
        _line(out, f"unique: {u['skipped']} send(s) of {u['actor']} ({u['queue']}) skipped, a live message held "
                   f"the key (last {_when(u['last_skipped_at'])})")
    lag = doc["outbox_lag_s"]
    _line(out, f"outbox: {'nothing waiting' if lag is None else 'oldest unrelayed event waited ' + _age(lag)}")
    outbox = doc["outbox"]
    for topic in outbox["unrouted"]:
        _line(out, f"outbox: {topic['events']} event(s) of topic {topic['topic']} that no live process routes "
                   f"(oldest {_age(topic['oldest_age_s'])})")
    if outbox["failed"]:
        _line(out, f"outbox: {outbox['failed']} failed event(s) (standmeet-jobs outbox list --failed; "
                   "outbox retry --failed)")
    live = [r for r in outbox["relays"] if r["alive"]]
    _line(out, f"relays: {len(live)} live, routing {', '.join(outbox['routed_topics']) or 'no topic'}")
    for h in doc["history"]["queues"]:
        _line(out, history_line(h))


def history_line(h: dict[str, Any]) -> str:
    """One queue's last hour, as ``status`` prints it."""
    return (f"last hour {h['name']}: {h['done']} done ({h['throughput_per_s']:g}/s), {h['failures']} failures; "
            f"wait p50 {_ms(h['wait_p50_ms'])} p95 {_ms(h['wait_p95_ms'])}; "
            f"run p50 {_ms(h['run_p50_ms'])} p95 {_ms(h['run_p95_ms'])}")


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} ms" if value < 10_000 else f"{value / 1000:.1f} s"


def _serving(q: dict[str, Any]) -> str:
    """How many live worker processes serve a queue, or "no worker"."""
    return "no worker" if q["no_worker"] else str(q["live_workers"])


# -- jobs --------------------------------------------------------------------------------

#: The keys of ``jobs list --json`` (a contract for outside checks).
JOB_LIST_KEYS = ("id", "queue", "actor", "state", "retries", "enqueued_at", "error")


def cmd_jobs_list(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    with _connect(settings) as conn:
        if args.queue:
            _known_queue(conn, settings, args.queue)
        jobs = ops.list_jobs(conn, state=args.state, queue=args.queue, actor=args.actor, since=args.since,
                             search=args.search, error=args.error, limit=args.limit, offset=args.offset)
    if args.json:
        print(json.dumps([{k: ops.jsonable(getattr(j, k)) for k in JOB_LIST_KEYS} for j in jobs], indent=2))
        return 0
    t = _table("id", "queue", "actor", "state", "retries", "enqueued", "error")
    for j in jobs:
        state = j.state + (" (cancelled)" if j.cancelled_at else "")
        _row(t, j.id, j.queue, j.actor, state, j.retries, _when(j.enqueued_at), j.error or "")
    _console().print(t)
    return 0


def cmd_jobs_show(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    with _connect(settings) as conn:
        message_id = ops.resolve_job_id(conn, args.id)
        job = ops.show_job(conn, message_id)
        attempts = history.attempts(conn, message_id)
    if job is None:
        raise UsageError(f"no job {message_id} (never enqueued, or pruned after the retention)")
    doc = ops.jsonable(job)
    doc["timeline"] = [{"event": name, "at": at.isoformat()} for name, at in job.timeline]
    doc["attempts"] = [a.as_json() for a in attempts]
    if not args.show_args:  # its own arguments, and those of every message its options carry
        doc.pop("args")
        doc.pop("kwargs")
        doc["options"] = hidden_options(doc["options"])
        doc["args_hidden"] = True
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    out = _console()
    t = _table("field", "value", title=f"job {job.id}")
    for key in ("queue", "actor", "state", "retries", "claims", "crashes", "snoozes"):
        _row(t, key, doc[key])
    if job.worker_id:
        _row(t, "worker", f"{job.worker_id[:8]} on {job.worker_host or '?'} pid {job.worker_pid or '?'}")
    for name, at in job.timeline:
        _row(t, name, at.isoformat(timespec="milliseconds"))
    if job.retried_by:
        _row(t, "retried by", job.retried_by)
    if job.cancelled_by:
        _row(t, "cancelled by", job.cancelled_by)
    _row(t, "options", json.dumps(doc["options"], sort_keys=True))
    if args.show_args:
        _row(t, "args", json.dumps(doc["args"]))
        _row(t, "kwargs", json.dumps(doc["kwargs"]))
    else:
        _row(t, "arguments", "hidden (--show-args)")
    if job.error and job.error != job.traceback:
        _row(t, "error", _text(job.error, lines=True))
    out.print(t)
    if attempts:
        t = _table("attempt", "outcome", "worker", "started", "ended", "run time", "error", title="attempts")
        for a in attempts:
            _row(t, a.attempt, a.outcome, (a.worker_id or "-")[:8], _when(a.started_at), _when(a.ended_at),
                 _ms(a.run_ms), (a.error or "").strip().splitlines()[-1] if (a.error or "").strip() else "")
        out.print(t)
    if job.traceback:
        out.print(_text(job.traceback, lines=True))
    return 0


def cmd_jobs_retry(args: argparse.Namespace) -> int:
    return _bulk(args, "retry")


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    return _bulk(args, "cancel")


def _bulk(args: argparse.Namespace, action: str) -> int:
    filters = {"state": args.state, "queue": args.queue, "actor": args.actor, "since": args.since,
               "error": args.error}
    include_cancelled = bool(getattr(args, "include_cancelled", False))
    if args.ids and any(filters.values()):
        raise UsageError(f"give job ids or filters to {action}, not both")
    if not args.ids:
        if action == "retry" and not args.state:
            raise UsageError("give job ids, or --state rejected (or cancelled) with optional --queue/--actor/--since")
        if action == "retry" and args.state == "cancelled" and not include_cancelled:
            raise UsageError("--state cancelled would retry cancelled jobs, and cancel is final: add "
                             "--include-cancelled to retry them, or name each by its id")
        if action == "cancel" and not (args.queue or args.actor):
            raise UsageError("give job ids, or --queue or --actor (with optional --state/--since/--error)")
    by = operator_name()
    settings = Settings.from_env()
    with _connect(settings) as conn, conn.transaction():
        ids = ops.resolve_job_ids(conn, args.ids) or None
        if args.queue:
            _known_queue(conn, settings, args.queue)
        skipped, cancelled_retried, held = 0, [], 0
        if action == "retry":
            outcome = ops.retry_jobs_outcome(conn, message_ids=ids, state=args.state, queue=args.queue,
                                             actor=args.actor, since=args.since, error=args.error,
                                             include_cancelled=True if include_cancelled else None, by=by)
            n, skipped, cancelled_retried = outcome.retried, outcome.skipped_cancelled, outcome.retried_cancelled
            held = outcome.skipped_unique
        else:
            n = ops.cancel_jobs(conn, message_ids=ids, state=args.state, queue=args.queue, actor=args.actor,
                                since=args.since, error=args.error, by=by)
        target: dict[str, Any] = {"message_ids": ids} if ids else {k: v for k, v in filters.items() if v}
        if include_cancelled and not ids:
            target["include_cancelled"] = True
        ops.record_action(conn, action=f"jobs.{action}", target=target, by=by, source="cli", affected=n)
        unchanged = _why_unchanged(conn, ids or [], action) if ids and n < len(ids) else []
    verb = "retried" if action == "retry" else "cancelled"
    print(f"{verb} {n} job(s)")
    why = "named by its id" if ids else "--include-cancelled"
    for message_id in cancelled_retried:
        print(f"job {message_id} had been cancelled: retried all the same ({why})")
    if skipped:
        print(f"skipped {skipped} cancelled job(s): cancel is final (--include-cancelled retries them too, "
              "or name each by its id)")
    if held:  # a job named by its id and left alone: what was asked was not done (exit 1)
        print(f"skipped {held} unique job(s): a live message holds each one's key (it runs instead)",
              file=sys.stderr if ids else sys.stdout)
    if action == "cancel" and ids:
        with _connect(settings) as conn:
            for message_id in ids:
                job = ops.show_job(conn, message_id)
                if job is not None and job.state == "running" and job.cancelled_at is not None:
                    print(f"job {message_id} is running: it will not be retried and stops at its next "
                          "deadline check")
    for line in unchanged:
        print(line, file=sys.stderr)
    return 1 if unchanged or (ids and held) else 0


def _why_unchanged(conn: psycopg.Connection[Any], ids: list[str], action: str) -> list[str]:
    lines = []
    for message_id in ids:
        job = ops.show_job(conn, message_id)
        if job is None:
            lines.append(f"no job {message_id}")
        elif action == "retry" and job.state != "rejected":
            lines.append(f"job {message_id} is {job.state}, not rejected: not retried")
        elif action == "cancel" and (job.state in ("done", "rejected") or job.cancelled_at is not None):
            lines.append(f"job {message_id} is {job.state}"
                         + (" and cancelled already" if job.cancelled_at else "") + ": not cancelled")
    return lines


# -- queues ------------------------------------------------------------------------------

def cmd_queues_list(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    with _connect(settings) as conn:
        queues = ops.queue_overview(conn, rescue_after_s=settings.rescue_after_s)
    if args.json:
        print(json.dumps([ops.jsonable(q) for q in queues], indent=2))
        return 0
    t = _table("queue", "queued", "delayed", "running", "workers", "paused")
    for q in queues:
        _row(t, q.name, q.queued, q.delayed, _running(q.running, q.prefetched), _serving(ops.jsonable(q)),
             f"since {_when(q.paused_at)} by {q.paused_by or '?'}" if q.paused else "")
    _console().print(t)
    return 0


def cmd_queues_pause(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    by = operator_name()
    with _connect(settings) as conn, conn.transaction():
        _known_queue(conn, settings, args.queue)
        changed = ops.pause_queue(conn, args.queue, by=by)
        ops.record_action(conn, action="queues.pause", target={"queue": args.queue}, by=by, source="cli",
                          affected=int(changed))
    print(f"queue {args.queue} paused" if changed else f"queue {args.queue} was paused already")
    return 0


def cmd_queues_resume(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    by = operator_name()
    with _connect(settings) as conn, conn.transaction():
        _known_queue(conn, settings, args.queue)
        changed = ops.resume_queue(conn, args.queue)
        ops.record_action(conn, action="queues.resume", target={"queue": args.queue}, by=by, source="cli",
                          affected=int(changed))
    print(f"queue {args.queue} resumed" if changed else f"queue {args.queue} was not paused")
    return 0


def _known_queue(conn: psycopg.Connection[Any], settings: Settings, name: str) -> None:
    """Refuse, naming the queues it knows (and the nearest), a queue that no declaration
    (the runtime's, or the application's as ``migrate`` recorded them), job (of any age),
    pause or live worker process names."""
    known = (set(settings.queues) | set(ops.declared_queues(conn))
             | {q.name for q in ops.queue_overview(conn, rescue_after_s=settings.rescue_after_s)})
    if name in known or ops.queue_has_jobs(conn, name):
        return
    near = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise UsageError(f"unknown queue {name!r}: no job, pause or worker process names it; {hint}"
                     f"known: {', '.join(sorted(known)) or 'none'}")


# -- the outbox --------------------------------------------------------------------------

#: The keys of ``outbox list --json`` (a contract for outside checks).
OUTBOX_EVENT_KEYS = ("id", "topic", "state", "created_at", "age_s", "error")


def cmd_outbox_list(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    with _connect(settings) as conn:
        events = ops.list_outbox_events(conn, failed=args.failed, topic=args.topic, limit=args.limit,
                                        rescue_after_s=settings.rescue_after_s)
    if args.json:
        print(json.dumps([{k: ops.jsonable(getattr(e, k)) for k in OUTBOX_EVENT_KEYS} for e in events], indent=2))
        return 0
    t = _table("id", "topic", "state", "created", "age", "error")
    for e in events:
        _row(t, e.id, e.topic, e.state, _when(e.created_at), _age(e.age_s), e.error or "")
    _console().print(t)
    return 0


def cmd_outbox_retry(args: argparse.Namespace) -> int:
    if args.ids and (args.failed or args.topic):
        raise UsageError("give event ids or --failed [--topic T] to retry, not both")
    if not args.ids and not args.failed:
        raise UsageError("give event ids, or --failed (with an optional --topic)")
    if args.topic and not args.failed:
        raise UsageError("--topic narrows --failed: give both")
    ids = [ops.parse_event_id(i) for i in args.ids] or None
    by = operator_name()
    settings = Settings.from_env()
    with _connect(settings) as conn, conn.transaction():
        before = ops.outbox_event_states(conn, ids) if ids else {}
        n = ops.retry_outbox_events(conn, ids=ids, topic=args.topic)
        target: dict[str, Any] = {"event_ids": ids} if ids else {"failed": True, **({"topic": args.topic}
                                                                                   if args.topic else {})}
        ops.record_action(conn, action="outbox.retry", target=target, by=by, source="cli", affected=n)
    unchanged = [f"no outbox event {i}" if i not in before else f"outbox event {i} is {before[i]}, not failed: "
                 "not retried" for i in ids or [] if before.get(i) != "failed"]
    print(f"retried {n} event(s)")
    for line in unchanged:
        print(line, file=sys.stderr)
    return 1 if unchanged else 0
