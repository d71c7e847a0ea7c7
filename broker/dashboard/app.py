"""The dashboard's web application (Starlette, server-rendered Jinja2 pages).

Every page is read from the database through :mod:`broker.ops` (the queries the
command line uses too); an application adds its own pages (``broker.app.page``), which
use the helpers here (:func:`render`, :func:`with_conn`, :func:`action_form`,
:func:`actor_of`, :func:`redirect`, :class:`Refused`) as the runtime's do. Pages carry
``data-live`` regions that ``static/dashboard.js`` refreshes in place every few
seconds; forms sit outside them, so nothing the user typed is reloaded. Actions are
POSTs with a CSRF token, refused in read-only mode, and recorded with
``ops.record_action`` (what, which jobs, by whom, from where; the time is the row's).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar
from urllib.parse import urlencode

import psycopg
import psycopg.errors
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response

from broker import ops
from broker.app import REGISTRY, PeriodicJob
from broker.dashboard.security import CSRF_FIELD, Csrf, cookie_is_secure, quoted
from broker.settings import SecureCookieMode

T = TypeVar("T")

#: Rows per page of the jobs list.
PAGE_SIZE = 50
#: At most this many jobs are retried or cancelled by one bulk action.
BULK_LIMIT = 10_000
#: Every dashboard statement stops after this long: a page never holds the database.
STATEMENT_TIMEOUT_MS = 10_000
#: The highest page number of the jobs list (``page``): 10 million rows deep.
MAX_PAGE = 200_000
#: The highest id a database row can have (``bigint``): larger ones are refused, not looked up.
MAX_ROW_ID = 2**63 - 1
#: The longest text a filter (queue, actor, search, topic) may be.
MAX_FILTER_CHARS = 500
#: Arguments and options nested deeper than this are cut where they are shown.
MAX_SHOWN_DEPTH = 64
#: What stands where they were cut.
CUT_MARKER = f"(cut: nested deeper than {MAX_SHOWN_DEPTH} levels)"
#: The states the jobs list filters by (as ``broker.ops`` names them).
JOB_STATES = ("queued", "delayed", "running", "done", "rejected", "cancelled")

#: The runtime's pages in the navigation, (path, title); the applications' follow.
NAV = (("/", "Overview"), ("/jobs", "Jobs"), ("/history", "History"), ("/workers", "Workers"),
       ("/periodic", "Periodic"), ("/outbox", "Outbox"))

#: Messages shown after an action, by code (the redirect carries the code, not the text);
#: an application's are declared with ``broker.app.dashboard_notice``.
NOTICES = {
    "retried": "Retry queued.",
    "cancelled": "Cancelled.",
    "paused": "Queue paused: no process claims from it until it is resumed.",
    "resumed": "Queue resumed.",
    "relayed": "Given back to the relays: a process that routes the topic relays it again.",
    "bulk": "Bulk action done.",
    "bulk_cancel_final": ("Bulk action done. Cancelled jobs that matched were left alone: cancel is final "
                          "(retry one from its own page, or `jobs retry ID`)."),
    "retried_cancelled": "Retry queued: this job had been cancelled, and was retried because you named it.",
    "nothing": "Nothing matched: nothing was changed.",
    "unique_held": ("Left as it was: a live job of the same unique key holds the key, and runs instead "
                    "(retry it once that one has ended)."),
    "some_unique_held": ("The jobs that had failed were queued again, except those whose unique key a live job "
                         "holds: that one runs instead."),
    "none_selected": "Nothing selected: tick the rows to act on, then press Retry selected or Cancel selected.",
    "selected_retry": "The selected jobs that had failed were queued again; the others were left as they were.",
    "selected_cancel": "The selected jobs not yet finished were cancelled; the others were left as they were.",
    "selected_cancel_final": ("The selected jobs that had failed were queued again, except the cancelled ones: "
                              "cancel is final (retry one from its own page, or `jobs retry ID`)."),
}


@dataclass(frozen=True)
class DashboardConfig:
    """What the dashboard needs to know, resolved by the command that starts it."""

    database_url: str
    read_only: bool = False
    hide_args: bool = False
    user: str = "admin"
    password: str | None = field(default=None, repr=False)
    rescue_after_s: float = 20.0
    #: the declared queues, shown even while they hold nothing
    queues: tuple[str, ...] = ()
    #: the periodic jobs this process declares (with those the schedulers recorded)
    periodic_jobs: tuple[PeriodicJob, ...] = ()
    #: seconds between live refreshes of an open page
    refresh_s: float = 3.0
    pool_max_size: int = 4
    #: how long a request waits for a database connection before answering 503
    connect_timeout_s: float = 3.0
    #: the address the dashboard listens on (it answers to this address's names only)
    bind_host: str = "127.0.0.1"
    #: host names it answers to besides (STANDMEET_DASHBOARD_ALLOWED_HOSTS, normalised)
    allowed_hosts: tuple[str, ...] = ()
    #: when its cookie is marked Secure (STANDMEET_DASHBOARD_SECURE_COOKIE)
    secure_cookie: SecureCookieMode = "auto"


# -- helpers the pages share ----------------------------------------------------------

def config_of(request: Request) -> DashboardConfig:
    config: DashboardConfig = request.app.state.config
    return config


async def with_conn(request: Request, work: Callable[[psycopg.Connection[Any]], T]) -> T:
    """Run ``work`` with a pooled connection, off the event loop."""
    pool: ConnectionPool = request.app.state.pool

    def run() -> T:
        with pool.connection() as conn:
            set_json_loads(loads_shown, conn)  # a job's 10,000-deep arguments load cut, not raise
            return work(conn)

    return await run_in_threadpool(run)


def render(request: Request, template: str, context: dict[str, Any], *, status_code: int = 200) -> Response:
    config = config_of(request)
    csrf: Csrf = request.app.state.csrf
    nonce, new = csrf.nonce(request)
    code = request.query_params.get("notice", "")
    notice = NOTICES.get(code) or REGISTRY.notices.get(code)
    base = {
        "read_only": config.read_only,
        "hide_args": config.hide_args,
        "csrf_field": CSRF_FIELD,
        "csrf_token": csrf.token_for(nonce),
        "notice": notice,
        "refresh_ms": int(config.refresh_s * 1000),
        "now": datetime.now(timezone.utc),
        "path": request.url.path,
        "nav": request.app.state.nav,
    }
    response = request.app.state.templates.TemplateResponse(
        request, template, {**base, **context}, status_code=status_code
    )
    response.headers["Cache-Control"] = "no-store"
    if new:
        Csrf.set_cookie(response, nonce, secure=cookie_is_secure(config.secure_cookie, request.url.scheme))
    return response


class Refused(Exception):
    """An action the dashboard refuses: 403 (CSRF, read-only) or 404."""

    def __init__(self, status_code: int, reason: str) -> None:
        super().__init__(reason)
        self.status_code = status_code
        self.reason = reason


async def action_form(request: Request) -> FormData:
    """The POSTed form, once its CSRF token checked and read-only mode ruled out."""
    form = await request.form()
    if not request.app.state.csrf.valid(request, form.get(CSRF_FIELD)):
        raise Refused(403, "missing or wrong CSRF token: reload the page and try again")
    if config_of(request).read_only:
        raise Refused(403, "the dashboard is read-only (--read-only)")
    return form


def actor_of(request: Request) -> tuple[str, str]:
    """(by, source) for ``ops.record_action``: who acted, and from where."""
    config = config_of(request)
    client = request.client.host if request.client else "unknown"
    by = config.user if config.password else "dashboard"
    return by, f"dashboard {client}"


def redirect(path: str, notice: str, **params: str) -> RedirectResponse:
    query = urlencode({**{k: v for k, v in params.items() if v}, "notice": notice})
    return RedirectResponse(f"{path}?{query}", status_code=303)


def refused_response(request: Request, exc: Refused) -> Response:
    return PlainTextResponse(exc.reason + "\n", status_code=exc.status_code)


def json_response(data: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status_code)


# -- query parameters: each has a range, and a value outside it a one-line 400 ------------

def row_id(name: str, value: int) -> int:
    """A path's row id within ``bigint``; 400 past it."""
    if not 0 < value <= MAX_ROW_ID:
        raise ops.OpsError(f"{name} must be a whole number from 1 to {MAX_ROW_ID}, not {value}")
    return value



def whole_number(name: str, raw: str, *, low: int, high: int) -> int:
    """``raw`` as a whole number from ``low`` to ``high``; an ``ops.OpsError`` (400)
    naming the parameter, the value and the range else."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and low <= int(text) <= high):
        raise ops.OpsError(f"{name} must be a whole number from {low} to {high}, not {quoted(raw)}")
    return int(text)


def text_filter(name: str, raw: str, *, max_chars: int = MAX_FILTER_CHARS) -> str:
    """A free-text filter: at most ``max_chars``, no control characters (Postgres text
    holds no NUL, and none of them is typed in a search box)."""
    if len(raw) > max_chars:
        raise ops.OpsError(f"{name} must be at most {max_chars} characters, not {len(raw)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise ops.OpsError(f"{name} must not contain control characters: {quoted(raw)}")
    return raw


def since_filter(raw: str) -> datetime:
    """``since``: an ISO time or an age (15m, 2h, 7d); one the calendar cannot hold is refused."""
    try:
        since = ops.parse_since(text_filter("since", raw, max_chars=64))
    except OverflowError:
        raise ops.OpsError(f"since {quoted(raw)} is further back than the calendar goes: "
                           "give an age like 15m, 2h or 7d, or an ISO time") from None
    assert since is not None
    return since


def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Refusals (CSRF, read-only, not found) and bad filters as plain answers."""

    async def run(request: Request) -> Response:
        try:
            response: Response = await handler(request)
            return response
        except Refused as exc:
            return refused_response(request, exc)
        except ops.OpsError as exc:
            return PlainTextResponse(f"{exc}\n", status_code=400)
        except psycopg.errors.UndefinedTable as exc:
            return PlainTextResponse(f"the schema is not up to date (run standmeet-jobs migrate): {exc}\n",
                                     status_code=503)
        except psycopg.errors.QueryCanceled:  # the page's statement timeout: the database is there
            return PlainTextResponse("the query took too long and was stopped: narrow the filter "
                                     "(a queue, a state, an actor, a time)\n", status_code=504)
        except psycopg.errors.DataError as exc:  # a value the query could not read, said in one line
            return PlainTextResponse(f"the database could not read a value for this page: "
                                     f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0]}\n", status_code=500)
        except (psycopg.OperationalError, PoolTimeout) as exc:
            return PlainTextResponse(f"the database is unavailable: {str(exc).strip()}\n", status_code=503)

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run


# -- JSON as the pages show it -----------------------------------------------------------

_JSON_STRUCTURE = re.compile(r'["\[\]{}]')
_JSON_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.S)


def cut_deep_json(text: str, *, max_depth: int = MAX_SHOWN_DEPTH) -> str:
    """``text`` (JSON) with every array or object deeper than ``max_depth`` replaced by
    the string :data:`CUT_MARKER`: a document the stack cannot hold, made one it can.
    Linear, and without recursion."""
    out: list[str] = []
    depth, pos, at = 0, 0, 0
    while (found := _JSON_STRUCTURE.search(text, at)) is not None:
        char, start = found.group(), found.start()
        if char == '"':
            rest = _JSON_STRING_REST.match(text, start + 1)
            if rest is None:
                break
            at = rest.end()
            continue
        if char in "[{":
            depth += 1
            if depth == max_depth + 1:
                out.append(text[pos:start])
        else:
            if depth == max_depth + 1:
                out.append(json.dumps(CUT_MARKER))
                pos = start + 1
            depth -= 1
        at = start + 1
    out.append(text[pos:])
    return "".join(out)


def loads_shown(data: bytes | bytearray | memoryview | str) -> Any:
    """JSON from the database, as a page shows it: whole when Python can hold it, cut at
    :data:`MAX_SHOWN_DEPTH` when it is nested too deep to parse (no RecursionError)."""
    text = bytes(data).decode() if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        return json.loads(text)
    except RecursionError:
        return json.loads(cut_deep_json(text))


# -- template filters ------------------------------------------------------------------

def format_age(seconds: float | None) -> str:
    """12 s, 3 min, 2.5 h, 4 d; '–' for none."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "–"
    s = float(seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172_800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def format_ts(value: datetime | None) -> str:
    if value is None:
        return "–"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


#: How many job ids a recorded action's target shows on the overview (a bulk action may
#: record 10,000: the page, refreshed every 3 s, would carry every one).
TARGET_IDS_SHOWN = 5


def brief_target(target: Any) -> Any:
    """A recorded action's target, its list of job ids cut to the first few and a count."""
    if isinstance(target, dict) and isinstance(target.get("message_ids"), list):
        ids = target["message_ids"]
        if len(ids) > TARGET_IDS_SHOWN:
            return {**target, "message_ids": [*ids[:TARGET_IDS_SHOWN], f"… {len(ids) - TARGET_IDS_SHOWN} more"]}
    return target


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)
