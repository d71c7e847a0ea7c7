"""The runtime (broker/, middleware/, periodic/) names nothing of the application: none of its
tables (the ones actors/migrations creates), none of its actors (as actors/ declares them), none
of its domain words. Imports are lint-imports' business; this reads the text of every runtime
file (Python, SQL, templates), comments and docstrings included. No database."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("broker", "middleware", "periodic")
#: What a runtime file may be: code, SQL, templates.
SUFFIXES = frozenset({".py", ".sql", ".html", ".txt", ".j2", ".jinja"})
#: Words of the application's domain that the runtime has no business knowing (matched in any
#: case, inside identifiers too). Not "reindex": REINDEX is also Postgres's.
DOMAIN_WORDS = ("webhook", "whsec", "supplier", "corpus", "jobboard", "job board", "job posting")
CREATE_TABLE = re.compile(r"\bCREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(?:\w+\.)?(\w+)", re.IGNORECASE)
#: How SQL names a table (upper-case keywords, as the project writes SQL).
SQL_BEFORE_TABLE = r"(?:FROM|JOIN|INTO|UPDATE|TABLE|REFERENCES|ON)\s+"



def tables_created(folder: Path) -> set[str]:
    return {name.lower() for path in sorted(folder.glob("*.sql"))
            for name in CREATE_TABLE.findall(path.read_text(encoding="utf-8"))}


def application_tables() -> set[str]:
    return tables_created(ROOT / "actors" / "migrations")


def _is_actor_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Attribute) and target.attr == "actor") or (
        isinstance(target, ast.Name) and target.id == "actor")


def actor_names_in(tree: ast.AST) -> set[str]:
    """``@dramatiq.actor(actor_name=...)`` (else the function's name, as Dramatiq names it),
    and module constants named ``*_ACTOR`` holding a string."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for decorator in node.decorator_list:
                if not _is_actor_decorator(decorator):
                    continue
                given = [k.value for k in getattr(decorator, "keywords", []) if k.arg == "actor_name"]
                if given and isinstance(given[0], ast.Constant) and isinstance(given[0].value, str):
                    names.add(given[0].value)
                else:
                    names.add(node.name)
    for node in getattr(tree, "body", []):
        if (isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id.endswith("_ACTOR") for t in targets):
                names.add(node.value.value)
    return names


def application_actors() -> set[str]:
    names: set[str] = set()
    for path in sorted((ROOT / "actors").rglob("*.py")):
        names |= actor_names_in(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return names


def patterns() -> list[tuple[re.Pattern[str], str]]:
    """Each thing the runtime must not name, and how a hit is described."""
    found: list[tuple[re.Pattern[str], str]] = []
    for table in sorted(application_tables()):
        if "_" in table:  # a distinctive name: anywhere, as a word
            found.append((re.compile(rf"(?<![\w.])(?:standmeet\.)?{table}\b"), f"table {table}"))
        else:  # a word English has too: only where SQL names it
            found.append((re.compile(rf"\bstandmeet\.{table}\b|\b{SQL_BEFORE_TABLE}{table}\b"), f"table {table}"))
    for actor in sorted(application_actors()):
        if "." in actor:
            found.append((re.compile(rf"(?<![\w.]){re.escape(actor)}(?!\w)"), f"actor {actor}"))
        else:  # a function's name: only as a string
            found.append((re.compile(rf"[\"']{re.escape(actor)}[\"']"), f"actor {actor}"))
    for word in DOMAIN_WORDS:
        found.append((re.compile(re.escape(word).replace(r"\ ", r"[\s_-]?"), re.IGNORECASE), f"word {word!r}"))
    return found


def runtime_files() -> Iterable[Path]:
    for top in RUNTIME:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def hits_in(text: str, where: str, rules: list[tuple[re.Pattern[str], str]]) -> list[str]:
    """``where:line: what, what`` for each line of ``text`` that names something of the application."""
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        what = [description for pattern, description in rules if pattern.search(line)]
        if what:
            lines.append(f"{where}:{number}: {', '.join(what)}")
    return lines


def runtime_hits(*, under: str = "") -> list[str]:
    rules = patterns()
    hits: list[str] = []
    for path in runtime_files():
        where = path.relative_to(ROOT).as_posix()
        if where.startswith(under):
            hits += hits_in(path.read_text(encoding="utf-8"), where, rules)
    return hits


def test_the_application_tables_and_actors_are_collected_from_its_own_files():
    tables, actors = application_tables(), application_actors()
    assert {"documents", "search_index", "job_sources", "supplier_calls", "webhook_deliveries"} <= tables
    assert {"corpus.index", "webhook.deliver", "jobs.fetch_source", "mail.test"} <= actors
    runtime_tables = tables_created(ROOT / "broker" / "pg" / "migrations")
    assert {"queue", "outbox", "relays", "job_attempts", "periodic_runs"} <= runtime_tables
    assert not tables & runtime_tables, "a table both the runtime and the application create"


def test_the_lint_sees_each_kind_of_naming_and_leaves_english_alone():
    rules = patterns()
    text = "\n".join([
        "SELECT * FROM standmeet.webhook_deliveries",       # 1 a table (and the word)
        "rows = conn.execute('DELETE FROM documents')",      # 2 a one-word table, as SQL names it
        "DELIVER = 'corpus.index'",                          # 3 an actor (and the word)
        "# retries a Supplier's call",                       # 4 a domain word, any case
        "the job board feeds",                               # 5 a domain word of two
        "documents its guarantees; the index of a queue",    # 6 English: nothing
    ])
    assert hits_in(text, "f.py", rules) == [
        "f.py:1: table webhook_deliveries, word 'webhook'",
        "f.py:2: table documents",
        "f.py:3: actor corpus.index, word 'corpus'",
        "f.py:4: word 'supplier'",
        "f.py:5: word 'job board'",
    ]


def test_an_actor_named_by_its_function_or_a_constant_is_collected():
    tree = ast.parse(
        "import dramatiq\nDELIVER_ACTOR = 'hooks.send'\n"
        "@dramatiq.actor\ndef plain(): pass\n"
        "@dramatiq.actor(queue_name='q')\ndef with_options(): pass\n"
        "@dramatiq.actor(actor_name='named.one')\ndef renamed(): pass\n"
        "@other\ndef not_an_actor(): pass\n")
    assert actor_names_in(tree) == {"hooks.send", "plain", "with_options", "named.one"}


def test_the_runtimes_migrations_and_registration_name_nothing_of_the_application():
    hits = runtime_hits(under="broker/pg/") + [h for h in runtime_hits(under="broker/app.py")]
    assert not hits, "\n".join(hits)


def test_no_runtime_file_names_an_application_table_actor_or_domain_word():
    hits = runtime_hits()
    assert not hits, f"{len(hits)} line(s) of the runtime name the application:\n" + "\n".join(hits)
