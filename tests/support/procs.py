"""Real child processes for acceptance tests, stopped by their own pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker_cmd(*args: str, module: str = "tests.support.jobs") -> list[str]:
    """Our worker process (``python -m broker.worker``), serving the test actors too."""
    return [sys.executable, "-m", "broker.worker", module, *args]


def dramatiq_cmd(*args: str, module: str = "actors") -> list[str]:
    return [sys.executable, "-m", "dramatiq", module, "--processes", "1", *args]


@contextmanager
def running(cmd: list[str], env: dict[str, str], *, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd`` in its own session; on exit, SIGKILL what is left of the session."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            try:  # the whole session: children of a leader that already died included
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def supervised_pids(log_text: str) -> list[int]:
    """The processes `run` says it started or restarted, in order: its children, and none
    of the short-lived ones a process forks on its own (a helper a library runs at start,
    which a list of its child processes may show for a moment)."""
    return [int(line.split("started pid ")[1].split(":")[0]) for line in log_text.splitlines()
            if "started pid " in line]


#: What the interpreter writes at the head of each thread's stack (``faulthandler``).
STACK_HEAD = "(most recent call first):"


def exit_status(proc: subprocess.Popen[bytes], log: Path, *, timeout_s: float) -> int:
    """``proc``'s exit status once it exits, within ``timeout_s``. One that does not exit
    fails the test with its log, and with where each of its threads was: asked with
    :data:`broker.observability.stacks.STACKS_SIGNAL`, as an operator would."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    from broker.observability.stacks import STACKS_SIGNAL
    from tests.support.db import wait_for

    proc.send_signal(STACKS_SIGNAL)
    try:
        wait_for(lambda: STACK_HEAD in log.read_text(errors="replace"), timeout_s=10, what="the stacks written")
    except AssertionError:
        pass  # the log says what it says
    raise AssertionError(f"pid {proc.pid} ({' '.join(proc.args[1:4])}) did not exit within {timeout_s} s; "
                         f"its log, with its threads' stacks:\n{log.read_text(errors='replace')[-30_000:]}")
