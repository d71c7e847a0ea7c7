"""Importing the runtime does nothing: no broker configured, no thread, no connection,
no server started. ``broker.configure()`` is called where a process starts (its boot).

Each check runs in a fresh interpreter, so that what this test process imported before
cannot hide an effect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Imports every module of the runtime, then reports what the imports did.
PROBE = r"""
import json, pkgutil, importlib, socket, sys, threading

opened = []
real_connect = socket.socket.connect
def spying_connect(self, address):
    opened.append(str(address))
    return real_connect(self, address)
socket.socket.connect = spying_connect

started = []
real_popen_init = __import__("subprocess").Popen.__init__
def spying_popen(self, *args, **kwargs):
    started.append(str(args[0] if args else kwargs.get("args")))
    return real_popen_init(self, *args, **kwargs)
__import__("subprocess").Popen.__init__ = spying_popen

imported = []
for package in ("broker", "middleware", "periodic"):
    root = importlib.import_module(package)
    imported.append(package)
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        if info.name.endswith("__main__"):
            continue  # running a process's entry point is not importing it
        importlib.import_module(info.name)
        imported.append(info.name)

import dramatiq
from broker import services
print(json.dumps({
    "imported": imported,
    "global_broker": type(dramatiq.broker.global_broker).__name__ if dramatiq.broker.global_broker else None,
    "services": services.installed() is not None,
    "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
    "connections": opened,
    "processes": started,
}))
"""


def _probe(env_extra: dict[str, str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_every_runtime_module_configures_nothing_and_opens_nothing() -> None:
    # Given a database URL that answers nothing (any connection attempt would show)
    seen = _probe({"DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none"})
    # Then every module of the runtime was imported...
    assert {"broker.engine.broker", "broker.pg.db", "broker.outbox", "middleware.keyed_lease",
            "periodic"} <= set(seen["imported"])  # type: ignore[arg-type]
    # ...and none of them configured a broker, started a thread or a process, or connected
    assert seen["global_broker"] is None
    assert seen["services"] is False
    assert seen["threads"] == []
    assert seen["connections"] == []
    assert seen["processes"] == []


def test_importing_the_runtime_starts_no_embedded_server() -> None:
    # Without DATABASE_URL the embedded server is the default: importing must not start it.
    seen = _probe({"DATABASE_URL": "", "STANDMEET_EMBEDDED_DIR": "/nonexistent/never-created"})
    assert seen["processes"] == []
    assert not Path("/nonexistent/never-created").exists()
