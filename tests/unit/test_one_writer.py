"""Message rows have one writer: ``broker.engine.enqueue`` (with the statements of
``broker.engine.sql_enqueue``) is the only part of the runtime that spells an INSERT into
``dramatiq.queue``; every other path goes through it, and so through its hook policy."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The code that runs in a worker, scheduler, relay or web process.
RUNTIME = ("broker", "middleware", "periodic", "actors")
#: The writer, and the module of the SQL constants it executes.
WRITER = {Path("broker/engine/enqueue.py"), Path("broker/engine/sql_enqueue.py")}
#: An INSERT into dramatiq.queue, however it is spaced or quoted.
INSERT_INTO_QUEUE = re.compile(r'\bINSERT\s+INTO\s+"?dramatiq"?\s*\.\s*"?queue"?(?![\w.])', re.IGNORECASE)


def _runtime_files() -> list[Path]:
    return sorted(path.relative_to(ROOT) for part in RUNTIME for path in (ROOT / part).rglob("*.py"))


def _inserting(path: Path) -> bool:
    return INSERT_INTO_QUEUE.search((ROOT / path).read_text(encoding="utf-8")) is not None


def test_no_runtime_module_but_the_writer_inserts_into_dramatiq_queue():
    files = _runtime_files()
    assert Path("broker/engine/broker.py") in files  # the search looks where the runtime is
    offenders = [str(path) for path in files if path not in WRITER and _inserting(path)]
    assert offenders == [], f"message rows are written only through broker.engine.enqueue: {offenders}"


def test_the_search_finds_the_writers_own_inserts():
    # Were the pattern wrong, the test above would pass on anything: it must see these.
    assert _inserting(Path("broker/engine/sql_enqueue.py"))
    assert INSERT_INTO_QUEUE.search('insert  into "dramatiq".\n  "queue" AS q (message_id)')
    assert not INSERT_INTO_QUEUE.search("INSERT INTO dramatiq.queue_pauses (queue_name)")
