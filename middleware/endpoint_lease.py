"""The endpoint lease (R3): at most one webhook delivery in flight per endpoint.

Before ``webhook.deliver`` runs, this middleware takes the endpoint's row lease with
one autocommit UPDATE (``busy_until = now() + lease``, a fresh token, only if the
endpoint is enabled and not busy). No row means the endpoint is busy: the message
snoozes (2 s plus jitter) without counting a retry or an attempt. After the actor —
returned, raised or cancelled — the lease is released, only if the token is still
ours. The lease outlives the job's time limit, so a crashed worker's lease expires
by itself. No transaction is held across the POST (R6): each statement commits alone.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from dramatiq import Middleware

from broker import app, db
from middleware.snooze import snooze_before_start

logger = logging.getLogger(__name__)

DELIVER_ACTOR = "webhook.deliver"

ENDPOINT_OF = """
SELECT d.endpoint_id, e.enabled FROM standmeet.webhook_deliveries d
JOIN standmeet.webhook_endpoints e ON e.id = d.endpoint_id WHERE d.id = %s
"""
TAKE = """
UPDATE standmeet.webhook_endpoints
SET busy_until = now() + make_interval(secs => %(lease_s)s), lease_token = gen_random_uuid()
WHERE id = %(id)s AND enabled AND (busy_until IS NULL OR busy_until < now())
RETURNING lease_token::text
"""
RELEASE = """
UPDATE standmeet.webhook_endpoints SET busy_until = NULL, lease_token = NULL
WHERE id = %(id)s AND lease_token = %(token)s::uuid
"""


class EndpointLease(Middleware):
    def before_process_message(self, broker: Any, message: Any) -> None:
        if message.actor_name != DELIVER_ACTOR or not message.args:
            return
        with db.connection() as conn:
            row = conn.execute(ENDPOINT_OF, (int(message.args[0]),)).fetchone()
            if row is None or not row[1]:
                return  # gone or disabled: the actor records the delivery as such, no lease needed
            endpoint_id = int(row[0])
            taken = conn.execute(TAKE, {"id": endpoint_id, "lease_s": app.setting("webhook_lease_s")}).fetchone()
        if taken is None:
            wait = app.setting("webhook_busy_snooze_s") * (1 + random.random() / 2)
            snooze_before_start(message, wait, f"endpoint {endpoint_id} is busy")
        message.endpoint_lease = (endpoint_id, taken[0])

    def _release(self, message: Any) -> None:
        lease = getattr(message, "endpoint_lease", None)
        if lease is None:
            return
        message.endpoint_lease = None
        endpoint_id, token = lease
        try:
            with db.connection() as conn:
                conn.execute(RELEASE, {"id": endpoint_id, "token": token})
        except Exception as exc:  # the lease then expires by itself
            logger.warning("could not release the lease of endpoint %s: %s", endpoint_id, exc)

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        self._release(message)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self._release(message)
