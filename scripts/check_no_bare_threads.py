#!/usr/bin/env python3
"""The no-stray-threads gate.

Starting concurrency — a thread, a process, an executor, an asyncio task — is allowed
only in the infrastructure package (``broker/``), the process entry points
(``periodic/__main__.py``; the CLI lives in ``broker/``), the benchmarks and the
tests. Domain code enqueues a job or declares a periodic job instead; infrastructure
that must own a thread uses ``broker.detach``.

Every Python file of the project is parsed (AST, not grep). Imports and simple
aliases are followed (``from threading import Thread as T``; ``T = threading.Thread``),
and any *reference* to a forbidden callable counts, called or not, as does a class
that subclasses one. There is no exclusion list and no inline "ignore" comment: the
only way past the gate is to move the code where it belongs.

Usage: ``python scripts/check_no_bare_threads.py [ROOT]``. Prints ``path:line: what``
for each violation and exits 1; exits 0 when clean.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: Where starting concurrency is allowed, by structure (directories, entry points).
ALLOWED_DIRS = ("broker", "tests", "bench")
ALLOWED_FILES = ("periodic/__main__.py",)

#: Fully qualified callables that start concurrency, and what they start.
FORBIDDEN: dict[str, str] = {
    "threading.Thread": "a thread",
    "threading.Timer": "a thread (Timer)",
    "_thread.start_new_thread": "a thread",
    "_thread.start_new": "a thread",
    "concurrent.futures.ThreadPoolExecutor": "a thread pool executor",
    "concurrent.futures.ProcessPoolExecutor": "a process pool executor",
    "concurrent.futures.thread.ThreadPoolExecutor": "a thread pool executor",
    "concurrent.futures.process.ProcessPoolExecutor": "a process pool executor",
    "multiprocessing.Process": "a process",
    "multiprocessing.Pool": "a process pool",
    "multiprocessing.pool.Pool": "a process pool",
    "multiprocessing.pool.ThreadPool": "a thread pool",
    "multiprocessing.dummy.Pool": "a thread pool",
    "multiprocessing.get_context": "a process context",
    "asyncio.create_task": "an asyncio task",
    "asyncio.ensure_future": "an asyncio task",
    "asyncio.to_thread": "a thread (asyncio.to_thread)",
    "asyncio.TaskGroup": "an asyncio task group",
    "asyncio.run_coroutine_threadsafe": "an asyncio task",
    "os.fork": "a process (fork)",
    "os.forkpty": "a process (forkpty)",
    "os.posix_spawn": "a process",
    "os.posix_spawnp": "a process",
    "os.spawnv": "a process",
    "os.spawnl": "a process",
    "os.system": "a process",
    "os.popen": "a process",
    "subprocess.Popen": "a process",
    "subprocess.run": "a process",
    "subprocess.call": "a process",
    "subprocess.check_call": "a process",
    "subprocess.check_output": "a process",
    "apscheduler.schedulers.background.BackgroundScheduler": "a scheduler thread",
    "apscheduler.schedulers.asyncio.AsyncIOScheduler": "an asyncio scheduler",
}

#: Methods that start concurrency whatever they are called on (loops, task groups).
FORBIDDEN_METHODS: dict[str, str] = {
    "create_task": "an asyncio task",
    "run_in_executor": "an executor job",
    "ensure_future": "an asyncio task",
    "start_new_thread": "a thread",
}

SKIP_DIRS = {"__pycache__", "node_modules", "build", "dist", "site-packages", "mutants"}  # mutants: mutmut's copies


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def project_files(root: Path) -> Iterator[Path]:
    """Every Python file of the project: no hidden folders, virtualenvs or build output."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parents = rel.parts[:-1]
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in parents):
            continue
        if any((root.joinpath(*parents[: i + 1]) / "pyvenv.cfg").exists() for i in range(len(parents))):
            continue
        yield path


def allowed(rel: str) -> bool:
    return rel in ALLOWED_FILES or rel.split("/", 1)[0] in ALLOWED_DIRS


class _Checker(ast.NodeVisitor):
    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.aliases: dict[str, str] = {}  # local name -> qualified name
        self.found: list[Violation] = []

    # -- name resolution ----------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                head = alias.name.split(".", 1)[0]
                self.aliases[head] = head

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module is None or node.level:
            return
        for alias in node.names:
            qualified = f"{node.module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = qualified  # reported where it is used

    def qualify(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualify(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    # -- what counts ----------------------------------------------------------------

    def _report(self, node: ast.AST, what: str) -> None:
        self.found.append(Violation(self.rel, getattr(node, "lineno", 0), what))

    def _check_qualified(self, qualified: str | None, node: ast.AST) -> bool:
        if qualified and qualified in FORBIDDEN:
            self._report(node, f"{qualified} starts {FORBIDDEN[qualified]}")
            return True
        return False

    def visit_Assign(self, node: ast.Assign) -> None:
        qualified = self.qualify(node.value)
        if qualified:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.aliases[target.id] = qualified
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._check_qualified(self.aliases.get(node.id), node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._check_qualified(self.qualify(node), node):
            return  # reported once, not again for its base
        if node.attr in FORBIDDEN_METHODS and isinstance(node.ctx, ast.Load):
            self._report(node, f".{node.attr}() starts {FORBIDDEN_METHODS[node.attr]}")
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # getattr(threading, "Thread") and friends
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            base, name = self.qualify(node.args[0]), node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if base and self._check_qualified(f"{base}.{name.value}", node):
                    pass
                elif name.value in FORBIDDEN_METHODS:
                    self._report(node, f"getattr(…, {name.value!r}) starts {FORBIDDEN_METHODS[name.value]}")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            qualified = self.qualify(base)
            if qualified in FORBIDDEN:
                self._report(node, f"class {node.name} subclasses {qualified}, which starts {FORBIDDEN[qualified]}")
        self.generic_visit(node)


def check_file(path: Path, rel: str) -> list[Violation]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    except SyntaxError as exc:
        return [Violation(rel, exc.lineno or 0, f"cannot be parsed ({exc.msg}); the gate cannot vouch for it")]
    checker = _Checker(rel)
    checker.visit(tree)
    return checker.found


def check_tree(root: Path) -> list[Violation]:
    violations: list[Violation] = []
    for path in project_files(root):
        rel = path.relative_to(root).as_posix()
        if not allowed(rel):
            violations.extend(check_file(path, rel))
    return violations


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    violations = check_tree(root.resolve())
    for violation in violations:
        print(violation)
    if violations:
        print(
            f"\n{len(violations)} place(s) start concurrency outside broker/ and the entry points.\n"
            "Enqueue a job (actor.send, broker.engine.enqueue) or declare a periodic job (periodic.PERIODIC_JOBS);\n"
            "infrastructure that must own a thread belongs in broker/ and uses broker.detach.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
