"""A real SMTP server on loopback (aiosmtpd) that records mail and can refuse it."""

from __future__ import annotations

import email
import email.policy
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import EmailMessage

from aiosmtpd.controller import Controller


@dataclass
class Mailbox:
    received: list[EmailMessage] = field(default_factory=list)
    #: replies to give, in order, before accepting (e.g. "451 try later", "550 no such user")
    refusals: list[str] = field(default_factory=list)
    attempts: int = 0

    async def handle_DATA(self, server, session, envelope) -> str:  # noqa: ANN001  (aiosmtpd's hook)
        self.attempts += 1
        if self.refusals:
            return self.refusals.pop(0)
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        self.received.append(message)  # type: ignore[arg-type]
        return "250 OK"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def smtp_server() -> Iterator[tuple[int, Mailbox]]:
    """Serve SMTP on a free loopback port (aiosmtpd checks readiness on the real port)."""
    mailbox = Mailbox()
    port = _free_port()
    controller = Controller(mailbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield port, mailbox
    finally:
        controller.stop()
