"""The dashboard's job pages and actions: the list and its filters, one job, retry and
cancel (one, selected, or every match of the filters)."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import urlencode

import psycopg
import psycopg.errors
from starlette.requests import Request
from starlette.responses import Response

from broker import ops
from broker.dashboard.app import (
    BULK_LIMIT,
    JOB_STATES,
    MAX_PAGE,
    PAGE_SIZE,
    Refused,
    action_form,
    actor_of,
    config_of,
    guarded,
    redirect,
    render,
    since_filter,
    text_filter,
    whole_number,
    with_conn,
)
from broker.dashboard.security import quoted
from broker.ops import history
from broker.ops.redact import hidden_options

#: The list filters, as query parameters (``id``: a job id or its start; ``q``: text
#: in the arguments; ``error``: text in the error or the last traceback; ``since``: an
#: ISO time or an age like 15m).
FILTER_PARAMS = ("state", "queue", "actor", "id", "q", "error", "since")
#: States a bulk cancel applies to: jobs not finished (a bulk retry takes rejected jobs,
#: never cancelled ones: cancel is final).
CANCELLABLE = ("queued", "delayed", "running")


# -- jobs ------------------------------------------------------------------------------

def filters_of(request: Request, *, hide_args: bool) -> dict[str, str]:
    """The filters in the query string, blanks dropped (and the search in the arguments
    when they are hidden: ignored, and neither echoed nor carried into a bulk action)."""
    return visible_filters({k: request.query_params.get(k, "") for k in FILTER_PARAMS}, hide_args=hide_args)


def visible_filters(raw: dict[str, str], *, hide_args: bool) -> dict[str, str]:
    return {k: v.strip() for k, v in raw.items() if v.strip() and not (hide_args and k == "q")}


def ops_filters(filters: dict[str, str], *, hide_args: bool) -> dict[str, Any]:
    """The filters as ``broker.ops`` keywords, each checked (``ops.OpsError`` naming the
    one out of range); no search in arguments when they are hidden."""
    for name, value in filters.items():
        text_filter(name, value)
    if hide_args and filters.get("q"):
        raise ops.OpsError("q: searching the arguments is off on this dashboard (STANDMEET_DASHBOARD_HIDE_ARGS=1)")
    since = filters.get("since")
    return {
        "state": filters.get("state"), "queue": filters.get("queue"), "actor": filters.get("actor"),
        # checked here; an age is judged by the database's clock (ops.job_filters)
        "message_id": filters.get("id"), "since": since if since and since_filter(since) else None,
        "search": None if hide_args else filters.get("q"), "error": filters.get("error"),
    }


def page_of(request: Request) -> int:
    raw = request.query_params.get("page", "").strip()
    return whole_number("page", raw, low=1, high=MAX_PAGE) if raw else 1


@guarded
async def jobs_list(request: Request) -> Response:
    config = config_of(request)
    filters = filters_of(request, hide_args=config.hide_args)
    page = page_of(request)
    try:
        kwargs: dict[str, Any] | None = ops_filters(filters, hide_args=config.hide_args)
        filter_error = None
    except ops.OpsError as exc:  # said above the form, which keeps what was typed
        kwargs, filter_error = None, str(exc)

    def read(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        queues = sorted({q.name for q in ops.queue_overview(conn, rescue_after_s=config.rescue_after_s)}
                        | set(config.queues))
        if kwargs is None:
            return {"total": 0, "jobs": [], "queue_names": queues, "filter_error": filter_error}
        try:
            total = ops.count_jobs(conn, **kwargs)
            jobs = ops.list_jobs(conn, **kwargs, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
        except ops.OpsError as exc:  # a bad filter: said above the form, which keeps what was typed
            return {"total": 0, "jobs": [], "queue_names": queues, "filter_error": str(exc)}
        return {"total": total, "jobs": jobs, "queue_names": queues, "filter_error": None}

    data = await with_conn(request, read)
    pages = max(1, -(-data["total"] // PAGE_SIZE))
    return render(request, "jobs.html", status_code=400 if data["filter_error"] else 200, context={
        **data, "filters": filters, "states": JOB_STATES, "page": page, "pages": pages,
        "page_url": lambda n: "/jobs?" + urlencode({**filters, "page": n}),
        "bulk_url": lambda action: "/jobs/bulk?" + urlencode({**filters, "action": action}),
        "can_retry": filters.get("state") in (None, "rejected"),
        "can_cancel": filters.get("state") in (None, *CANCELLABLE),
    })


def _bulk_plan(conn: psycopg.Connection[Any], action: str, kwargs: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """How many jobs the bulk action would change, and the ops calls that count them."""
    state = kwargs.get("state")
    if action == "retry":
        if state == "cancelled":
            raise Refused(400, "cancel is final: a bulk retry leaves cancelled jobs alone; retry one from its page")
        states = ["rejected"] if state in (None, "rejected") else []
    elif action == "cancel":
        states = [state] if state in CANCELLABLE else (list(CANCELLABLE) if state is None else [])
    else:
        raise Refused(404, f"no bulk action {action!r}: retry or cancel")
    # never a cancelled job: a retry leaves them (cancel is final), a cancel has nothing to do
    plans = [{**kwargs, "state": s, "cancelled": False} for s in states]
    return sum(ops.count_jobs(conn, **p) for p in plans), plans


@guarded
async def jobs_bulk_confirm(request: Request) -> Response:
    """The confirmation page: what the filter matches, and how many jobs would change."""
    config = config_of(request)
    if config.read_only:
        raise Refused(403, "the dashboard is read-only (--read-only)")
    filters = filters_of(request, hide_args=config.hide_args)
    action = request.query_params.get("action", "")
    kwargs = ops_filters(filters, hide_args=config.hide_args)
    count, _ = await with_conn(request, lambda conn: _bulk_plan(conn, action, kwargs))
    return render(request, "bulk_confirm.html", {
        "action": action, "filters": filters, "count": count, "limit": BULK_LIMIT,
        "back_url": "/jobs?" + urlencode(filters),
    })


@guarded
async def jobs_bulk(request: Request) -> Response:
    form = await action_form(request)
    config = config_of(request)
    filters = visible_filters({k: str(form.get(k) or "") for k in FILTER_PARAMS}, hide_args=config.hide_args)
    action = str(form.get("action") or "")
    kwargs = ops_filters(filters, hide_args=config.hide_args)
    by, source = actor_of(request)

    def act(conn: psycopg.Connection[Any]) -> tuple[int, int, int]:
        with conn.transaction():
            count, plans = _bulk_plan(conn, action, kwargs)
            if count > BULK_LIMIT:
                raise Refused(400, f"{count} jobs match: narrow the filter to at most {BULK_LIMIT}")
            changed, skipped, held, acted_on = 0, 0, 0, []
            for plan in plans:
                ids = _matching_ids(conn, plan)
                if ids:
                    done, left, kept = _apply(conn, action, state=plan["state"], message_ids=ids, by=by)
                    changed, skipped, held = changed + done, skipped + left, held + kept
                    acted_on += ids
            ops.record_action(conn, action=f"jobs.{action}", target={"filter": filters, "message_ids": acted_on},
                              by=by, source=source, affected=changed)
        return changed, skipped, held

    changed, skipped, held = await with_conn(request, act)
    notice = "bulk_cancel_final" if skipped else _held_notice(held, changed) or ("bulk" if changed else "nothing")
    return redirect("/jobs", notice, **filters)


def _held_notice(held: int, changed: int) -> str | None:
    """The notice of a retry that left jobs alone because a live job holds their unique key."""
    if not held:
        return None
    return "some_unique_held" if changed else "unique_held"


#: At most this many jobs are acted on by one "Retry selected" / "Cancel selected".
MAX_SELECTED = ops.MAX_LIMIT


@guarded
async def jobs_selected(request: Request) -> Response:
    """Retry or cancel the jobs ticked on the list (``selected``, repeated): the calls of the bulk
    actions. Cancel is final here too: a retry leaves the cancelled ones alone, and says so."""
    form = await action_form(request)
    config = config_of(request)
    filters = visible_filters({k: str(form.get(k) or "") for k in FILTER_PARAMS}, hide_args=config.hide_args)
    action = str(form.get("action") or "")
    if action not in ("retry", "cancel"):
        raise ops.OpsError(f"action must be retry or cancel, not {quoted(action)}")
    raw = [str(v) for v in form.getlist("selected")]
    if len(raw) > MAX_SELECTED:
        raise ops.OpsError(f"at most {MAX_SELECTED} jobs can be selected at once, not {len(raw)}")
    ids = list(dict.fromkeys(ops.parse_message_id(v) for v in raw))
    page = str(form.get("page") or "").strip()
    back = {**filters, **({"page": page} if page.isascii() and page.isdigit() else {})}
    if not ids:
        return redirect("/jobs", "none_selected", **back)
    by, source = actor_of(request)

    def act(conn: psycopg.Connection[Any]) -> tuple[int, int, int]:
        with conn.transaction():
            if action == "retry":
                outcome = ops.retry_jobs_outcome(conn, message_ids=ids, include_cancelled=False, by=by)
                changed, skipped, held = outcome.retried, outcome.skipped_cancelled, outcome.skipped_unique
            else:
                changed, skipped, held = ops.cancel_jobs(conn, message_ids=ids, by=by), 0, 0
            ops.record_action(conn, action=f"jobs.{action}", target={"selected": True, "message_ids": ids},
                              by=by, source=source, affected=changed)
        return changed, skipped, held

    changed, skipped, held = await with_conn(request, act)
    notice = "selected_cancel_final" if skipped else _held_notice(held, changed) or (
        f"selected_{action}" if changed else "nothing")
    return redirect("/jobs", notice, **back)


def _matching_ids(conn: psycopg.Connection[Any], plan: dict[str, Any]) -> list[str]:
    """Every job id the list filters ``plan`` match (at most BULK_LIMIT), page by page."""
    ids: list[str] = []
    while len(ids) < BULK_LIMIT:
        page = ops.list_jobs(conn, **plan, limit=ops.MAX_LIMIT, offset=len(ids))
        ids += [job.id for job in page]
        if len(page) < ops.MAX_LIMIT:
            break
    return ids[:BULK_LIMIT]


def _apply(conn: psycopg.Connection[Any], action: str, *, state: str, message_ids: list[str],
           by: str) -> tuple[int, int, int]:
    """Retry or cancel exactly these jobs (those still in ``state``): how many changed, how
    many cancelled ones a retry left alone (cancel is final for a bulk action), and how many
    it left because a live job holds their unique key."""
    if action == "retry":
        outcome = ops.retry_jobs_outcome(conn, message_ids=message_ids, state=state, include_cancelled=False, by=by)
        return outcome.retried, outcome.skipped_cancelled, outcome.skipped_unique
    return ops.cancel_jobs(conn, message_ids=message_ids, state=state, by=by), 0, 0


@guarded
async def job_page(request: Request) -> Response:
    config = config_of(request)
    message_id = ops.parse_message_id(request.path_params["id"])
    show = request.query_params.get("show", "")
    if show not in ("", "args"):
        raise ops.OpsError(f"show must be args or absent, not {quoted(show)}")

    def read(conn: psycopg.Connection[Any]) -> tuple[ops.JobDetail | None, list[history.Attempt], datetime]:
        return ops.show_job(conn, message_id), history.attempts(conn, message_id), ops.db_now(conn)

    job, attempts, now = await with_conn(request, read)
    if job is None:
        return render(request, "not_found.html", {"what": f"job {message_id}"}, status_code=404)
    show_args = show == "args" and not config.hide_args
    # hidden means hidden: the next step of a pipeline, a group's callbacks and any other
    # message carried in the options lose their arguments too
    options = hidden_options(job.options) if config.hide_args else job.options
    return render(request, "job.html", {"job": job, "options": options, "show_args": show_args,
                                        "attempts": attempts, "durations": job_durations(job, attempts, now),
                                        "duration": duration_text})


def duration_text(ms: float | None) -> str:
    """A duration as a person reads it: 840 µs, 12.4 ms, 3.21 s, 4.5 min, 2.1 h; '–' for none."""
    if ms is None:
        return "–"
    if ms < 1:
        return f"{ms * 1000:.0f} µs"
    if ms < 1000:
        return f"{ms:.3g} ms"
    if ms < 120_000:
        return f"{ms / 1000:.3g} s"
    if ms < 7_200_000:
        return f"{ms / 60_000:.1f} min"
    return f"{ms / 3_600_000:.1f} h"


def job_durations(job: ops.JobDetail, attempts: list[history.Attempt], now: datetime) -> dict[str, Any]:
    """How long a job took: its last run (start to end; so far, while it runs) and in all
    (from its enqueue to its end; so far, while it is not finished), by the database's clock."""
    running = job.state == "running" and job.started_at is not None
    last = next((a for a in reversed(attempts) if a.started_at is not None), None)
    if running:
        assert job.started_at is not None
        last_run_ms: float | None = (now - job.started_at).total_seconds() * 1000
    else:
        last_run_ms = last.run_ms if last is not None else None
    end = job.finished_at if job.state in ("done", "rejected") and job.finished_at else None
    total_ms = ((end or now) - job.enqueued_at).total_seconds() * 1000
    return {"last_run_ms": last_run_ms, "last_run_so_far": running, "total_ms": max(total_ms, 0.0),
            "total_so_far": end is None}


async def _job_action(request: Request, action: str) -> Response:
    await action_form(request)
    message_id = ops.parse_message_id(request.path_params["id"])
    by, source = actor_of(request)

    def act(conn: psycopg.Connection[Any]) -> tuple[int, bool, int]:
        was_cancelled, held = False, 0
        with conn.transaction():
            if action == "retry":  # named by its page: retried even if it was cancelled, and said
                outcome = ops.retry_jobs_outcome(conn, message_ids=[message_id], by=by)
                changed, was_cancelled, held = outcome.retried, bool(outcome.retried_cancelled), outcome.skipped_unique
            else:
                changed = ops.cancel_jobs(conn, message_ids=[message_id], by=by)
            ops.record_action(conn, action=f"jobs.{action}", target={"message_ids": [message_id]}, by=by,
                              source=source, affected=changed)
        return changed, was_cancelled, held

    changed, was_cancelled, held = await with_conn(request, act)
    notice = ("retried_cancelled" if was_cancelled else "retried" if action == "retry" else "cancelled") \
        if changed else _held_notice(held, changed) or "nothing"
    return redirect(f"/jobs/{message_id}", notice)


@guarded
async def job_retry(request: Request) -> Response:
    return await _job_action(request, "retry")


@guarded
async def job_cancel(request: Request) -> Response:
    return await _job_action(request, "cancel")
