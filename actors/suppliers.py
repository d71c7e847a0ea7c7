"""``supplier.invoke``: call a supplier's API (notify queue), recording request and outcome.

The call is a row (``standmeet.supplier_calls``) written in the caller's transaction
with :func:`request_call`, which enqueues the job in the same transaction. The job
reads the row (a short read), POSTs holding no database connection through the
request-forgery guard (``actors.http.guarded_request``: the address checked at each
attempt, a total deadline shorter than the queue's 30 s limit, the response read up to
16 KiB), then records the outcome. A URL the guard refuses fails for good. A 2xx succeeds;
a 4xx fails for good (retrying the same request would not help); a 5xx, a timeout or a
refused connection is retried with back-off.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import dramatiq
import httpx
import psycopg

from actors import settings as app_settings
from actors.http import guarded_request, request_budget
from actors.netguard import UrlRefused, UrlUnresolved, check_url
from actors.reasons import keeps_reason
from broker.engine.enqueue import enqueue
from broker.errors import StandmeetError
from broker.pg import db

logger = logging.getLogger(f"standmeet.{__name__}")

#: Total time for one call: connect, send and read together (< the 30 s job limit).
SUPPLIER_TIMEOUT_S = 10.0
#: Response bodies are read (and kept) up to this size; the rest is never read.
RESPONSE_CAP = 16 * 1024

INSERT = "INSERT INTO standmeet.supplier_calls (supplier, url, payload) VALUES (%s, %s, %s::jsonb) RETURNING id"
READ = "SELECT supplier, url, payload FROM standmeet.supplier_calls WHERE id = %s"
RECORD = """
UPDATE standmeet.supplier_calls
SET attempts = attempts + 1, status = %(status)s, status_code = %(code)s, response = %(response)s,
    error = %(error)s, finished_at = CASE WHEN %(status)s = 'pending' THEN NULL ELSE now() END
WHERE id = %(id)s
"""



class SupplierRefused(StandmeetError):
    """The supplier answered 4xx: the request is wrong, retrying would not help."""


class SupplierUnavailable(StandmeetError):
    """The supplier answered 5xx or could not be reached: retry later."""


def request_call(conn: psycopg.Connection[Any], supplier: str, url: str, payload: dict[str, Any]) -> int:
    """Record a call and enqueue ``supplier.invoke`` for it, in the caller's transaction.

    A URL the request-forgery guard refuses raises :class:`UrlRefused` before anything is
    written (the caller's transaction can still commit); it is checked again at each attempt.
    """
    check_url(url, allowed_networks=app_settings.current().allowed_networks)
    row = conn.execute(INSERT, (supplier, url, json.dumps(payload))).fetchone()
    assert row is not None
    enqueue(conn, "supplier.invoke", int(row[0]))
    return int(row[0])


def _record(call_id: int, status: str, code: int | None, response: str | None, error: str | None) -> None:
    with db.connection() as conn:
        conn.execute(RECORD, {"id": call_id, "status": status, "code": code, "response": response, "error": error})


@dramatiq.actor(actor_name="supplier.invoke", queue_name="notify", throws=(SupplierRefused,))
@keeps_reason
def invoke(call_id: int) -> None:
    with db.connection() as conn:
        row = conn.execute(READ, (call_id,)).fetchone()
    if row is None:
        logger.warning("supplier call %s no longer exists", call_id)
        return
    supplier, url, payload = row
    try:  # no connection is held from here to the outcome
        response = guarded_request(
            "POST", url, allowed_networks=app_settings.current().allowed_networks,
            timeout_s=request_budget(SUPPLIER_TIMEOUT_S), max_bytes=RESPONSE_CAP,
            headers={"Content-Type": "application/json"}, content=json.dumps(payload).encode())
    except UrlUnresolved as exc:  # DNS may answer next time: retried, as a failed connection is
        _record(call_id, "pending", None, None, str(exc))
        raise SupplierUnavailable(f"{supplier}: {exc}") from exc
    except UrlRefused as exc:  # the URL is forbidden: retrying cannot help
        _record(call_id, "failed", None, None, f"refused by the request-forgery guard: {exc}")
        raise SupplierRefused(f"{supplier}: call {call_id}: {exc}") from exc
    except httpx.HTTPError as exc:
        _record(call_id, "pending", None, None, f"{type(exc).__name__}: {exc}")
        raise SupplierUnavailable(f"{supplier}: {type(exc).__name__}: {exc}") from exc
    body = response.text
    if 200 <= response.status_code < 300:
        _record(call_id, "succeeded", response.status_code, body, None)
    elif 400 <= response.status_code < 500:
        _record(call_id, "failed", response.status_code, body, f"refused with {response.status_code}")
        raise SupplierRefused(f"{supplier} refused call {call_id} with {response.status_code}")
    else:
        _record(call_id, "pending", response.status_code, body, f"answered {response.status_code}")
        raise SupplierUnavailable(f"{supplier} answered {response.status_code}")
