"""The fetch queue: job sources (JSON, RSS 0.9x, RSS 1.0, RSS 2.0 or Atom feeds) and their postings.

``jobs.fetch_source(source_id)`` fetches one source with a conditional request
(``If-None-Match`` / ``If-Modified-Since``), parses it and upserts its postings
idempotently; a 304 transfers nothing. At most one fetch per source is queued or
running at any time: ``standmeet.source_fetches`` has the source as its primary key,
and :func:`fetch_new` inserts there and enqueues in one transaction (a unique
constraint, not a check-then-insert). A broken or malformed feed records a clear
error on its source; the other sources go on. XML is parsed by ``defusedxml``: a feed
carrying a DTD (entity expansion, external entities) is refused, the reason recorded.

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

import defusedxml
import defusedxml.ElementTree as defused
import dramatiq
import httpx

from actors import settings as app_settings
from actors.http import ResponseTooLarge, guarded_request, request_budget
from actors.netguard import UrlRefused, check_url
from actors.reasons import keeps_reason
from broker import app
from broker.engine.enqueue import build_message, enqueue_message
from broker.errors import StandmeetError
from broker.pg import db

logger = logging.getLogger(f"standmeet.{__name__}")

#: The largest feed read; a bigger one is an error on its source.
MAX_FEED_BYTES = 5 * 1024 * 1024
#: Total time for one fetch (shortened to what remains of the source's time limit).
FETCH_TIMEOUT_S = 30.0
KINDS = ("json", "rss")
#: The namespaces of the feed formats read: RSS 0.90 and 1.0 are RDF; 0.91-0.94 and 2.0 have none.
RDF_NS = "http://www.w3.org/1999/02/22-rdf-syntax-ns#"
RSS090_NS = "http://my.netscape.com/rdf/simple/0.9/"
RSS10_NS = "http://purl.org/rss/1.0/"
DC_NS = "http://purl.org/dc/elements/1.1/"
ATOM_NS = "http://www.w3.org/2005/Atom"
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
    """Postings of a JSON feed (a list, or {"jobs": [...]}) or an RSS 0.9x, RSS 1.0 (RDF),
    RSS 2.0 or Atom feed. A feed carrying a DTD is refused (see :func:`xml_root`)."""
    if kind == "json":
        return _parse_json(content)
    root = xml_root(content)
    if root.tag == "rss":  # RSS 0.91 to 0.94 and 2.0: no namespace
        return [_rss_item(item, "") for item in root.iter("item")]
    if root.tag == f"{{{RDF_NS}}}RDF":  # RSS 0.90 and 1.0: RDF, items beside the channel
        return [_rss_item(item, ns) for ns in (RSS10_NS, RSS090_NS) for item in root.iter(f"{{{ns}}}item")]
    if root.tag == f"{{{ATOM_NS}}}feed":
        return [_atom_entry(entry) for entry in root.iter(f"{{{ATOM_NS}}}entry")]
    raise FeedError(f"not an RSS or Atom feed (root element <{_shown(root.tag)}>)")


def _parse_json(content: bytes) -> list[Posting]:
    try:
        data = json.loads(content)
    except (ValueError, RecursionError) as exc:
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise FeedError(f"malformed JSON feed: {what}") from None
    items = data.get("jobs", data.get("items")) if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise FeedError("JSON feed has no list of jobs (expected a list, or an object with 'jobs')")
    postings = []
    for n, item in enumerate(items):
        if not isinstance(item, dict) or "id" not in item or "title" not in item:
            raise FeedError(f"JSON feed item {n} needs an 'id' and a 'title'")
        postings.append(Posting(str(item["id"]), str(item["title"]), item.get("url"), item.get("published")))
    return postings


def xml_root(content: bytes) -> ET.Element:
    """The root element of an XML feed, parsed by ``defusedxml``: a DTD (and so any entity
    declaration, billion laughs or external entity) is refused, in one line saying what it held."""
    try:
        return defused.fromstring(content, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except defusedxml.DTDForbidden as exc:
        raise FeedError(_dtd_reason(content, exc)) from None
    except (defusedxml.EntitiesForbidden, defusedxml.ExternalReferenceForbidden) as exc:
        raise FeedError(_entity_reason(exc)) from None
    except ET.ParseError as exc:
        raise FeedError(f"malformed RSS/Atom feed: {exc}") from None


def _dtd_reason(content: bytes, refused: defusedxml.DTDForbidden) -> str:
    """Why a feed with a DTD is refused: what the DTD declares, when it declares an entity."""
    try:  # stops at the first entity declaration: nothing is expanded or fetched
        defused.fromstring(content, forbid_dtd=False, forbid_entities=True, forbid_external=True)
    except (defusedxml.EntitiesForbidden, defusedxml.ExternalReferenceForbidden) as exc:
        return _entity_reason(exc)
    except ET.ParseError:
        pass
    return (f"refused: the feed carries a DTD (<!DOCTYPE {_shown(refused.name)}>); a feed needs none, "
            "and a DTD can declare entities that expand or read files")


def _entity_reason(exc: Exception) -> str:
    name = _shown(getattr(exc, "name", None) or "?")
    sysid, pubid = getattr(exc, "sysid", None), getattr(exc, "pubid", None)
    if sysid or pubid or isinstance(exc, defusedxml.ExternalReferenceForbidden):
        return (f"refused: the feed declares the external entity {name!r} ({_shown(sysid or pubid or '?')}), "
                "which would read a file or another host (XXE)")
    return (f"refused: the feed declares the entity {name!r} in a DTD; entities can expand a small feed "
            "into gigabytes (billion laughs)")


def _shown(text: object, limit: int = 80) -> str:
    """Text from a feed, fit for a one-line error: control characters replaced, cut at ``limit``."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return clean if len(clean) <= limit else clean[:limit] + "…"


def _text(element: ET.Element, tag: str) -> str | None:
    found = element.findtext(tag)
    return found.strip() if found is not None and found.strip() else None


def _rss_item(item: ET.Element, ns: str) -> Posting:
    """An RSS item: ``ns`` is "" for RSS 0.91-0.94 and 2.0, the RDF feed's namespace for 0.90 and 1.0."""
    q = f"{{{ns}}}" if ns else ""
    link = _text(item, f"{q}link")
    about = item.get(f"{{{RDF_NS}}}about")
    guid = _text(item, "guid") if not ns else about
    external_id = guid or link
    if not external_id:
        raise FeedError("RSS item without a guid or a link")
    published = _text(item, "pubDate") if not ns else _text(item, f"{{{DC_NS}}}date")
    return Posting(external_id, _text(item, f"{q}title") or "", link, published)


def _atom_entry(entry: ET.Element) -> Posting:
    links = entry.findall(f"{{{ATOM_NS}}}link")
    alternate = [link for link in links if link.get("rel", "alternate") == "alternate"]
    href = next((link.get("href") for link in alternate + links if link.get("href")), None)
    entry_id = _text(entry, f"{{{ATOM_NS}}}id") or href
    if not entry_id:
        raise FeedError("Atom entry without an id or a link")
    published = _text(entry, f"{{{ATOM_NS}}}updated") or _text(entry, f"{{{ATOM_NS}}}published")
    return Posting(entry_id, _text(entry, f"{{{ATOM_NS}}}title") or "", href, published)


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
