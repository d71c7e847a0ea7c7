"""Jobs: the filters, the list and its count, one job in full, retry and cancel, and
the resolution of job ids from their prefixes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import psycopg

from broker.backends import RESULTS_NAMESPACE
from broker.ops.common import (
    AMBIGUOUS_SHOWN,
    JOB_STATES,
    MAX_ERROR_SEARCH_CHARS,
    MAX_LIMIT,
    MAX_OFFSET,
    MAX_SEARCH_CHARS,
    MIN_ID_PREFIX_HEX,
    OpsError,
    _by,
    _contains,
    _one_line,
    _Row,
    age_seconds,
    id_range,
    parse_message_id,
    parse_since,
)


@dataclasses.dataclass(frozen=True)
class JobSummary(_Row):
    id: str
    queue: str
    actor: str
    state: str                          # one of JOB_STATES except "cancelled" (see cancelled_at)
    retries: int
    enqueued_at: datetime
    error: str | None                   # one line: the rejection reason or the last failure
    cancelled_at: datetime | None = None


@dataclasses.dataclass(frozen=True)
class JobDetail(_Row):
    id: str
    queue: str
    actor: str
    state: str
    retries: int
    enqueued_at: datetime
    error: str | None                   # in full
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]             # without the traceback
    traceback: str | None
    claims: int
    crashes: int
    snoozes: int
    worker_id: str | None
    worker_host: str | None
    worker_pid: int | None
    eta: datetime
    started_at: datetime | None         # when the running claim started (where recorded)
    finished_at: datetime | None        # done or rejected
    updated_at: datetime | None
    retried_by: str | None
    retried_at: datetime | None
    cancelled_by: str | None
    cancelled_at: datetime | None

    @property
    def summary(self) -> JobSummary:
        return JobSummary(self.id, self.queue, self.actor, self.state, self.retries, self.enqueued_at,
                          _one_line(self.error or self.traceback), self.cancelled_at)

    @property
    def timeline(self) -> list[tuple[str, datetime]]:
        """What happened when, in order: enqueued, due, started, retried, cancelled, finished."""
        events = [("enqueued", self.enqueued_at), ("due", self.eta), ("started", self.started_at),
                  ("retried", self.retried_at), ("cancelled", self.cancelled_at),
                  (self.state if self.state in ("done", "rejected") else "finished", self.finished_at)]
        return sorted(((name, at) for name, at in events if at is not None), key=lambda e: e[1])


# -- jobs --------------------------------------------------------------------------------

#: The job state as operators name it (see JOB_STATES), from a row ``q`` of dramatiq.queue.
JOB_STATE_EXPR = """
CASE WHEN q."state" = 'queued' AND q.eta > now() THEN 'delayed'
     WHEN q."state" = 'consumed' THEN 'running'
     ELSE q."state"::text END
"""

#: The filters shared by the job list, its count and the bulk actions; every one is
#: optional (NULL: no filter). ``search`` is an ILIKE pattern over the arguments,
#: ``error`` one over the error (the rejection reason) and the last failure's traceback.
JOB_FILTERS = """
    (%(state)s::text IS NULL
     OR (%(state)s = 'queued' AND q."state" = 'queued' AND q.eta <= now())
     OR (%(state)s = 'delayed' AND q."state" = 'queued' AND q.eta > now())
     OR (%(state)s = 'running' AND q."state" = 'consumed')
     OR (%(state)s = 'done' AND q."state" = 'done')
     OR (%(state)s = 'rejected' AND q."state" = 'rejected')
     OR (%(state)s = 'cancelled' AND q.cancelled_at IS NOT NULL))
AND (%(cancelled)s::boolean IS NULL OR (q.cancelled_at IS NOT NULL) = %(cancelled)s)
AND (%(queue)s::text IS NULL OR q.queue_name = %(queue)s)
AND (%(actor)s::text IS NULL OR q.message->>'actor_name' = %(actor)s)
AND (%(since)s::timestamptz IS NULL OR q.enqueued_at >= %(since)s)
AND (%(since_age_s)s::float8 IS NULL OR q.enqueued_at >= now() - make_interval(secs => %(since_age_s)s::float8))
AND (%(id_low)s::uuid IS NULL OR q.message_id BETWEEN %(id_low)s::uuid AND %(id_high)s::uuid)
AND (%(message_ids)s::uuid[] IS NULL OR q.message_id = ANY(%(message_ids)s::uuid[]))
AND (%(search)s::text IS NULL
     OR (q.message->'args')::text ILIKE %(search)s
     OR (q.message->'kwargs')::text ILIKE %(search)s)
AND (%(error)s::text IS NULL
     OR q.error ILIKE %(error)s
     OR q.message->'options'->>'traceback' ILIKE %(error)s
     OR q.message->'options'->>'error' ILIKE %(error)s)
"""

#: One line of a failure: the rejection reason, else the last line of the last traceback.
JOB_ERROR_EXPR = """
nullif(substring(rtrim(coalesce(q.error, q.message->'options'->>'traceback'), E' \\n') from '[^\\n]*$'), '')
"""

LIST_JOBS = (
    "SELECT q.message_id::text, q.queue_name, q.message->>'actor_name', " + JOB_STATE_EXPR + ",\n"
    "       coalesce((q.message->'options'->>'retries')::numeric::bigint, 0), q.enqueued_at, " + JOB_ERROR_EXPR + ",\n"
    "       q.cancelled_at\n"
    "FROM dramatiq.queue q\nWHERE " + JOB_FILTERS +
    "ORDER BY q.enqueued_at DESC, q.message_id\nLIMIT %(limit)s OFFSET %(offset)s\n"
)

COUNT_JOBS = "SELECT count(*) FROM dramatiq.queue q\nWHERE " + JOB_FILTERS

#: One job in full. ``started_at`` is read from the row as JSON, so this works with and
#: without that column (the broker records it where it can).
SHOW_JOB = (
    "SELECT q.message_id::text, q.queue_name, q.message->>'actor_name', " + JOB_STATE_EXPR + ",\n"
    "       coalesce((q.message->'options'->>'retries')::numeric::bigint, 0), q.enqueued_at,\n"
    "       coalesce(q.error, q.message->'options'->>'error'),\n"
    "       coalesce(q.message->'args', '[]'::jsonb), coalesce(q.message->'kwargs', '{}'::jsonb),\n"
    "       coalesce(q.message->'options', '{}'::jsonb) - 'traceback',\n"
    "       q.message->'options'->>'traceback',\n"
    "       q.claims, q.crashes, coalesce((q.message->'options'->>'snoozes')::numeric::bigint, 0),\n"
    "       q.worker_id::text, w.hostname, w.pid, q.eta,\n"
    "       (to_jsonb(q)->>'started_at')::timestamptz,\n"
    "       CASE WHEN q.\"state\" IN ('done', 'rejected') THEN q.mtime END, q.mtime,\n"
    "       coalesce(q.retried_by, q.message->'options'->>'retried_by'), q.retried_at,\n"
    "       q.cancelled_by, q.cancelled_at\n"
    "FROM dramatiq.queue q\n"
    "LEFT JOIN standmeet.worker_processes w ON w.id = q.worker_id\n"
    "WHERE q.message_id = %(message_id)s\n"
)


def list_jobs(conn: psycopg.Connection[Any], *, state: str | None = None, queue: str | None = None,
              actor: str | None = None, since: datetime | str | None = None, search: str | None = None,
              message_id: str | None = None, error: str | None = None, limit: int = 50,
              offset: int = 0, cancelled: bool | None = None) -> list[JobSummary]:
    """Jobs matching every given filter, newest first (enqueued_at DESC, then id: stable).

    ``since``: enqueued at or after (a datetime, an ISO time, or an age like ``15m``,
    ``2h``, ``1d``); ``search``: text in the arguments (case-insensitive);
    ``message_id``: a whole id or the start of one; ``error``: text in the job's error or
    its last traceback (case-insensitive, at most :data:`MAX_ERROR_SEARCH_CHARS`).
    """
    if not 0 < limit <= MAX_LIMIT:
        raise OpsError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    if not 0 <= offset <= MAX_OFFSET:
        raise OpsError(f"offset must be between 0 and {MAX_OFFSET}, not {offset}")
    params = job_filters(state=state, queue=queue, actor=actor, since=since, search=search, message_id=message_id,
                         error=error, cancelled=cancelled)
    rows = conn.execute(LIST_JOBS, {**params, "limit": limit, "offset": offset}).fetchall()
    return [JobSummary(r[0], r[1], r[2] or "", r[3], int(r[4]), r[5], r[6], r[7]) for r in rows]


def count_jobs(conn: psycopg.Connection[Any], *, state: str | None = None, queue: str | None = None,
               actor: str | None = None, since: datetime | str | None = None, search: str | None = None,
               message_id: str | None = None, error: str | None = None, cancelled: bool | None = None) -> int:
    """How many jobs :func:`list_jobs` would page through with the same filters."""
    params = job_filters(state=state, queue=queue, actor=actor, since=since, search=search, message_id=message_id,
                         error=error, cancelled=cancelled)
    row = conn.execute(COUNT_JOBS, params).fetchone()
    return int(row[0]) if row else 0


def show_job(conn: psycopg.Connection[Any], message_id: str) -> JobDetail | None:
    """One job in full, or None when there is no such job (pruned, or never was)."""
    row = conn.execute(SHOW_JOB, {"message_id": parse_message_id(message_id)}).fetchone()
    if row is None:
        return None
    return JobDetail(
        id=row[0], queue=row[1], actor=row[2] or "", state=row[3], retries=int(row[4]), enqueued_at=row[5],
        error=row[6], args=list(row[7]) if isinstance(row[7], list) else [row[7]],
        kwargs=dict(row[8]) if isinstance(row[8], dict) else {}, options=dict(row[9] or {}),
        traceback=row[10], claims=int(row[11]), crashes=int(row[12]), snoozes=int(row[13]),
        worker_id=row[14], worker_host=row[15], worker_pid=row[16], eta=row[17], started_at=row[18],
        finished_at=row[19], updated_at=row[20], retried_by=row[21], retried_at=row[22],
        cancelled_by=row[23], cancelled_at=row[24],
    )


# -- retry and cancel --------------------------------------------------------------------

#: Rejected jobs matching the filters back to their queue, due now: retries and crashes
#: reset, error and traceback cleared, who and when recorded (columns and options), a
#: cancellation lifted; each queue's consumers are woken once. A cancelled job among them
#: is retried only with ``include_cancelled``; otherwise it is left as it is, and counted.
RETRY_JOBS = (
    "WITH matched AS (\n"
    "    SELECT q.message_id, q.cancelled_at IS NOT NULL AS cancelled, q.unique_key FROM dramatiq.queue q\n"
    "    WHERE q.\"state\" = 'rejected' AND " + JOB_FILTERS +
    "    ORDER BY q.message_id\n"
    "    FOR UPDATE\n"
    "), eligible AS (\n"
    "    SELECT message_id, cancelled, unique_key FROM matched WHERE %(include_cancelled)s OR NOT cancelled\n"
    # a unique job goes back only if no live message holds its key (and one per key)
    "), picked AS (\n"
    "    SELECT DISTINCT ON (coalesce(e.unique_key, uuid_send(e.message_id))) e.message_id, e.cancelled\n"
    "    FROM eligible e\n"
    "    WHERE e.unique_key IS NULL OR NOT EXISTS (\n"
    "        SELECT 1 FROM dramatiq.queue l WHERE l.unique_key = e.unique_key\n"
    "        AND standmeet.unique_live(l.unique_states, l.\"state\"))\n"
    "    ORDER BY coalesce(e.unique_key, uuid_send(e.message_id)), e.message_id\n"
    "), retried AS (\n"
    "    UPDATE dramatiq.queue q\n"
    "    SET \"state\" = 'queued', eta = now(), mtime = now(), worker_id = NULL, error = NULL, crashes = 0,\n"
    "        runs_without_outcome = 0,\n"
    "        cancelled_at = NULL, cancelled_by = NULL, retried_at = now(), retried_by = %(by)s,\n"
    # a cancel took its running bit (unique.UNIQUE_RUNNING): live again, it holds its key
    "        unique_states = q.unique_states | 2::smallint,\n"
    "        message = jsonb_set(q.message, '{options}',\n"
    "            (coalesce(q.message->'options', '{}'::jsonb) - 'traceback' - 'error')\n"
    "            || jsonb_build_object('retries', 0, 'retried_by', %(by)s::text,\n"
    "                                  'retried_at', to_jsonb(now())))\n"
    "    FROM picked\n"
    "    WHERE q.message_id = picked.message_id\n"
    "    RETURNING q.queue_name, q.message_id::text AS message_id, picked.cancelled,\n"
    "              q.message->>'actor_name' AS actor_name\n"
    # what the results policy stored for the rejected run (its failure) is not this run's
    # result: a waiter must wait for the retried run (the key: the results backend's,
    # hashed or not, of the default namespace)
    "), forgotten AS (\n"
    "    DELETE FROM standmeet.results r USING retried t\n"
    "    WHERE r.message_key IN (\n"
    "        md5(%(results_namespace)s || ':' || t.queue_name || ':' || t.actor_name || ':' || t.message_id),\n"
    "        %(results_namespace)s || ':' || t.queue_name || ':' || t.actor_name || ':' || t.message_id)\n"
    "), woken AS (\n"
    "    SELECT pg_notify(standmeet.enqueue_channel(queue_name), '')\n"
    "    FROM (SELECT DISTINCT queue_name FROM retried) AS queues\n"
    ")\n"
    "SELECT (SELECT count(*) FROM retried),\n"
    "       (SELECT count(*) FROM matched WHERE cancelled AND NOT %(include_cancelled)s),\n"
    "       (SELECT coalesce(array_agg(message_id ORDER BY message_id), '{}') FROM retried WHERE cancelled),\n"
    "       (SELECT count(*) FROM woken),\n"
    "       (SELECT count(*) FROM eligible) - (SELECT count(*) FROM picked)\n"
)

#: Cancel the queued, delayed or running jobs matching the filters. One not running is
#: rejected at once (it never runs), with the reason, and its awaited receipt is sent;
#: a running one is marked, so the broker does not retry it and its deadline check
#: stops it.
CANCEL_JOBS = (
    "WITH picked AS (\n"
    "    SELECT q.message_id FROM dramatiq.queue q\n"
    "    WHERE q.\"state\" IN ('queued', 'consumed') AND q.cancelled_at IS NULL AND " + JOB_FILTERS +
    "    ORDER BY q.message_id\n"
    "    FOR UPDATE\n"
    "), cancelled AS (\n"
    "    UPDATE dramatiq.queue q\n"
    # the moment of the cancel itself, not of its transaction's start: a run that returned
    # before it was made is recorded as it ended (broker.engine.sql._CANCELLED_IN_TIME)
    "    SET cancelled_at = clock_timestamp(), cancelled_by = %(by)s,\n"
    "        \"state\" = CASE WHEN q.\"state\" = 'queued' THEN 'rejected'::dramatiq.state ELSE q.\"state\" END,\n"
    # a running one no longer holds its unique key (bit 2, unique.UNIQUE_RUNNING): the
    # same call sent again is a message of its own, not folded into one that is ending
    "        unique_states = CASE WHEN q.\"state\" = 'consumed' THEN q.unique_states & ~2::smallint\n"
    "                             ELSE q.unique_states END,\n"
    "        error = CASE WHEN q.\"state\" = 'queued'\n"
    "                     THEN 'cancelled by ' || %(by)s || ' at ' || to_char(clock_timestamp() AT TIME ZONE 'UTC',\n"
    "                          'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')\n"
    "                     ELSE q.error END,\n"
    "        mtime = CASE WHEN q.\"state\" = 'queued' THEN now() ELSE q.mtime END\n"
    "    FROM picked\n"
    "    WHERE q.message_id = picked.message_id\n"
    "    RETURNING q.queue_name, q.message_id, q.\"state\"\n"
    "), receipts AS (\n"
    "    SELECT pg_notify(standmeet.receipt_channel(queue_name), message_id::text || ':rejected')\n"
    "    FROM cancelled WHERE \"state\" = 'rejected'\n"
    ")\n"
    "SELECT (SELECT count(*) FROM cancelled), (SELECT count(*) FROM receipts)\n"
)


@dataclasses.dataclass(frozen=True)
class RetryOutcome(_Row):
    """What :func:`retry_jobs_outcome` did."""

    retried: int                        # jobs sent back to their queue
    skipped_cancelled: int              # cancelled jobs that matched and were left alone (cancel is final)
    retried_cancelled: list[str]        # ids of cancelled jobs retried all the same (named, or included)
    skipped_unique: int = 0             # unique jobs left alone: a live message holds their key


#: How often a retry is judged again when a send of a unique key it retries commits meanwhile.
RETRY_TRIES = 3


def retry_jobs_outcome(conn: psycopg.Connection[Any], *, message_ids: Sequence[str] | None = None,
                       state: str | None = None, queue: str | None = None, actor: str | None = None,
                       since: datetime | str | None = None, search: str | None = None,
                       error: str | None = None, include_cancelled: bool | None = None,
                       by: str) -> RetryOutcome:
    """Send rejected jobs (the ids given, or every one matching the filters) back to
    their queue, due now, with their retries reset; say how many, and how many cancelled
    ones it left alone.

    Only rejected jobs are retried (``state`` may narrow to ``rejected`` or ``cancelled``);
    a job queued, running or done is left alone. Cancel is final: a cancelled job is
    retried only when ``include_cancelled`` says so, which by default (None) it does for
    ``state="cancelled"`` and for ids given without a state (an operator naming the job),
    and for no filter otherwise.
    """
    if state not in (None, "rejected", "cancelled"):
        raise OpsError(f"only rejected or cancelled jobs can be retried, not {state!r} ones")
    if include_cancelled is None:
        include_cancelled = state == "cancelled" or (message_ids is not None and state is None)
    params = {**job_filters(state=state, queue=queue, actor=actor, since=since, search=search,
                            message_ids=message_ids, error=error),
              "by": _by(by), "include_cancelled": include_cancelled, "results_namespace": RESULTS_NAMESPACE}
    for tries_left in range(RETRY_TRIES - 1, -1, -1):
        try:
            with conn.transaction():
                row = conn.execute(RETRY_JOBS, params).fetchone()
            break
        except psycopg.errors.UniqueViolation as exc:
            # A send of one of their unique keys committed while the statement ran (its
            # check read the key free): judged again, that job is left alone and counted.
            if not tries_left:
                raise OpsError("jobs of a unique key kept being sent while retrying: "
                               + (str(exc).strip().splitlines() or [type(exc).__name__])[0]) from exc
    if row is None:
        return RetryOutcome(0, 0, [])
    return RetryOutcome(int(row[0]), int(row[1]), [str(i) for i in row[2]], int(row[4]))


def retry_jobs(conn: psycopg.Connection[Any], *, message_ids: Sequence[str] | None = None,
               state: str | None = None, queue: str | None = None, actor: str | None = None,
               since: datetime | str | None = None, search: str | None = None,
               error: str | None = None, include_cancelled: bool | None = None, by: str) -> int:
    """:func:`retry_jobs_outcome`, returning how many jobs were retried."""
    return retry_jobs_outcome(conn, message_ids=message_ids, state=state, queue=queue, actor=actor, since=since,
                              search=search, error=error, include_cancelled=include_cancelled, by=by).retried


def cancel_jobs(conn: psycopg.Connection[Any], *, message_ids: Sequence[str] | None = None,
                state: str | None = None, queue: str | None = None, actor: str | None = None,
                since: datetime | str | None = None, search: str | None = None, error: str | None = None,
                by: str) -> int:
    """Cancel jobs (the ids given, or every queued, delayed or running one matching the
    filters); return how many. A job not running never runs; a running one is not
    retried and stops at its next deadline check. Finished jobs are left alone.
    """
    if state not in (None, "queued", "delayed", "running"):
        raise OpsError(f"only queued, delayed or running jobs can be cancelled, not {state!r} ones")
    params = job_filters(state=state, queue=queue, actor=actor, since=since, search=search,
                         message_ids=message_ids, error=error)
    with conn.transaction():
        row = conn.execute(CANCEL_JOBS, {**params, "by": _by(by)}).fetchone()
    return int(row[0]) if row else 0


#: The first few job ids in a range of ids (an index range scan of the primary key).
JOB_IDS_IN_RANGE = """
SELECT q.message_id::text FROM dramatiq.queue q
WHERE q.message_id BETWEEN %(low)s::uuid AND %(high)s::uuid
ORDER BY q.message_id
LIMIT %(limit)s
"""


def resolve_job_id(conn: psycopg.Connection[Any], value: str) -> str:
    """The job id ``value`` names: a whole id (returned as it is, whether or not the job
    exists), or a prefix of at least :data:`MIN_ID_PREFIX_HEX` hex digits that exactly one
    job's id starts with. A shorter prefix, one no job's id starts with, or one several
    do (the first :data:`AMBIGUOUS_SHOWN` are named) is refused in one line."""
    text = str(value).strip()
    if len(text.replace("-", "")) >= 32:
        return parse_message_id(text)
    low, high = id_range(text, min_hex=MIN_ID_PREFIX_HEX)
    found = [r[0] for r in conn.execute(JOB_IDS_IN_RANGE, {"low": low, "high": high,
                                                           "limit": AMBIGUOUS_SHOWN + 1}).fetchall()]
    if not found:
        raise OpsError(f"no job id starts with {text!r} (never enqueued, or pruned after the retention)")
    if len(found) > 1:
        more = " and more" if len(found) > AMBIGUOUS_SHOWN else ""
        raise OpsError(f"job id prefix {text!r} is ambiguous: it matches {', '.join(found[:AMBIGUOUS_SHOWN])}{more}; "
                       "give more of the id")
    return found[0]


def resolve_job_ids(conn: psycopg.Connection[Any], values: Iterable[str]) -> list[str]:
    """:func:`resolve_job_id` of each value, in order, each id once."""
    return list(dict.fromkeys(resolve_job_id(conn, v) for v in values))


def job_filters(*, state: str | None = None, queue: str | None = None, actor: str | None = None,
                since: datetime | str | None = None, search: str | None = None,
                message_id: str | None = None, message_ids: Iterable[str] | None = None,
                error: str | None = None, cancelled: bool | None = None) -> dict[str, Any]:
    """The parameters of :data:`JOB_FILTERS`, checked (``error``: at most
    :data:`MAX_ERROR_SEARCH_CHARS`, no control characters; ``cancelled``: only jobs an
    operator cancelled, or only the others; None: both)."""
    if state is not None and state not in JOB_STATES:
        raise OpsError(f"unknown job state {state!r}; one of {', '.join(JOB_STATES)}")
    id_low = id_high = None
    if message_id:
        id_low, id_high = id_range(message_id)
    ids = None if message_ids is None else [parse_message_id(m) for m in message_ids]
    age = age_seconds(since)
    if search and len(search) > MAX_SEARCH_CHARS:
        raise OpsError(f"search: the text to search arguments for must be at most {MAX_SEARCH_CHARS} characters, "
                       f"not {len(search)}")
    if error:
        if len(error) > MAX_ERROR_SEARCH_CHARS:
            raise OpsError(f"error: the text to search errors for must be at most {MAX_ERROR_SEARCH_CHARS} "
                           f"characters, not {len(error)}")
        if any(ord(c) < 32 or ord(c) == 127 for c in error):
            raise OpsError(f"error: the text to search errors for must not contain control characters: {error!r}")
    return {
        "state": state, "queue": queue or None, "actor": actor or None,
        # an age by the database's clock; a time as given
        "since": None if age is not None else parse_since(since), "since_age_s": age,
        "id_low": id_low, "id_high": id_high, "message_ids": ids, "search": _contains(search),
        "error": _contains(error), "cancelled": cancelled,
    }
