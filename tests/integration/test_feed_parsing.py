"""Feeds of every RSS version and Atom, and hostile XML, fetched from a real HTTP server on
loopback by a worker: the good ones give postings; a DTD, an entity bomb or an external
entity is refused with its reason on the source and the job, and the other sources go on."""

from __future__ import annotations

import pytest

from actors import jobboards
from actors import settings as app_settings
from broker.settings import replace
from tests.support.db import query, scalar, wait_for
from tests.support.webserver import Reply, web_server

RSS_091 = b"""<?xml version="1.0"?>
<rss version="0.91"><channel><title>Board</title><link>https://jobs.test/</link><description>d</description>
<item><title>Cobol maintainer</title><link>https://jobs.test/091-1</link><description>x</description></item>
</channel></rss>"""

RSS_090 = b"""<?xml version="1.0"?>
<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#" xmlns="http://my.netscape.com/rdf/simple/0.9/">
<channel><title>Board</title><link>https://jobs.test/</link><description>d</description></channel>
<item><title>Perl hacker</title><link>https://jobs.test/090-1</link></item>
</rdf:RDF>"""

RSS_10 = b"""<?xml version="1.0"?>
<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#" xmlns="http://purl.org/rss/1.0/"
         xmlns:dc="http://purl.org/dc/elements/1.1/">
<channel rdf:about="https://jobs.test/"><title>Board</title><link>https://jobs.test/</link>
  <items><rdf:Seq><rdf:li rdf:resource="https://jobs.test/10-1"/></rdf:Seq></items></channel>
<item rdf:about="https://jobs.test/10-1"><title>Semantic web engineer</title><link>https://jobs.test/10-1</link>
  <dc:date>2026-01-02T03:04:05Z</dc:date></item>
<item rdf:about="https://jobs.test/10-2"><title>  RDF librarian </title><link>https://jobs.test/10-2</link></item>
</rdf:RDF>"""

RSS_20 = b"""<?xml version="1.0"?><rss version="2.0"><channel><title>Board</title>
<item><guid isPermaLink="false">r2-1</guid><title>Rust engineer &amp; mentor</title><link>https://jobs.test/r2-1</link>
<pubDate>Fri, 02 Jan 2026 03:04:05 GMT</pubDate></item>
</channel></rss>"""

ATOM = b"""<?xml version="1.0" encoding="utf-8"?>
<feed xmlns="http://www.w3.org/2005/Atom"><title>Board</title><id>urn:board</id><updated>2026-01-02T00:00:00Z</updated>
<entry><id>urn:job:a-1</id><title>Postgres DBA</title><updated>2026-01-02T03:04:05Z</updated>
  <link rel="self" href="https://jobs.test/api/a-1"/><link href="https://jobs.test/a-1"/></entry>
</feed>"""

BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE rss [
 <!ENTITY lol "lol">
 <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
 <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
 <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
 <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
 <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
<rss version="2.0"><channel><item><guid>bomb</guid><title>&lol9;</title></item></channel></rss>"""

XXE = b"""<?xml version="1.0"?>
<!DOCTYPE rss [<!ENTITY xxe SYSTEM "file:///etc/hostname">]>
<rss version="2.0"><channel><item><guid>xxe</guid><title>&xxe;</title></item></channel></rss>"""

#: A DTD that declares no entity: harmless to expat, but a feed needs none and gets none.
WITH_DTD = b"""<?xml version="1.0"?>
<!DOCTYPE rss PUBLIC "-//Netscape Communications//DTD RSS 0.91//EN" "http://my.netscape.com/publish/formats/rss-0.91.dtd">
<rss version="0.91"><channel><item><title>Doctype job</title><link>https://jobs.test/dtd-1</link></item></channel></rss>"""


@pytest.fixture
def loopback_allowed(broker):
    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",)))
    yield
    app_settings.use(original)


def _serve_and_fetch(database_url: str, start_worker, feeds: dict[str, bytes]) -> tuple[dict[str, int], dict[int, tuple]]:
    """Serve each feed from a real loopback HTTP server, fetch every source through a worker;
    returns the sources by path and each one's (last_status, last_error)."""
    with web_server() as board:
        for path, body in feeds.items():
            board.on("GET", path, lambda r, body=body: Reply(200, body, {"Content-Type": "application/xml"}))
        sources = {path: jobboards.add_source(board.base + path, "rss") for path in feeds}
        ids = list(sources.values())
        assert jobboards.fetch_new() >= len(ids)
        start_worker(queues=["fetch"], threads=3)
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message->>'actor_name' ="
                                              " 'jobs.fetch_source' AND (message->'args'->>0)::bigint = ANY(%s)"
                                              " AND state IN ('done', 'rejected')", (ids,)) == len(ids),
                 timeout_s=30, what="every source's fetch to end")
    status = {row[0]: row[1:] for row in query(database_url, "SELECT id, last_status, last_error FROM standmeet.job_sources"
                                                             " WHERE id = ANY(%s)", (ids,))}
    return sources, status


def _postings(database_url: str, source: int) -> list[tuple]:
    return query(database_url, "SELECT external_id, title, url, published FROM standmeet.job_postings"
                               " WHERE source_id = %s ORDER BY external_id", (source,))


def test_rss_090_091_10_20_and_atom_feeds_each_give_their_postings(broker, database_url, start_worker,
                                                                   loopback_allowed):
    sources, status = _serve_and_fetch(database_url, start_worker, {
        "/rss090": RSS_090, "/rss091": RSS_091, "/rss10": RSS_10, "/rss20": RSS_20, "/atom": ATOM})
    assert {path: status[source] for path, source in sources.items()} == {
        "/rss090": ("ok: 1 posting(s)", None), "/rss091": ("ok: 1 posting(s)", None),
        "/rss10": ("ok: 2 posting(s)", None), "/rss20": ("ok: 1 posting(s)", None), "/atom": ("ok: 1 posting(s)", None)}
    assert _postings(database_url, sources["/rss090"]) == [
        ("https://jobs.test/090-1", "Perl hacker", "https://jobs.test/090-1", None)]
    assert _postings(database_url, sources["/rss091"]) == [
        ("https://jobs.test/091-1", "Cobol maintainer", "https://jobs.test/091-1", None)]
    assert _postings(database_url, sources["/rss10"]) == [
        ("https://jobs.test/10-1", "Semantic web engineer", "https://jobs.test/10-1", "2026-01-02T03:04:05Z"),
        ("https://jobs.test/10-2", "RDF librarian", "https://jobs.test/10-2", None)]
    assert _postings(database_url, sources["/rss20"]) == [
        ("r2-1", "Rust engineer & mentor", "https://jobs.test/r2-1", "Fri, 02 Jan 2026 03:04:05 GMT")]
    assert _postings(database_url, sources["/atom"]) == [
        ("urn:job:a-1", "Postgres DBA", "https://jobs.test/a-1", "2026-01-02T03:04:05Z")]


def test_a_dtd_an_entity_bomb_an_external_entity_or_an_oversized_feed_is_refused_with_its_reason_and_others_go_on(
    broker, database_url, start_worker, loopback_allowed
):
    oversized = RSS_20.replace(b"</channel>", b"<!--" + b"x" * jobboards.MAX_FEED_BYTES + b"--></channel>")
    sources, status = _serve_and_fetch(database_url, start_worker, {
        "/laughs": BILLION_LAUGHS, "/xxe": XXE, "/dtd": WITH_DTD, "/huge": oversized, "/good": RSS_20})
    reasons = {path: status[source] for path, source in sources.items()}
    for path in ("/laughs", "/xxe", "/dtd", "/huge"):
        assert reasons[path][0] == "error" and "\n" not in reasons[path][1], (path, reasons[path])
        assert _postings(database_url, sources[path]) == [], path
    assert "declares the entity 'lol'" in reasons["/laughs"][1] and "billion laughs" in reasons["/laughs"][1]
    assert "external entity 'xxe' (file:///etc/hostname)" in reasons["/xxe"][1] and "XXE" in reasons["/xxe"][1]
    assert "carries a DTD (<!DOCTYPE rss>)" in reasons["/dtd"][1]
    assert f"larger than {jobboards.MAX_FEED_BYTES} bytes" in reasons["/huge"][1]
    assert reasons["/good"] == ("ok: 1 posting(s)", None)  # the others go on
    # the reason is also on the job, which failed for good (no retry of a hostile feed)
    for path in ("/laughs", "/xxe", "/dtd"):
        job = query(database_url, "SELECT state::text, error FROM dramatiq.queue WHERE message->>'actor_name' ="
                                  " 'jobs.fetch_source' AND (message->'args'->>0)::bigint = %s", (sources[path],))
        assert len(job) == 1 and job[0][0] == "rejected" and reasons[path][1] in job[0][1], (path, job)
