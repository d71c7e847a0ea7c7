"""The write path: store a document, enqueue its index jobs, wait for them.

    result = write_document("Title", "body text")
    # {"id": 17, "wiki_id": 18, "indexed": True, "waited_ms": 4.1}

One transaction stores the raw document and its wiki page and enqueues one
``corpus.index`` job for each; the waiter is registered before the commit, so the
receipts of fast jobs cannot be missed. Then it waits (2 s by default) for both to be
indexed. ``indexed: false`` means "not yet" — the jobs still run; it is never an error.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from typing import Any

from actors import settings as app_settings
from broker import services
from broker.engine.enqueue import enqueue
from broker.errors import StandmeetError
from broker.outbox.receipts import channel_for
from broker.pg import db
from broker.services import current_broker

#: The longest a write waits for its receipts (the bound of STANDMEET_RECEIPT_WAIT_S).
MAX_WAIT_S = 3_600.0

INSERT_DOCUMENT = """
INSERT INTO standmeet.documents (title, body, kind) VALUES (%(title)s, %(body)s, %(kind)s) RETURNING id
"""


def wiki_page(title: str, body: str) -> tuple[str, str]:
    """The derived wiki page of a raw document (its first paragraph, titled)."""
    first = body.strip().split("\n\n", 1)[0]
    return f"{title} (wiki)", first


class DocumentRefused(StandmeetError):
    """A document cannot be stored (too large, or holding what Postgres cannot store)."""


def check_document(title: str, body: str, *, max_bytes: int) -> None:
    """Refuse, before anything is written, what must not be stored."""
    for part, text in (("title", title), ("body", body)):
        if "\x00" in text:
            raise DocumentRefused(f"the document's {part} holds a NUL (\\0) character, which cannot be stored")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise DocumentRefused(f"the document's {part} is not valid Unicode (a lone surrogate)") from None
    size = len(title.encode("utf-8")) + len(body.encode("utf-8"))
    if size > max_bytes:
        raise DocumentRefused(f"the document is {size} bytes, over the limit of {max_bytes} "
                              "(STANDMEET_DOCUMENT_MAX_BYTES)")


def write_document(title: str, body: str, *, wait_s: float | None = None, wiki_delay_ms: int = 0) -> dict[str, Any]:
    """Store a document and its wiki page, index both, and wait up to ``wait_s``.

    Raises :class:`DocumentRefused` before writing anything for a document over
    ``STANDMEET_DOCUMENT_MAX_BYTES`` or holding a NUL character, or for a wait that is
    not a finite number of seconds from 0 to :data:`MAX_WAIT_S`.
    """
    broker = current_broker()
    check_document(title, body, max_bytes=app_settings.current().document_max_bytes)
    wait_s = broker.settings.receipt_wait_s if wait_s is None else wait_s
    if not (math.isfinite(wait_s) and 0 <= wait_s <= MAX_WAIT_S):  # before anything is written
        raise DocumentRefused(f"the wait {wait_s!r} must be a finite number of seconds from 0 to {MAX_WAIT_S:g}")
    channel = channel_for("index")
    with ExitStack() as waiting:
        with db.connection() as conn, conn.transaction():
            raw = conn.execute(INSERT_DOCUMENT, {"title": title, "body": body, "kind": "raw"}).fetchone()
            wiki_title, wiki_body = wiki_page(title, body)
            wiki = conn.execute(INSERT_DOCUMENT, {"title": wiki_title, "body": wiki_body, "kind": "wiki"}).fetchone()
            assert raw is not None and wiki is not None
            jobs = [
                enqueue(conn, "corpus.index", int(raw[0])),
                enqueue(conn, "corpus.index", int(wiki[0]), delay_ms=wiki_delay_ms or None),
            ]
            # Register before the commit: a job that finishes at once is still seen.
            waiter = waiting.enter_context(services.current().waiters.expect(channel, [m.message_id for m in jobs]))
        # Committed, and the connection is back in the pool: the wait holds none.
        start = time.monotonic()
        indexed = waiter is not None and waiter.wait(wait_s)
        waited = time.monotonic() - start
    return {"id": int(raw[0]), "wiki_id": int(wiki[0]), "indexed": indexed, "waited_ms": round(waited * 1000, 1)}
