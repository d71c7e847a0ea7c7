"""A SIGTERM that another thread of the worker catches (the main thread could not take it
at that moment: it was creating threads, which blocks every signal for an instant) still
stops the worker: the main thread runs the handler as soon as it looks, within a second,
instead of waiting forever for a signal that already came."""

from __future__ import annotations

import sys

from tests.support.procs import exit_status, running, worker_cmd

#: Our worker, with the main thread's signals blocked from the start (so every thread it
#: makes has them blocked too), and one thread made before that, which the SIGTERM then
#: reaches. It sends the SIGTERM to the process once the main thread waits for a stop.
CAUGHT_ELSEWHERE = '''
import os, signal, sys, threading, time

def send_once_the_main_thread_waits() -> None:
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if names and names[-1] == "<module>" and "main" in names and "wait" in names[:3]:
            break
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)  # to the process: only this thread can take it

threading.Thread(target=send_once_the_main_thread_waits, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
from broker import worker
sys.exit(worker.main(sys.argv[1:]))
'''


def test_a_sigterm_caught_by_another_thread_stops_the_worker(database_url, subprocess_env, tmp_path):
    # Given a worker whose main thread cannot take SIGTERM itself
    script = tmp_path / "caught_elsewhere.py"
    script.write_text(CAUGHT_ELSEWHERE)
    cmd = [sys.executable, str(script), *worker_cmd("--queues", "fetch", "--threads", "1")[3:]]
    log = tmp_path / "worker.log"
    # When a SIGTERM reaches it, caught by another thread, as it waits for a stop
    with running(cmd, subprocess_env, log=log) as worker:
        code = exit_status(worker, log, timeout_s=30)
    # Then it stops cleanly, saying so
    text = log.read_text()
    assert code == 0, text
    assert "received SIGTERM: shutting down" in text and "worker stopped" in text, text
