"""The worker's log handler: INFO lines written in batches by one writer, in order;
warnings and errors at once, after every line logged before them."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from broker.observability.logs import BatchedStreamHandler
from tests.support.db import wait_for


def _logger(stream: io.StringIO, name: str, *, linger_s: float = 0.02) -> tuple[logging.Logger, BatchedStreamHandler]:
    handler = BatchedStreamHandler(stream, linger_s=linger_s)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(f"standmeet.test.{name}")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log, handler


def test_info_lines_from_many_threads_are_all_written_in_each_threads_order():
    stream = io.StringIO()
    log, handler = _logger(stream, "threads")

    def job_lines(thread: int) -> None:
        for n in range(500):
            log.info("job done %d %d", thread, n)

    threads = [threading.Thread(target=job_lines, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = wait_for(lambda: (ls := stream.getvalue().splitlines()) and len(ls) == 4000 and ls,
                     timeout_s=5, what="4,000 lines written by the writer thread")
    for thread in range(8):
        ns = [int(line.split()[-1]) for line in lines if line.split()[-2] == str(thread)]
        assert ns == list(range(500))
    handler.close()


def test_a_warning_is_written_at_once_after_the_info_lines_before_it():
    stream = io.StringIO()
    # A linger far longer than the test: only the warning's own flush can write the lines.
    log, handler = _logger(stream, "warning", linger_s=60)
    log.info("first")
    log.info("second")
    log.warning("trouble")
    assert stream.getvalue().splitlines() == ["INFO first", "INFO second", "WARNING trouble"]
    handler.close()


def test_an_info_line_waits_at_most_its_linger_and_flush_writes_it_at_once():
    stream = io.StringIO()
    log, handler = _logger(stream, "flush", linger_s=60)
    log.info("pending")
    assert stream.getvalue() == ""
    handler.flush()
    assert stream.getvalue() == "INFO pending\n"
    handler.close()


def test_lines_still_pending_at_exit_are_written_by_logging_shutdown():
    # Given a process that logs one INFO line with a long linger and exits at once
    code = (
        "import logging, sys\n"
        "from broker.observability.logs import BatchedStreamHandler\n"
        "h = BatchedStreamHandler(sys.stdout, linger_s=60)\n"
        "logging.getLogger().addHandler(h); logging.getLogger().setLevel(logging.INFO)\n"
        "logging.info('last words')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": root})
    # Then the line was written on the way out
    assert done.returncode == 0, done.stderr
    assert done.stdout == "last words\n"


def test_the_text_format_stamps_each_line_as_the_stock_formatter_does():
    from broker.observability.logs import TEXT_FORMAT, TextFormatter

    ours, stock = TextFormatter(TEXT_FORMAT), logging.Formatter(TEXT_FORMAT)
    for created in (1_700_000_000.0, 1_700_000_000.999, 1_700_000_001.5, 1_700_000_000.25):
        record = logging.LogRecord("standmeet.jobs", logging.INFO, __file__, 1, "job done", None, None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.format(record) == stock.format(record)


def test_a_job_line_written_straight_to_the_handler_is_the_line_logging_would_write():
    import json
    import re

    from broker.observability.logs import TEXT_FORMAT, JsonFormatter, TextFormatter, info_line

    extra = {"actor": "a.b", "message_id": "m1", "queue": "q", "duration_ms": 1.25, "outcome": "done", "attempt": 2}
    for formatter in (TextFormatter(TEXT_FORMAT), JsonFormatter()):
        # Given a logger whose only handler is the batched one, in one of our formats
        stream = io.StringIO()
        log, handler = _logger(stream, f"direct-{type(formatter).__name__}")
        handler.setFormatter(formatter)
        # When the same line goes through logging and straight to the handler
        made: list[str] = []

        def make_extra(made: list[str] = made, name: str = type(formatter).__name__) -> dict:
            made.append(name)
            return extra

        log.info("%s", "job done: q a.b m1 in 1.2 ms (attempt 2)", extra=extra)
        info_line(log, "job done: q a.b m1 in 1.2 ms (attempt 2)", extra)
        info_line(log, "job done: q a.b m1 in 1.2 ms (attempt 2)", make_extra)
        handler.flush()
        through_logging, direct, direct_made = stream.getvalue().splitlines()
        # (the fields given as a function are made only for the format that shows them)
        assert made == (["JsonFormatter"] if isinstance(formatter, JsonFormatter) else [])
        if isinstance(formatter, JsonFormatter):
            assert {**json.loads(direct_made), "ts": ""} == {**json.loads(direct), "ts": ""}
        else:
            assert direct_made[24:] == direct[24:]  # all but the time it was written
        # Then they are the same line, but for the time it was written
        if isinstance(formatter, JsonFormatter):
            through_logging, direct = (json.loads(line) for line in (through_logging, direct))
            assert through_logging.pop("ts")[:16] == direct.pop("ts")[:16]
        else:
            stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
            assert stamp.match(through_logging) and stamp.match(direct)
            through_logging, direct = stamp.sub("", through_logging), stamp.sub("", direct)
        assert through_logging == direct


def test_a_job_line_goes_through_logging_when_anything_else_would_see_it():
    from broker.observability.logs import info_line

    # Given a batched handler, and a second handler capturing records (as a test's would)
    stream = io.StringIO()
    log, handler = _logger(stream, "captured")
    captured: list[logging.LogRecord] = []
    capture = logging.Handler()
    capture.emit = captured.append  # type: ignore[method-assign]
    log.addHandler(capture)
    # When a job line is written
    info_line(log, "job done: q a.b m1 in 1.2 ms (attempt 1)", lambda: {"outcome": "done", "attempt": 1})
    handler.flush()
    # Then both see it: the capturing handler as a record with its fields
    assert stream.getvalue() == "INFO job done: q a.b m1 in 1.2 ms (attempt 1)\n"
    (record,) = captured
    assert record.getMessage() == "job done: q a.b m1 in 1.2 ms (attempt 1)" and record.outcome == "done"


def test_a_job_line_written_by_a_forked_child_names_the_childs_process():
    from broker.observability.logs import TEXT_FORMAT, TextFormatter, info_line

    # Given a job line written in this process (its id read once and kept)
    read_fd, write_fd = os.pipe()
    stream = io.StringIO()
    log, handler = _logger(stream, "forked")
    handler.setFormatter(TextFormatter(TEXT_FORMAT))
    info_line(log, "job done: parent", {})
    handler.flush()
    assert f"[{os.getpid()}] INFO" in stream.getvalue()
    # When a forked child writes one (as a worker process forked by a supervisor would)
    child = os.fork()
    if child == 0:  # the child: a handler of its own (no lock a parent's thread held), its line to the pipe
        try:
            child_stream = io.StringIO()
            own = BatchedStreamHandler(child_stream, linger_s=60)
            own.setFormatter(TextFormatter(TEXT_FORMAT))
            log.handlers[:] = [own]
            info_line(log, "job done: child", {})
            own.flush()
            os.write(write_fd, child_stream.getvalue().encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + 20
    while os.waitpid(child, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(child, 9)
            os.waitpid(child, 0)
            raise AssertionError("the forked child did not write its line within 20 s")
        time.sleep(0.01)
    with os.fdopen(read_fd, "rb") as pipe:
        line = pipe.read().decode()
    # Then the child's line names the child, not the parent
    assert f"[{child}] INFO standmeet.test.forked: job done: child" in line, line


@pytest.mark.parametrize("created", [1_764_858_000.0, 1_764_858_000.0004, 1_764_858_000.1234,
                                     1_764_858_000.9995, 1_764_858_000.999999, 1_764_858_001.5])
def test_a_lines_time_is_the_date_part_and_the_milliseconds_a_record_counts(created):
    from broker.observability.logs import TEXT_FORMAT, TextFormatter

    formatter = TextFormatter(TEXT_FORMAT)
    # the milliseconds as Python 3.11's LogRecord counts them, after the stock "%s,%03d"
    record = logging.makeLogRecord({"created": created, "msecs": int((created - int(created)) * 1000)})

    assert formatter.stamp(created) == formatter.formatTime(record)


#: A process whose signal handler logs, as the worker's, the scheduler's and ``run``'s do;
#: the signal arrives at the worst moment the argument names: while the main thread starts
#: the writer thread for its first line, or while it writes a batch into the stream.
SIGNAL_MID_LOG = '''
import logging, os, signal, sys
from broker import detach
from broker.observability.logs import BatchedStreamHandler

moment = sys.argv[1]

class Stream:
    def __init__(self): self.parts = []
    def write(self, text):
        if moment == "write" and not self.parts:
            os.kill(os.getpid(), signal.SIGUSR2)  # handled on this thread before write returns
        self.parts.append(text)
    def flush(self): pass

stream = Stream()
handler = BatchedStreamHandler(stream, linger_s=0.01)
handler.setFormatter(logging.Formatter("%(message)s"))
log = logging.getLogger("signal-mid-log")
log.addHandler(handler); log.setLevel(logging.INFO); log.propagate = False
signal.signal(signal.SIGUSR2, lambda *_: log.warning("received SIGUSR2"))

real_go = detach.go
def go(name, fn):
    if moment == "start":
        os.kill(os.getpid(), signal.SIGUSR2)
    return real_go(name, fn)
detach.go = go

if moment == "start":
    log.info("first line")
else:
    log.warning("first warning")
handler.close()
sys.stdout.write("".join(stream.parts))
'''


@pytest.mark.parametrize("moment", ["start", "write"])
def test_a_signal_handler_that_logs_while_this_thread_logs_neither_hangs_nor_loses_a_line(moment):
    # Given a process whose signal handler logs, when the signal comes while the main
    # thread itself is inside the handler (starting the writer, or writing a batch)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        done = subprocess.run([sys.executable, "-c", SIGNAL_MID_LOG, moment], capture_output=True, text=True,
                              timeout=30, env={**os.environ, "PYTHONPATH": root})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process hung when a signal handler logged while its main thread was at {moment!r}")
    # Then it finishes, with both lines written, the interrupted one first
    assert done.returncode == 0, done.stderr
    first = "first line" if moment == "start" else "first warning"
    assert done.stdout.splitlines() == [first, "received SIGUSR2"], done.stdout


def test_every_json_line_is_strict_json_and_keeps_its_standard_fields_whatever_the_extras():
    import json

    from broker.observability.logs import JsonFormatter

    formatter = JsonFormatter()
    cycle: list[object] = []
    cycle.append(cycle)
    cases = [{"ratio": float("nan")}, {"ratio": float("inf")}, {"counts": {1: "key not text"}}, {"loop": cycle},
             {"level": "DEBUG", "pid": 0, "ts": "then"}]
    for extra in cases:
        record = logging.LogRecord("standmeet.test", logging.WARNING, __file__, 1, "odd extras", None, None)
        for key, value in extra.items():
            setattr(record, key, value)
        doc = json.loads(formatter.format(record), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
        assert doc["level"] == "WARNING" and doc["message"] == "odd extras" and doc["pid"] == record.process
    assert doc["extra.level"] == "DEBUG"  # (the last case: named as standard fields, kept aside)
    record = logging.LogRecord("standmeet.test", logging.INFO, __file__, 1, "where", None, None, sinfo="Stack (most recent call last):\n  here")
    assert "here" in json.loads(formatter.format(record))["stack"]


def test_an_info_line_is_written_when_no_writer_thread_can_be_started(monkeypatch):
    from broker import detach

    def no_thread(name, fn):
        raise RuntimeError("can't start new thread")

    stream = io.StringIO()
    log, handler = _logger(stream, "no-thread", linger_s=60)
    monkeypatch.setattr(detach, "go", no_thread)
    log.info("still written")  # no exception into the caller
    assert stream.getvalue() == "INFO still written\n"
    handler.close()
