"""The fetch queue: job sources (JSON or RSS/Atom feeds) and their postings.

``jobs.fetch_source(source_id)`` fetches one source with a conditional request
(``If-None-Match`` / ``If-Modified-Since``), parses it and upserts its postings
idempotently; a 304 transfers nothing. At most one fetch per source is queued or
running at any time: ``standmeet.source_fetches`` has the source as its primary key,
and :func:`fetch_new` inserts there and enqueues in one transaction (a unique
constraint, not a check-then-insert). A broken or malformed feed records a clear
error on its source; the other sources go on.

Each source has its own time limit (the message's ``time_limit`` option, which wins
over the actor's and the queue's), and its URL passes the request-forgery guard when
it is added and at every fetch.
"""

from __future__ import annotations

import json
import logging
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

import dramatiq
import httpx

from actors import settings as app_settings
from actors.http import ResponseTooLarge, guarded_request, request_budget
from actors.netguard import UrlRefused, check_url
from actors.reasons import keeps_reason
from broker import app, db
from broker.enqueue import build_message, enqueue_message
from broker.errors import StandmeetError

logger = logging.getLogger(f"standmeet.{__name__}")

#: The largest feed read; a bigger one is an error on its source.
MAX_FEED_BYTES = 5 * 1024 * 1024
#: Total time for one fetch (shortened to what remains of the source's time limit).
FETCH_TIMEOUT_S = 30.0
KINDS = ("json", "rss")
#: The longest time limit a source may have (the fetch queue's own jobs are 60 s).
MAX_TIME_LIMIT_S = 3600.0

ADD_SOURCE = """
INSERT INTO standmeet.job_sources (url, kind, time_limit_s) VALUES (%s, %s, %s)
ON CONFLICT (url) DO UPDATE SET kind = EXCLUDED.kind, time_limit_s = EXCLUDED.time_limit_s
RETURNING id
"""
LIST_SOURCES = """
SELECT id, url, kind, time_limit_s, last_fetch_at, last_status, last_error, postings
FROM standmeet.job_sources ORDER BY id
"""
READ_SOURCE = "SELECT url, kind, etag, last_modified FROM standmeet.job_sources WHERE id = %s"
#: Forget the pending-fetch marks of fetches that ended (done or rejected for good).
CLEAR_FINISHED = """
DELETE FROM standmeet.source_fetches f
WHERE NOT EXISTS (SELECT 1 FROM dramatiq.queue q WHERE q.message_id = f.message_id
                  AND q.state IN ('queued', 'consumed'))
"""
SOURCES_WITHOUT_FETCH = """
SELECT s.id, s.time_limit_s FROM standmeet.job_sources s
WHERE NOT EXISTS (SELECT 1 FROM standmeet.source_fetches f WHERE f.source_id = s.id)
ORDER BY s.id
"""
MARK_FETCH = """
INSERT INTO standmeet.source_fetches (source_id, message_id) VALUES (%s, %s)
ON CONFLICT (source_id) DO NOTHING RETURNING source_id
"""
UPSERT_POSTING = """
INSERT INTO standmeet.job_postings (source_id, external_id, title, url, published)
VALUES (%(source)s, %(id)s, %(title)s, %(url)s, %(published)s)
ON CONFLICT (source_id, external_id) DO UPDATE
SET title = EXCLUDED.title, url = EXCLUDED.url, published = EXCLUDED.published, updated_at = now()
WHERE (job_postings.title, job_postings.url, job_postings.published)
      IS DISTINCT FROM (EXCLUDED.title, EXCLUDED.url, EXCLUDED.published)
"""
RECORD = """
UPDATE standmeet.job_sources
SET last_fetch_at = now(), last_status = %(status)s, last_error = %(error)s,
    etag = coalesce(%(etag)s, etag), last_modified = coalesce(%(last_modified)s, last_modified),
    postings = (SELECT count(*) FROM standmeet.job_postings WHERE source_id = %(id)s)
WHERE id = %(id)s
"""


class FeedError(StandmeetError):
    """A feed is broken or malformed; recorded on its source."""


@dataclass(frozen=True)
class Posting:
    external_id: str
    title: str
    url: str | None
    published: str | None


def check_time_limit(time_limit_s: object) -> float:
    """A source's time limit: a finite number of seconds, above 0 and at most MAX_TIME_LIMIT_S."""
    try:
        value = float(time_limit_s)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FeedError(f"the time limit {time_limit_s!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_TIME_LIMIT_S:
        raise FeedError(f"the time limit {time_limit_s!r} must be a finite number of seconds, "
                        f"above 0 and at most {MAX_TIME_LIMIT_S:g}")
    return value


def add_source(url: str, kind: str, *, time_limit_s: float = 60.0) -> int:
    """Register a source (the URL must pass the request-forgery guard)."""
    if kind not in KINDS:
        raise FeedError(f"unknown source kind {kind!r}; use json or rss")
    time_limit_s = check_time_limit(time_limit_s)
    check_url(url, allowed_networks=app_settings.current().allowed_networks)
    with db.connection() as conn:
        row = conn.execute(ADD_SOURCE, (url, kind, time_limit_s)).fetchone()
    assert row is not None
    return int(row[0])


def list_sources() -> list[dict[str, Any]]:
    with db.connection() as conn:
        rows = conn.execute(LIST_SOURCES).fetchall()
    keys = ("id", "url", "kind", "time_limit_s", "last_fetch_at", "last_status", "last_error", "postings")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def fetch_new() -> int:
    """Enqueue one fetch for every source that has none queued or running; returns how many."""
    queued = 0
    with db.connection() as conn, conn.transaction():
        conn.execute(CLEAR_FINISHED)
        for source_id, time_limit_s in conn.execute(SOURCES_WITHOUT_FETCH).fetchall():
            try:  # one bad source (a row written before the check existed) never stops the others
                limit_ms = int(check_time_limit(time_limit_s) * 1000)
            except FeedError as exc:
                logger.warning("source %s not fetched: %s", source_id, exc)
                conn.execute(RECORD, {"id": source_id, "status": "error", "error": f"not fetched: {exc}",
                                      "etag": None, "last_modified": None})
                continue
            message = build_message("jobs.fetch_source", (int(source_id),), options={"time_limit": limit_ms})
            if conn.execute(MARK_FETCH, (source_id, message.message_id)).fetchone() is not None:
                enqueue_message(conn, message)
                queued += 1
    return queued


def parse(kind: str, content: bytes) -> list[Posting]:
    """Postings of a JSON feed (a list, or {"jobs": [...]}) or an RSS/Atom feed."""
    if kind == "json":
        try:
            data = json.loads(content)
        except ValueError as exc:
            raise FeedError(f"malformed JSON feed: {exc}") from None
        items = data.get("jobs", data.get("items")) if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise FeedError("JSON feed has no list of jobs (expected a list, or an object with 'jobs')")
        postings = []
        for n, item in enumerate(items):
            if not isinstance(item, dict) or "id" not in item or "title" not in item:
                raise FeedError(f"JSON feed item {n} needs an 'id' and a 'title'")
            postings.append(Posting(str(item["id"]), str(item["title"]), item.get("url"), item.get("published")))
        return postings
    try:
        root = ET.fromstring(content)
    except ET.ParseError as exc:
        raise FeedError(f"malformed RSS/Atom feed: {exc}") from None
    atom = "{http://www.w3.org/2005/Atom}"
    postings = []
    for item in root.iter("item"):  # RSS 2.0
        guid = item.findtext("guid") or item.findtext("link")
        if not guid:
            raise FeedError("RSS item without a guid or a link")
        postings.append(Posting(guid, item.findtext("title") or "", item.findtext("link"), item.findtext("pubDate")))
    for entry in root.iter(f"{atom}entry"):  # Atom
        link = entry.find(f"{atom}link")
        href = link.get("href") if link is not None else None
        entry_id = entry.findtext(f"{atom}id") or href
        if not entry_id:
            raise FeedError("Atom entry without an id or a link")
        postings.append(Posting(entry_id, entry.findtext(f"{atom}title") or "", href, entry.findtext(f"{atom}updated")))
    if root.tag not in ("rss", f"{atom}feed") and not postings:
        raise FeedError(f"not an RSS or Atom feed (root element <{root.tag}>)")
    return postings


def _record(source_id: int, status: str, error: str | None, etag: str | None = None, last_modified: str | None = None) -> None:
    with db.connection() as conn:
        conn.execute(RECORD, {"id": source_id, "status": status, "error": error, "etag": etag,
                              "last_modified": last_modified})


def _finished(source_id: int) -> None:
    with db.connection() as conn:
        conn.execute("DELETE FROM standmeet.source_fetches WHERE source_id = %s", (source_id,))


@dramatiq.actor(actor_name="jobs.fetch_source", queue_name="fetch", throws=(FeedError, UrlRefused))
@keeps_reason
def fetch_source(source_id: int) -> None:
    with db.connection() as conn:
        row = conn.execute(READ_SOURCE, (source_id,)).fetchone()
    if row is None:
        return
    url, kind, etag, last_modified = row
    try:
        headers = {}
        if etag:
            headers["If-None-Match"] = etag
        if last_modified:
            headers["If-Modified-Since"] = last_modified
        try:  # no database connection is held during the request
            response = guarded_request("GET", url, allowed_networks=app_settings.current().allowed_networks,
                                       timeout_s=request_budget(FETCH_TIMEOUT_S), max_bytes=MAX_FEED_BYTES,
                                       refuse_larger=True,
                                       headers=headers)
        except ResponseTooLarge:
            raise FeedError(f"the feed is larger than {MAX_FEED_BYTES} bytes") from None
        except httpx.HTTPError as exc:
            raise FeedError(f"cannot fetch the feed: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 304:
            _record(source_id, "not modified", None)
            _finished(source_id)
            return
        if response.status_code != 200:
            raise FeedError(f"the feed answered HTTP {response.status_code}")
        body = response.body
        new_etag, new_modified = response.headers.get("ETag"), response.headers.get("Last-Modified")
        postings = parse(kind, body)
        with db.connection() as conn, conn.transaction():
            for p in postings:
                conn.execute(UPSERT_POSTING, {"source": source_id, "id": p.external_id, "title": p.title,
                                              "url": p.url, "published": p.published})
        _record(source_id, f"ok: {len(postings)} posting(s)", None, new_etag, new_modified)
        _finished(source_id)
    except (FeedError, UrlRefused) as exc:  # recorded on the source; no retry (the others go on)
        _record(source_id, "error", str(exc))
        _finished(source_id)
        logger.warning("source %s (%s): %s", source_id, url, exc)
        raise



@dramatiq.actor(actor_name="jobs.fetch_new", queue_name="maintenance")
def fetch_new_job() -> None:
    """The periodic form of :func:`fetch_new`: one fetch per source with none pending."""
    queued = fetch_new()
    if queued:
        logger.info("queued %d source fetch(es)", queued)


app.periodic("fetch-new", "jobs.fetch_new", interval_s=900)
