"""Message rows have one writer: ``broker.engine.enqueue`` (with the statements of
``broker.engine.sql_enqueue``) is the only part of the runtime that spells an INSERT into
``dramatiq.queue``, or a COPY into it; every other path goes through it, and so through
its hook policy."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The code that runs in a worker, scheduler, relay or web process.
RUNTIME = ("broker", "middleware", "periodic", "actors")
#: The writer, and the module of the SQL constants it executes.
WRITER = {Path("broker/engine/enqueue.py"), Path("broker/engine/sql_enqueue.py")}
#: An INSERT or a COPY into dramatiq.queue, however it is spaced or quoted (a COPY names
#: the table first; one that copies out of it, ``COPY (SELECT …) TO``, names none).
INSERT_INTO_QUEUE = re.compile(r'\b(?:INSERT\s+INTO|COPY)\s+"?dramatiq"?\s*\.\s*"?queue"?(?![\w.])', re.IGNORECASE)


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
    assert INSERT_INTO_QUEUE.search('copy "dramatiq"."queue" (queue_name, message_id) FROM STDIN')
    assert not INSERT_INTO_QUEUE.search("INSERT INTO dramatiq.queue_pauses (queue_name)")
    assert not INSERT_INTO_QUEUE.search("COPY dramatiq.queue_pauses FROM STDIN")


#: The statements that write message rows; the settle statement (broker.engine.sql) holds
#: the follow-ups' insert, whose parameters the codec builds (``followup_params``).
WRITING_STATEMENTS = frozenset({"ENQUEUE", "COPY_QUEUED", "COPY_QUEUED_AT", "ENQUEUE_ONE", "ENQUEUE_UNIQUE",
                                "FOLLOWUPS_OF_SETTLED"})
MAY_NAME_THEM = WRITER | {Path("broker/engine/sql.py")}


def _uses_of_writing_statements(path: Path) -> list[int]:
    """Lines that take a writing statement from ``broker.engine.sql_enqueue`` in code (an
    attribute of the module, or a name imported from it), not in a docstring."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in WRITING_STATEMENTS and \
                isinstance(node.value, ast.Name) and node.value.id == "sql_enqueue":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "broker.engine.sql_enqueue" and \
                any(alias.name in WRITING_STATEMENTS for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_no_runtime_module_but_the_writer_executes_a_statement_that_writes_message_rows():
    offenders = [f"{path}:{line}" for path in _runtime_files() if path not in MAY_NAME_THEM
                 for line in _uses_of_writing_statements(path)]
    assert offenders == [], f"only broker.engine.enqueue executes the statements that write messages: {offenders}"
    # and the search sees the writer's own uses
    assert _uses_of_writing_statements(Path("broker/engine/enqueue.py"))
