"""The dashboard's webhook pages, declared with ``broker.app.page``.

``/webhooks`` lists the endpoints with their health and the latest deliveries (one
endpoint's with ``?endpoint=ID``); ``/webhooks/deliveries/ID`` shows a delivery, its
attempts and (``?show=payload``, unless the dashboard hides arguments) its event's
payload. Its actions, POSTs with the dashboard's CSRF token, recorded as operator
actions: enable or disable an endpoint, and replay a delivery, which means what
``webhooks replay`` means (:func:`actors.webhooks.replay_in`: a new delivery message).

The dashboard's modules are imported when a page is asked for, not when the
application is loaded: a worker never imports the web stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg

from actors import webhook_views, webhooks
from broker import app

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

#: Deliveries the list shows.
DELIVERIES_SHOWN = 100


async def webhooks_page(request: Request) -> Response:
    from broker.dashboard.app import MAX_ROW_ID, render, whole_number, with_conn

    raw = request.query_params.get("endpoint", "").strip()
    endpoint_id = whole_number("endpoint", raw, low=1, high=MAX_ROW_ID) if raw else None

    def read(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        return {"endpoints": webhook_views.endpoints(conn),
                "deliveries": webhook_views.webhook_deliveries(conn, endpoint_id, limit=DELIVERIES_SHOWN)}

    return render(request, "dashboard_webhooks.html", {**await with_conn(request, read), "endpoint_id": endpoint_id})


async def delivery_page(request: Request) -> Response:
    from broker import ops
    from broker.dashboard.app import config_of, render, row_id, with_conn
    from broker.dashboard.security import quoted

    config = config_of(request)
    delivery_id = row_id("delivery id", request.path_params["id"])
    show = request.query_params.get("show", "")
    if show not in ("", "payload"):
        raise ops.OpsError(f"show must be payload or absent, not {quoted(show)}")
    show_payload = show == "payload" and not config.hide_args

    def read(conn: psycopg.Connection[Any]) -> dict[str, Any] | None:
        found = webhook_views.deliveries(conn, delivery_id=delivery_id, limit=1)
        if not found:
            return None
        return {"delivery": found[0], "attempts": webhook_views.attempts(conn, delivery_id),
                "payload": webhook_views.payload(conn, delivery_id) if show_payload else None}

    data = await with_conn(request, read)
    if data is None:
        return render(request, "not_found.html", {"what": f"webhook delivery {delivery_id}"}, status_code=404)
    return render(request, "dashboard_delivery.html", {**data, "show_payload": show_payload})


async def delivery_replay(request: Request) -> Response:
    from broker import ops
    from broker.dashboard.app import Refused, action_form, actor_of, redirect, row_id, with_conn

    await action_form(request)
    delivery_id = row_id("delivery id", request.path_params["id"])
    by, source = actor_of(request)

    def act(conn: psycopg.Connection[Any]) -> str | None:
        with conn.transaction():
            message_id = webhooks.replay_in(conn, delivery_id)
            if message_id is not None:
                ops.record_action(conn, action="webhooks.replay",
                                  target={"delivery_id": delivery_id, "message_ids": [message_id]},
                                  by=by, source=source, affected=1)
        return message_id

    if await with_conn(request, act) is None:
        raise Refused(404, f"no webhook delivery {delivery_id}")
    return redirect(f"/webhooks/deliveries/{delivery_id}", "replayed")


async def _endpoint_toggle(request: Request, enabled: bool) -> Response:
    from broker import ops
    from broker.dashboard.app import Refused, action_form, actor_of, redirect, row_id, with_conn

    await action_form(request)
    endpoint_id = row_id("endpoint id", request.path_params["id"])
    by, source = actor_of(request)

    def act(conn: psycopg.Connection[Any]) -> bool:
        with conn.transaction():
            found = webhooks.set_enabled_in(conn, endpoint_id, enabled, reason=f"disabled by {by} ({source})")
            if found:
                ops.record_action(conn, action="webhooks.enable" if enabled else "webhooks.disable",
                                  target={"endpoint_id": endpoint_id}, by=by, source=source, affected=1)
        return found

    if not await with_conn(request, act):
        raise Refused(404, f"no webhook endpoint {endpoint_id}")
    return redirect("/webhooks", "enabled" if enabled else "disabled")


async def endpoint_enable(request: Request) -> Response:
    return await _endpoint_toggle(request, True)


async def endpoint_disable(request: Request) -> Response:
    return await _endpoint_toggle(request, False)


TEMPLATES = ("actors", "templates")

app.page("/webhooks", webhooks_page, title="Webhooks", templates=TEMPLATES)
app.page("/webhooks/deliveries/{id:int}", delivery_page, templates=TEMPLATES)
app.page("/webhooks/deliveries/{id:int}/replay", delivery_replay, methods=("POST",))
app.page("/webhooks/endpoints/{id:int}/enable", endpoint_enable, methods=("POST",))
app.page("/webhooks/endpoints/{id:int}/disable", endpoint_disable, methods=("POST",))
app.dashboard_notice("enabled", "Endpoint enabled.")
app.dashboard_notice("disabled", "Endpoint disabled.")
app.dashboard_notice("replayed", "Delivery queued again.")
