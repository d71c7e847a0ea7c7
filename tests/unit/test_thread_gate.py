"""The no-stray-threads gate, proven red on every form it forbids, kept as a test."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "scripts" / "check_no_bare_threads.py"
PACKAGES = ("actors", "broker", "middleware", "periodic", "scripts")

#: (name, planted source, the line the gate must name). Each starts concurrency.
FORMS = [
    ("thread", "import threading\n\nthreading.Thread(target=print).start()\n", 3),
    ("thread-alias-import", "from threading import Thread as T\n\nT(target=print)\n", 3),
    ("thread-assigned-alias", "import threading\nMaker = threading.Thread\n", 2),
    ("thread-subclass", "import threading\n\n\nclass Pump(threading.Thread):\n    pass\n", 4),
    ("thread-subclass-alias", "from threading import Thread as Base\n\n\nclass Pump(Base):\n    pass\n", 4),
    ("timer", "from threading import Timer\n\nTimer(1.0, print).start()\n", 3),
    ("getattr", "import threading\n\ngetattr(threading, 'Thread')(target=print)\n", 3),
    ("start_new_thread", "import _thread\n\n_thread.start_new_thread(print, ())\n", 3),
    ("thread-pool-executor", "from concurrent.futures import ThreadPoolExecutor\n\nThreadPoolExecutor(2)\n", 3),
    ("process-pool-executor", "import concurrent.futures as cf\n\ncf.ProcessPoolExecutor()\n", 3),
    ("dotted-executor", "import concurrent.futures\n\nconcurrent.futures.ThreadPoolExecutor()\n", 3),
    ("multiprocessing-process", "import multiprocessing\n\nmultiprocessing.Process(target=print)\n", 3),
    ("multiprocessing-pool", "from multiprocessing import Pool\n\nPool(2)\n", 3),
    ("asyncio-create-task", "import asyncio\n\n\nasync def f():\n    asyncio.create_task(f())\n", 5),
    ("asyncio-ensure-future", "import asyncio\n\n\nasync def f():\n    asyncio.ensure_future(f())\n", 5),
    ("asyncio-to-thread", "import asyncio\n\n\nasync def f():\n    await asyncio.to_thread(print)\n", 5),
    ("run-in-executor", "async def f(loop):\n    await loop.run_in_executor(None, print)\n", 2),
    ("loop-create-task", "async def f(loop):\n    loop.create_task(f(loop))\n", 2),
    ("taskgroup-create-task",
     "import asyncio\n\n\nasync def f():\n    async with asyncio.TaskGroup() as tg:\n        tg.create_task(f())\n", 6),
    ("os-fork", "import os\n\nos.fork()\n", 3),
    ("subprocess", "import subprocess\n\nsubprocess.Popen(['true'])\n", 3),
]


def run_gate(root: Path) -> subprocess.CompletedProcess[str]:
    """The gate as CI runs it: its own process, its exit status and its output."""
    return subprocess.run([sys.executable, str(GATE), str(root)], capture_output=True, text=True, timeout=60)


def _load_gate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_no_bare_threads", GATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


GATE_MODULE = _load_gate()


def run_gate_here(root: Path) -> subprocess.CompletedProcess[str]:
    """The same gate called in this process (a planted form per test: a process each is slow)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = GATE_MODULE.main(["gate", str(root)])
    return subprocess.CompletedProcess([str(GATE), str(root)], code, out.getvalue(), err.getvalue())


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.fixture
def bare_tree(tmp_path: Path) -> Path:
    """The project's packages, empty: a planted file is the only code the gate reads."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    return tmp_path


def test_the_project_tree_passes_the_gate():
    result = run_gate(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("name, source, line", FORMS, ids=[f[0] for f in FORMS])
def test_a_planted_violation_in_actors_fails_and_names_file_and_line(bare_tree, name, source, line):
    (bare_tree / "actors" / "planted.py").write_text(source)
    result = run_gate_here(bare_tree)
    assert result.returncode == 1
    assert f"actors/planted.py:{line}: " in result.stdout


@pytest.mark.parametrize("name, source, line", FORMS, ids=[f[0] for f in FORMS])
def test_the_same_code_under_broker_passes(bare_tree, name, source, line):
    (bare_tree / "broker" / "planted.py").write_text(source)
    result = run_gate_here(bare_tree)
    assert result.returncode == 0, result.stdout


def test_middleware_and_the_periodic_table_are_domain_code_too(tree_copy):
    (tree_copy / "middleware" / "planted.py").write_text(FORMS[0][1])
    (tree_copy / "periodic" / "planted.py").write_text(FORMS[0][1])
    result = run_gate(tree_copy)
    assert result.returncode == 1
    assert "middleware/planted.py:3: " in result.stdout
    assert "periodic/planted.py:3: " in result.stdout


def test_the_scheduler_entry_point_may_start_its_threads(tree_copy):
    with open(tree_copy / "periodic" / "__main__.py", "a") as f:
        f.write("\n" + FORMS[0][1])
    assert run_gate(tree_copy).returncode == 0


def test_a_file_the_gate_cannot_parse_fails_it(tree_copy):
    (tree_copy / "actors" / "broken.py").write_text("def (:\n")
    result = run_gate(tree_copy)
    assert result.returncode == 1
    assert "actors/broken.py:1: cannot be parsed" in result.stdout
