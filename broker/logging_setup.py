"""Logging for every process of standmeet-jobs: one line a record, as text or JSON.

``configure_logging("json")`` writes one JSON object a line (for log shippers):
``ts``, ``level``, ``logger``, ``message``, ``pid``, the exception if any, and every
field passed with ``extra=`` (the per-job line carries ``actor``, ``message_id``,
``queue``, ``duration_ms``, ``outcome`` and ``attempt``). Text is the default.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

TEXT_FORMAT = "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: str = "text", *, level: int = logging.INFO) -> None:
    """Replace the root logger's handlers with one on stderr, in ``fmt`` (text or json)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def masked_url(url: str) -> str:
    """A database URL or conninfo with its password masked, for logs."""
    try:
        params = conninfo_to_dict(url)
    except Exception:  # not parseable: say nothing of it
        return "(unparseable database URL)"
    if params.get("password"):
        params["password"] = "***"
    return make_conninfo("", **params)
