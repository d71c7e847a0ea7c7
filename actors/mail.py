"""Mail on the notify queue: templates, SMTP, and retries that do not look like new mail.

Each mail is rendered from ``templates/<name>.txt`` (its first line is ``Subject: …``)
and ``templates/<name>.html`` (values HTML-escaped), and sent with smtplib to
``STANDMEET_SMTP_HOST:PORT`` (STARTTLS and login when configured). Its Message-ID is
derived from the job's message id, so a retry carries the same Message-ID and the
recipient's mail system sees one mail, not two.

A permanent rejection (5xx) fails the job at once, without retry; a temporary one
(4xx, connection refused, a timeout) is retried with back-off. No database connection
is held while talking to the SMTP server.
"""

from __future__ import annotations

import hashlib
import html
import logging
import smtplib
from dataclasses import dataclass
from datetime import datetime, timezone
from email.message import EmailMessage
from email.utils import formatdate
from importlib import resources
from string import Template
from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage

from actors import settings as app_settings
from actors.reasons import keeps_reason
from broker import deadline
from broker.errors import StandmeetError

logger = logging.getLogger(f"standmeet.{__name__}")

TEMPLATES = ("owner_notify", "approval", "confirmation", "test")


class MailError(StandmeetError):
    """Mail could not be sent."""


class PermanentMailError(MailError):
    """The SMTP server refused the mail for good (5xx): retrying would not help."""


class TemporaryMailError(MailError):
    """The SMTP server could not take the mail now (4xx, unreachable): retry later."""


@dataclass(frozen=True)
class Rendered:
    subject: str
    text: str
    html: str


def render(template: str, context: dict[str, Any]) -> Rendered:
    """Render ``template`` (plain text and HTML); a missing value is a clear error."""
    if template not in TEMPLATES:
        raise PermanentMailError(f"unknown mail template {template!r}; the templates are {', '.join(TEMPLATES)}")
    folder = resources.files("actors").joinpath("templates")
    text_source = folder.joinpath(f"{template}.txt").read_text(encoding="utf-8")
    html_source = folder.joinpath(f"{template}.html").read_text(encoding="utf-8")
    try:
        text = Template(text_source).substitute(context)
        body_html = Template(html_source).substitute({k: html.escape(str(v)) for k, v in context.items()})
    except KeyError as exc:
        raise PermanentMailError(f"mail template {template!r} needs the value {exc.args[0]!r}") from None
    first, _, rest = text.partition("\n")
    if not first.startswith("Subject:"):
        raise PermanentMailError(f"mail template {template!r} must start with a 'Subject:' line")
    return Rendered(first.removeprefix("Subject:").strip(), rest.lstrip("\n"), body_html)


def stable_message_id(key: str, domain: str) -> str:
    """A Message-ID that is the same for every attempt of one job."""
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
    return f"<{digest}@{domain}>"


def build(to: str, rendered: Rendered, *, sender: str, key: str) -> EmailMessage:
    mail = EmailMessage()
    mail["From"] = sender
    mail["To"] = to
    mail["Subject"] = rendered.subject
    mail["Date"] = formatdate(localtime=False)
    mail["Message-ID"] = stable_message_id(key, sender.rpartition("@")[2] or "standmeet")
    mail.set_content(rendered.text)
    mail.add_alternative(rendered.html, subtype="html")
    return mail


def send(mail: EmailMessage) -> None:
    """Send over SMTP; translate smtplib's errors into permanent or temporary ones."""
    settings = app_settings.current()
    timeout = deadline.cap_timeout(settings.smtp_timeout_s)
    try:
        with smtplib.SMTP(settings.smtp_host, settings.smtp_port, timeout=timeout) as smtp:
            if settings.smtp_starttls:
                smtp.starttls()
            if settings.smtp_username:
                smtp.login(settings.smtp_username, settings.smtp_password or "")
            smtp.send_message(mail)
    except smtplib.SMTPRecipientsRefused as exc:
        codes = [code for code, _ in exc.recipients.values()]
        if all(500 <= code < 600 for code in codes):
            raise PermanentMailError(f"recipient refused: {exc.recipients}") from exc
        raise TemporaryMailError(f"recipient deferred: {exc.recipients}") from exc
    except smtplib.SMTPResponseException as exc:
        if 500 <= exc.smtp_code < 600:
            raise PermanentMailError(f"SMTP {exc.smtp_code}: {exc.smtp_error!r}") from exc
        raise TemporaryMailError(f"SMTP {exc.smtp_code}: {exc.smtp_error!r}") from exc
    except (TimeoutError, smtplib.SMTPException, OSError) as exc:
        raise TemporaryMailError(f"cannot reach {settings.smtp_host}:{settings.smtp_port}: {exc}") from exc


def _job_key() -> str:
    message = CurrentMessage.get_current_message()
    return message.message_id if message is not None else datetime.now(timezone.utc).isoformat()


def deliver(to: str, template: str, context: dict[str, Any]) -> str:
    """Render and send one mail as the current job; returns its Message-ID."""
    settings = app_settings.current()
    mail = build(to, render(template, context), sender=settings.smtp_from, key=_job_key())
    send(mail)
    logger.info("mail %s (%s) sent to %s", mail["Message-ID"], template, to)
    return str(mail["Message-ID"])


MAIL_OPTIONS: dict[str, Any] = {"queue_name": "notify", "throws": (PermanentMailError,)}


@dramatiq.actor(actor_name="owner.notify", **MAIL_OPTIONS)
@keeps_reason
def owner_notify(to: str, name: str, subject: str, text: str) -> None:
    """Tell an owner something happened."""
    deliver(to, "owner_notify", {"name": name, "subject": subject, "text": text})


@dramatiq.actor(actor_name="mail.approval", **MAIL_OPTIONS)
@keeps_reason
def approval(to: str, name: str, requester: str, item: str, link: str) -> None:
    deliver(to, "approval", {"name": name, "requester": requester, "item": item, "link": link})


@dramatiq.actor(actor_name="mail.confirmation", **MAIL_OPTIONS)
@keeps_reason
def confirmation(to: str, name: str, item: str) -> None:
    deliver(to, "confirmation", {"name": name, "item": item})


@dramatiq.actor(actor_name="mail.test", **MAIL_OPTIONS)
@keeps_reason
def test_mail(to: str) -> None:
    """What ``standmeet-jobs mail test ADDRESS`` sends."""
    deliver(to, "test", {"sent_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
