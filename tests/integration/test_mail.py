"""Mail on the notify queue, to a real SMTP server on loopback."""

from __future__ import annotations

import pytest

from actors import mail
from actors import settings as app_settings
from broker.settings import replace
from tests.support.db import query, wait_for
from tests.support.smtp import smtp_server


def _final_state(database_url: str, message_id: str) -> str:
    def settled():
        rows = query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s", (message_id,))
        return rows[0][0] if rows and rows[0][0] in ("done", "rejected") else None

    return wait_for(settled, timeout_s=15, what=f"mail job {message_id}")


@pytest.fixture
def mailbox(broker):
    original = app_settings.current()
    with smtp_server() as (port, box):
        app_settings.use(replace(original, smtp_host="127.0.0.1", smtp_port=port, smtp_from="jobs@standmeet.test"))
        yield box
    app_settings.use(original)


def test_an_owner_notification_arrives_with_its_headers_and_both_bodies(broker, database_url, start_worker, mailbox):
    start_worker(queues=["notify"], threads=2)
    job = mail.owner_notify.send("ana@example.test", "Ana", "Your export is ready", "It has 3 files <b>now</b>.")
    assert _final_state(database_url, job.message_id) == "done"
    (received,) = mailbox.received
    assert received["To"] == "ana@example.test"
    assert received["From"] == "jobs@standmeet.test"
    assert received["Subject"] == "Your export is ready"
    assert received["Message-ID"] == mail.stable_message_id(job.message_id, "standmeet.test")
    plain = received.get_body(("plain",)).get_content()
    rich = received.get_body(("html",)).get_content()
    assert "Hello Ana," in plain and "It has 3 files <b>now</b>." in plain
    assert "It has 3 files &lt;b&gt;now&lt;/b&gt;." in rich  # values are escaped in HTML


def test_a_temporary_refusal_is_retried_with_the_same_message_id(broker, database_url, start_worker, mailbox):
    mailbox.refusals.append("451 4.3.0 try again later")
    start_worker(queues=["notify"], threads=2)
    job = mail.confirmation.send_with_options(args=("bo@example.test", "Bo", "Order 7"), min_backoff=10, max_backoff=50)
    assert _final_state(database_url, job.message_id) == "done"
    assert mailbox.attempts == 2
    (received,) = mailbox.received
    assert received["Message-ID"] == mail.stable_message_id(job.message_id, "standmeet.test")
    (retries,) = query(database_url, "SELECT (message->'options'->>'retries')::int FROM dramatiq.queue WHERE message_id = %s",
                       (job.message_id,))[0]
    assert retries == 1


def test_a_permanent_refusal_fails_without_retry(broker, database_url, start_worker, mailbox):
    mailbox.refusals.append("550 5.1.1 no such user")
    start_worker(queues=["notify"], threads=2)
    job = mail.approval.send_with_options(args=("nobody@example.test", "N", "Cy", "Budget", "https://x.test/a"),
                                          min_backoff=10, max_backoff=50)
    assert _final_state(database_url, job.message_id) == "rejected"
    assert mailbox.attempts == 1
    assert mailbox.received == []
    # the rejected message keeps why: the exception's type and message, not the bare word 'failed'
    error = query(database_url, "SELECT error FROM dramatiq.queue WHERE message_id = %s", (job.message_id,))[0][0]
    assert error.startswith("PermanentMailError: recipient refused") or error.startswith("PermanentMailError: SMTP 550")
    assert "no such user" in error


def test_an_unreachable_server_is_a_temporary_failure(broker, database_url, start_worker):
    original = app_settings.current()
    app_settings.use(replace(original, smtp_host="127.0.0.1", smtp_port=1))  # nothing listens there
    try:
        start_worker(queues=["notify"], threads=2)
        job = mail.test_mail.send_with_options(args=("x@example.test",), max_retries=1, min_backoff=10, max_backoff=20)
        assert _final_state(database_url, job.message_id) == "rejected"
        (retries, tb) = query(database_url, "SELECT (message->'options'->>'retries')::int, message->'options'->>'traceback'"
                              " FROM dramatiq.queue WHERE message_id = %s", (job.message_id,))[0]
        assert retries == 2  # tried, retried once, then given up: it was treated as temporary
        assert "TemporaryMailError" in tb and "cannot reach 127.0.0.1:1" in tb
    finally:
        app_settings.use(original)


def test_a_template_value_that_is_missing_is_a_clear_permanent_error():
    with pytest.raises(mail.PermanentMailError, match="needs the value 'item'"):
        mail.render("confirmation", {"name": "x"})
