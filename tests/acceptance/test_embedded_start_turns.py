"""Processes starting the embedded server together take turns (a lock of its own beside
its data folder): the wheel makes the folder, and as root its system user, before its
own lock, and processes that met there failed with "File exists". Shown with a real
process: while the lock is held, it waits on it (seen in the kernel's lock table); once
let go, it starts the server and answers."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

from broker.pg.embedded import start_lock_path
from tests.support.db import wait_for
from tests.support.procs import ROOT

DB_URL = [sys.executable, "-m", "broker.cli", "db", "url"]
DB_STOP = [sys.executable, "-m", "broker.cli", "db", "stop"]


def blocked_on(path) -> bool:
    """Whether a process waits for a flock of ``path`` (``->`` marks a waiter in /proc/locks)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as locks:
        return any("->" in line and "FLOCK" in line and line.split()[-3].endswith(f":{inode}")
                   for line in locks)


def test_a_process_starting_the_embedded_server_waits_its_turn(tmp_path):
    data_dir = tmp_path / "pgdata"
    env = {**{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
           "STANDMEET_EMBEDDED_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    lock_path = start_lock_path(data_dir)
    # Given another process's turn at the start (the lock held here)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        starter = subprocess.Popen(DB_URL, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        try:
            # When a process starts the server: it waits for the lock, the folder not yet made
            wait_for(lambda: blocked_on(lock_path) or starter.poll() is not None, timeout_s=60,
                     what="the starting process to wait for the start lock")
            assert starter.poll() is None, starter.communicate()
            assert not data_dir.exists()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    try:
        # Then, its turn come, it starts the server and answers
        out, err = starter.communicate(timeout=120)
        assert starter.returncode == 0, err
        assert out.startswith("postgresql://"), out
    finally:
        subprocess.run(DB_STOP, env=env, cwd=ROOT, capture_output=True, timeout=60)
