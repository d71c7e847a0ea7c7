"""Fixtures the integration tests of several modules share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from actors import settings as app_settings
from broker.settings import replace


@pytest.fixture
def webhook_settings(broker: Any) -> Iterator[Any]:
    """Loopback endpoints allowed, and a busy endpoint's deliveries snoozing 50 ms (not 2 s)."""
    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",), webhook_busy_snooze_s=0.05))
    yield broker.settings
    app_settings.use(original)
