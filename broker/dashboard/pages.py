"""The dashboard's pages and actions: one function per route (the job pages in
:mod:`.job_pages`); :func:`routes` adds those the applications declared (``broker.app.page``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import psycopg
import psycopg.errors
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from broker import ops
from broker.app import dashboard_pages
from broker.dashboard import charts
from broker.dashboard.app import (
    Refused,
    action_form,
    actor_of,
    config_of,
    guarded,
    json_response,
    redirect,
    render,
    row_id,
    text_filter,
    with_conn,
)
from broker.dashboard.job_pages import (
    job_cancel,
    job_page,
    job_retry,
    jobs_bulk,
    jobs_bulk_confirm,
    jobs_list,
    jobs_selected,
)
from broker.dashboard.security import quoted
from broker.observability.metrics import DatabaseCollector
from broker.ops import history


def routes() -> list[BaseRoute]:
    return [
        Route("/", overview, name="overview"),
        Route("/queues/{name}/pause", queue_pause, methods=["POST"]),
        Route("/queues/{name}/resume", queue_resume, methods=["POST"]),
        Route("/jobs", jobs_list, name="jobs"),
        Route("/jobs/bulk", jobs_bulk_confirm, methods=["GET"]),
        Route("/jobs/bulk", jobs_bulk, methods=["POST"]),
        Route("/jobs/selected", jobs_selected, methods=["POST"]),
        Route("/jobs/{id}", job_page, name="job"),
        Route("/jobs/{id}/retry", job_retry, methods=["POST"]),
        Route("/jobs/{id}/cancel", job_cancel, methods=["POST"]),
        Route("/history", history_page, name="history"),
        Route("/workers", workers_page, name="workers"),
        Route("/periodic", periodic_page, name="periodic"),
        Route("/outbox", outbox_page, name="outbox"),
        Route("/outbox/retry", outbox_retry, methods=["POST"]),
        Route("/healthz", healthz, name="healthz"),
        Route("/metrics", metrics, name="metrics"),
        # the applications' pages and actions (broker.app.page), answered as these are
        *(Route(p.path, guarded(p.handler), methods=list(p.methods)) for p in dashboard_pages()),
    ]


# -- overview and queues ---------------------------------------------------------------

@guarded
async def overview(request: Request) -> Response:
    config = config_of(request)

    def read(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        queues = {q.name: q for q in ops.queue_overview(conn, rescue_after_s=config.rescue_after_s)}
        for name in config.queues:
            queues.setdefault(name, ops.QueueStatus(name, 0, 0, 0, 0, 0, 0, None, False))
        workers = ops.worker_overview(conn, rescue_after_s=config.rescue_after_s)
        outbox = ops.outbox_overview(conn, rescue_after_s=config.rescue_after_s)
        # one statement for every queue's last hour, from the history (not dramatiq.queue)
        last_hour = history.series_by_queue(conn, since=ops.db_now(conn) - timedelta(hours=1), bucket_s=60)
        return {
            "queues": [queues[name] for name in sorted(queues)],
            "sparklines": {name: charts.sparkline(name, points) for name, points in last_hour.items()},
            "alive": sum(1 for w in workers if w.alive),
            "dead": sum(1 for w in workers if not w.alive),
            "outbox_lag_s": outbox.lag_s,
            "outbox": outbox,
            "actions": ops.recent_actions(conn, limit=10),
            "unique_skips": ops.unique_skips(conn, limit=10),
        }

    return render(request, "overview.html", await with_conn(request, read))


#: How many known queues a refusal of an unknown one lists.
KNOWN_QUEUES_LISTED = 20


def known_queue(conn: psycopg.Connection[Any], request: Request, name: str) -> None:
    """Refuse (404) a queue the runtime does not know: known are the declared ones and
    those ``ops.queue_overview`` lists (with messages, paused or served), as for
    ``standmeet-jobs queues pause``."""
    config = config_of(request)
    known = set(config.queues) | {q.name for q in ops.queue_overview(conn, rescue_after_s=config.rescue_after_s)}
    if name not in known:
        listed = sorted(known)
        more = f" and {len(listed) - KNOWN_QUEUES_LISTED} more" if len(listed) > KNOWN_QUEUES_LISTED else ""
        raise Refused(404, f"unknown queue {quoted(name)}; known: "
                           f"{', '.join(listed[:KNOWN_QUEUES_LISTED]) or 'none'}{more}")


async def _queue_action(request: Request, action: str) -> Response:
    await action_form(request)
    name = request.path_params["name"]
    by, source = actor_of(request)

    def act(conn: psycopg.Connection[Any]) -> bool:
        known_queue(conn, request, name)
        with conn.transaction():
            changed = ops.pause_queue(conn, name, by=by) if action == "pause" else ops.resume_queue(conn, name)
            ops.record_action(conn, action=f"queues.{action}", target={"queue": name}, by=by, source=source,
                              affected=int(changed))
        return changed

    changed = await with_conn(request, act)
    return redirect("/", ("paused" if action == "pause" else "resumed") if changed else "nothing")


@guarded
async def queue_pause(request: Request) -> Response:
    return await _queue_action(request, "pause")


@guarded
async def queue_resume(request: Request) -> Response:
    return await _queue_action(request, "resume")


# -- history ---------------------------------------------------------------------------

#: The windows the history page charts: how far back, and the width of a bucket.
HISTORY_WINDOWS: dict[str, tuple[timedelta, int]] = {
    "1h": (timedelta(hours=1), 60),
    "24h": (timedelta(hours=24), 900),
}
#: The words a window's charts say it in.
WINDOW_WORDS = {"1h": "hour", "24h": "24 hours"}


@guarded
async def history_page(request: Request) -> Response:
    """Charts of each queue's (or one queue's) history over the last hour or day: read
    from ``standmeet.queue_history`` in one statement, never from ``dramatiq.queue``."""
    config = config_of(request)
    window = request.query_params.get("window", "1h").strip() or "1h"
    if window not in HISTORY_WINDOWS:
        raise ops.OpsError(f"window must be one of {', '.join(HISTORY_WINDOWS)}, not {quoted(window)}")
    queue = text_filter("queue", request.query_params.get("queue", "")).strip() or None
    span, bucket_s = HISTORY_WINDOWS[window]

    def read(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        now = ops.db_now(conn)
        if queue is not None and queue not in config.queues:
            seen = {s.queue for s in history.summary(conn, since=now - timedelta(hours=24))}
            if queue not in seen:
                listed = sorted(seen | set(config.queues))
                more = f" and {len(listed) - KNOWN_QUEUES_LISTED} more" if len(listed) > KNOWN_QUEUES_LISTED else ""
                raise ops.OpsError(f"queue {quoted(queue)} is not declared and has no history in the last 24 hours; "
                                   f"known: {', '.join(listed[:KNOWN_QUEUES_LISTED]) or 'none'}{more}")
        series = history.series_by_queue(conn, since=now - span, bucket_s=bucket_s, queue=queue)
        return {"series": series, "now": now}

    data = await with_conn(request, read)
    words = WINDOW_WORDS[window]
    queues = [
        {"name": name, "anchor": f"history-{index}",
         "charts": charts.history_charts(name, points, bucket_s=bucket_s, window=words, chart_id=f"chart-{index}"),
         "totals": _totals(points)}
        for index, (name, points) in enumerate(sorted(data["series"].items()))
    ]
    quiet = sorted(set(config.queues) - set(data["series"])) if queue is None else []
    return render(request, "history.html", {
        "queue": queue, "window": window, "windows": list(HISTORY_WINDOWS), "window_words": words,
        "bucket_min": bucket_s // 60, "queues": queues, "quiet": quiet, "as_of": data["now"],
        "window_url": lambda w: "/history?" + urlencode({**({"queue": queue} if queue else {}), "window": w}),
    })


def _totals(points: list[history.SeriesPoint]) -> dict[str, int]:
    return {"done": sum(p.figures.done for p in points), "failures": sum(p.figures.failures for p in points),
            "rejected": sum(p.figures.rejected for p in points), "failed": sum(p.figures.failed for p in points),
            "crashed": sum(p.figures.crashed for p in points)}


# -- workers and periodic jobs ---------------------------------------------------------

@guarded
async def workers_page(request: Request) -> Response:
    config = config_of(request)
    workers = await with_conn(request, lambda conn: ops.worker_overview(conn, rescue_after_s=config.rescue_after_s))
    return render(request, "workers.html", {"workers": workers, "rescue_after_s": config.rescue_after_s})


@guarded
async def periodic_page(request: Request) -> Response:
    config = config_of(request)
    jobs = await with_conn(request, lambda conn: ops.periodic_overview(conn, config.periodic_jobs))
    return render(request, "periodic.html", {"periodic": jobs})


# -- the outbox ------------------------------------------------------------------------

#: Events listed on the outbox page (oldest first).
OUTBOX_PAGE_SIZE = 100


@guarded
async def outbox_page(request: Request) -> Response:
    """Topics no live process routes, failed events (with a retry), the relays."""
    config = config_of(request)
    state = request.query_params.get("state", "")
    if state not in ("", "failed"):
        raise ops.OpsError(f"state must be failed or absent, not {quoted(state)}")
    failed_only = state == "failed"
    topic = text_filter("topic", request.query_params.get("topic", "")).strip() or None

    def read(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        return {"outbox": ops.outbox_overview(conn, rescue_after_s=config.rescue_after_s),
                "events": ops.list_outbox_events(conn, failed=failed_only, topic=topic, limit=OUTBOX_PAGE_SIZE,
                                                 rescue_after_s=config.rescue_after_s)}

    return render(request, "outbox.html", {**await with_conn(request, read), "failed_only": failed_only,
                                           "topic": topic})


@guarded
async def outbox_retry(request: Request) -> Response:
    """Failed events back to the relays: one (``id``), or every failed one (of ``topic``)."""
    form = await action_form(request)
    raw_id = str(form.get("id") or "").strip()
    topic = text_filter("topic", str(form.get("topic") or "")).strip() or None
    ids = [row_id("id", ops.parse_event_id(raw_id))] if raw_id else None
    by, source = actor_of(request)

    def act(conn: psycopg.Connection[Any]) -> int:
        with conn.transaction():
            changed = ops.retry_outbox_events(conn, ids=ids, topic=topic)
            target: dict[str, Any] = {"event_ids": ids} if ids else {"failed": True, **({"topic": topic}
                                                                                       if topic else {})}
            ops.record_action(conn, action="outbox.retry", target=target, by=by, source=source, affected=changed)
        return changed

    changed = await with_conn(request, act)
    return redirect("/outbox", "relayed" if changed else "nothing")


# -- probes ----------------------------------------------------------------------------

#: Whether the database holds the runtime's schema (a database no `migrate` has touched
#: answers, yet no page can be served from it).
HEALTH_QUERY = "SELECT to_regclass('standmeet.schema_migrations') IS NOT NULL"
NO_SCHEMA = "the database has no standmeet schema: run `standmeet-jobs migrate`"


async def healthz(request: Request) -> Response:
    """200 when the database answers and holds the schema; 503 with the reason (one line)
    when it does not answer, or has no schema: a readiness probe then sends no request to
    a dashboard that could serve no page."""
    try:
        row = await with_conn(request, lambda conn: conn.execute(HEALTH_QUERY).fetchone())
    except Exception as exc:  # the probe reports any failure, it does not raise
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return json_response({"status": "unavailable", "database": reason}, status_code=503)
    if not row or not row[0]:
        return json_response({"status": "unavailable", "database": NO_SCHEMA}, status_code=503)
    return json_response({"status": "ok", "database": "ok"})


async def metrics(request: Request) -> Response:
    """The database-derived gauges of ``broker.observability.metrics`` (the ones ``run`` serves too)."""
    config = config_of(request)
    collector = DatabaseCollector(config.database_url, rescue_after_s=config.rescue_after_s)

    def scrape() -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        return generate_latest(registry)

    return Response(await run_in_threadpool(scrape), media_type=CONTENT_TYPE_LATEST)
