"""Logging for every process of standmeet-jobs: one line a record, as text or JSON.

``configure_logging("json")`` writes one JSON object a line (for log shippers):
``ts``, ``level``, ``logger``, ``message``, ``pid``, the exception if any, and every
field passed with ``extra=`` (the per-job line carries ``actor``, ``message_id``,
``queue``, ``duration_ms``, ``outcome`` and ``attempt``). Text is the default.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, TextIO

from broker import detach  # a process of ours owns its threads through detach

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

TEXT_FORMAT = "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"

#: This process's id, as the per-job line shows it (a system call each time otherwise);
#: a forked child takes its own.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


#: ``,000`` to ``,999``: a line's milliseconds.
_MILLIS = tuple(f",{ms:03d}" for ms in range(1000))


class TextFormatter(logging.Formatter):
    """The text format, with the date part of each timestamp made once a second (the
    stock formatter calls localtime and strftime for every line)."""

    _second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return (self.default_msec_format or "%s,%03d") % (self.date_part(record.created), record.msecs)

    def date_part(self, created: float) -> str:
        """The timestamp of ``created`` to the second, made once a second."""
        return self._date(int(created))

    def stamp(self, created: float) -> str:
        """``created`` as this format writes a line's time (``2026-12-04 14:37:01,123``: the
        stock ``%s,%03d`` of the date part and the milliseconds, as a record counts them),
        the date part made once a second and the milliseconds looked up."""
        second = int(created)
        return self._date(second) + _MILLIS[int((created - second) * 1000)]

    def _date(self, second: int) -> str:
        cached = self._second
        if cached[0] != second:
            cached = self._second = (second, time.strftime(self.default_time_format, self.converter(second)))
        return cached[1]


class JsonFormatter(logging.Formatter):
    """One JSON object a line."""

    def format(self, record: logging.LogRecord) -> str:
        doc = self.document(record.created, record.levelname, record.name, record.getMessage(), record.process)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json_line(doc, {key: value for key, value in vars(record).items()
                               if key not in _STANDARD and not key.startswith("_")})

    @staticmethod
    def document(created: float, level: str, name: str, message: str, pid: int | None) -> dict[str, Any]:
        """A line's standard fields; the fields given with ``extra=`` follow them."""
        return {"ts": datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": level, "logger": name, "message": message, "pid": pid}


#: How long an INFO line may wait to be written with the lines after it.
BATCH_LINGER_S = 0.02


class BatchedStreamHandler(logging.Handler):
    """Lines below WARNING are written in batches by one writer thread; WARNING and above
    are written at once, with everything before them, by the thread that logs them.

    A busy worker logs a line per finished job. A stock StreamHandler formats and writes
    each line under one lock: worker threads queue on it (the one holding it may lose the
    interpreter lock meanwhile), which cost a sixth of the drain rate. Here a line is
    formatted by the thread that logs it, outside any lock, and appended to a deque; the
    writer makes one call for all the lines of the last ``linger_s`` seconds. ``flush()``
    (called by ``logging.shutdown`` at exit) writes what is pending; a process killed
    outright loses at most ``linger_s`` seconds of INFO lines, never a warning or an error.
    """

    def __init__(self, stream: TextIO | None = None, *, linger_s: float = BATCH_LINGER_S) -> None:
        super().__init__()
        self.stream = stream if stream is not None else sys.stderr
        self.linger_s = linger_s
        self._pending: deque[str] = deque()
        # Reentrant: a signal handler that logs runs on the main thread between two of its
        # bytecodes, possibly while that thread holds this lock (starting the writer, or
        # writing a batch). A plain lock would wait for itself forever.
        self._write_lock = threading.RLock()
        self._writing = False
        self._wake = threading.Event()
        self._writer: Any = None
        self._writer_pid = 0

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        # No handler-wide lock: formatting needs none, the deque is safe to append to.
        if not self.filter(record):
            return False
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        if record.levelno >= logging.WARNING:
            self._pending.append(line)
            self.flush()
        else:
            self.emit_line(line)

    def emit_line(self, line: str) -> None:
        """Write a formatted line below WARNING with the next batch."""
        self._pending.append(line)
        if not self._wake.is_set():
            try:
                self._ensure_writer()
            except Exception:  # no writer thread to be had (the interpreter shutting down): written here
                self.flush()
                return
            self._wake.set()

    def flush(self) -> None:
        """Write every pending line, in order, in one call."""
        with self._write_lock:
            if self._writing:
                # Re-entered by a signal handler in the middle of this thread's write: a
                # second write into the same stream now could break it or reorder lines.
                # The writer thread takes these lines once the write under way is done.
                self._ensure_writer()
                self._wake.set()
                return
            self._writing = True
            try:
                self._write_pending()
            finally:
                self._writing = False

    def _write_pending(self) -> None:
        lines = []
        try:
            while True:
                lines.append(self._pending.popleft())
        except IndexError:
            pass
        if not lines:
            return
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except Exception:  # a closed or broken stream: logging never stops the process
            pass

    def close(self) -> None:
        self.flush()
        super().close()

    def _ensure_writer(self) -> None:
        pid = os.getpid()
        if self._writer_pid == pid:
            return
        with self._write_lock:
            if self._writer_pid != pid:
                # Marked before the start, so a signal handler that logs while the thread
                # starts finds a writer on its way instead of starting a second one.
                self._writer_pid = pid
                try:
                    self._writer = detach.go("log-writer", self._run)
                except BaseException:  # (no thread could be started: the next line tries again)
                    self._writer_pid = 0
                    raise

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.wait()
            stop.wait(self.linger_s)  # let the lines of a busy moment gather
            self._wake.clear()
            self.flush()


def _batched_handler_of(logger: logging.Logger) -> BatchedStreamHandler | None:
    """The one handler a record of ``logger`` reaches, when that is all logging would do
    with it: the root's ``BatchedStreamHandler`` in one of our formats, and no filter,
    other handler or disabled level on the way (a test capturing logs adds a handler:
    then None)."""
    found: BatchedStreamHandler | None = None
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters:
            return None
        for handler in current.handlers:
            if found is not None or type(handler) is not BatchedStreamHandler or handler.filters:
                return None
            found = handler
        if not current.propagate:
            break
        current = current.parent
    if found is None or type(found.formatter) not in (TextFormatter, JsonFormatter):
        return None
    if found.level > logging.INFO or not logger.isEnabledFor(logging.INFO):
        return None
    return found


def json_line(doc: dict[str, Any], extra: Mapping[str, Any]) -> str:
    """One line of strict JSON: the standard fields of ``doc``, then the fields given with
    ``extra=`` (one named as a standard field is written as ``extra.<name>``: it never
    replaces the level, the time or the pid). A value JSON cannot hold as it is (NaN, a
    mapping with keys that are not text, a cycle) is written as its ``repr``: the line is
    never lost."""
    for key, value in extra.items():
        doc[f"extra.{key}" if key in doc else key] = value
    try:
        return json.dumps(doc, default=str, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return json.dumps({key: _storable(value) for key, value in doc.items()}, default=str, allow_nan=False)


def _storable(value: Any) -> Any:
    try:
        json.dumps(value, default=str, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)[:1000]
    return value


def info_line(logger: logging.Logger, message: str,
              extra: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
    """``logger.info(message, extra=extra)``, the same line for every handler and format,
    written straight to this process's batched handler when that is the only place it
    goes: a line a job is then about a fifth of what a log record costs. ``extra`` may be
    given as a function that makes it: the text format, which shows none of it, then
    never makes it."""
    handler = _batched_handler_of(logger)
    if handler is None:
        logger.info("%s", message, extra=extra() if callable(extra) else extra)
        return
    now = time.time()
    formatter = handler.formatter
    if type(formatter) is TextFormatter:
        line = f"{formatter.stamp(now)} [{_pid[0]}] INFO {logger.name}: {message}"
    else:
        doc = JsonFormatter.document(now, "INFO", logger.name, message, _pid[0])
        line = json_line(doc, extra() if callable(extra) else extra)
    handler.emit_line(line)


def configure_logging(fmt: str = "text", *, level: int = logging.INFO) -> None:
    """Replace the root logger's handlers with one on stderr, in ``fmt`` (text or json).

    Neither format shows where a call was made from, nor the thread: the logging module
    is told not to look them up for every record (its documented optimisations), which
    a worker logging a line per job pays for on each one.
    """
    logging._srcfile = None  # type: ignore[attr-defined]  # no caller lookup (file, line, function)
    logging.logThreads = False
    logging.logMultiprocessing = False
    handler = BatchedStreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def masked_url(url: str) -> str:
    """A database URL or conninfo with its password masked, for logs."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo  # the job log line needs no driver

    try:
        params = conninfo_to_dict(url)
    except Exception:  # not parseable: say nothing of it
        return "(unparseable database URL)"
    if params.get("password"):
        params["password"] = "***"
    return make_conninfo("", **params)
