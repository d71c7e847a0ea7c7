"""How failures are named: a webhook attempt's transport error, and how a run ended."""

from __future__ import annotations

import types

import httpx
import pytest

from actors.webhooks import _classify
from broker.errors import Deferred
from middleware.job_log import outcome_of

REQUEST = httpx.Request("POST", "https://hooks.example/endpoint")


@pytest.mark.parametrize("exc, name", [
    (httpx.ReadTimeout("timed out", request=REQUEST), "timeout"),
    (httpx.ConnectTimeout("timed out", request=REQUEST), "timeout"),
    (httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed", request=REQUEST), "tls"),
    (httpx.ConnectError("[Errno -2] Name or service not known", request=REQUEST), "dns"),
    (httpx.ConnectError("[Errno 111] Connection refused", request=REQUEST), "connect"),
    (httpx.RemoteProtocolError("Server disconnected without sending a response.", request=REQUEST), "connect"),
], ids=["read-timeout", "connect-timeout", "tls", "dns", "refused", "disconnected"])
def test_a_webhook_transport_error_is_named_by_its_kind(exc, name):
    assert _classify(exc) == name


def _message(**fields: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"failed": False, "_exception": None, **fields})


def test_a_run_is_done_when_it_raised_nothing_and_retry_when_it_raised_and_may_run_again():
    assert outcome_of(_message(), None) == "done"
    assert outcome_of(_message(), ValueError("boom")) == "retry"


def test_a_run_the_retry_policy_gave_up_on_is_rejected_whatever_it_raised():
    assert outcome_of(_message(failed=True), ValueError("boom")) == "rejected"
    assert outcome_of(_message(failed=True), None, skipped=True) == "rejected"


def test_a_skipped_run_is_snoozed_when_it_asked_to_run_later_and_skipped_otherwise():
    assert outcome_of(_message(_exception=Deferred("later")), None, skipped=True) == "snoozed"
    assert outcome_of(_message(), None, skipped=True) == "skipped"
