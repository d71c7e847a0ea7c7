"""Bad input to `standmeet-jobs` is one line naming what was wrong and a non-zero exit,
never a traceback, and changes nothing: arguments that are not UTF-8, numbers in digits
other than ASCII, empty filters, a payload Python cannot read, a database `check` cannot
use; and a reader that goes away (`… --json | head -1`) ends the command quietly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support import db as testdb
from tests.support.db import query, scalar
from tests.support.job_rows import drop_queue, put_jobs
from tests.support.procs import ROOT

CLI = [sys.executable, "-m", "broker.cli"]
#: What Python makes of the Latin-1 byte 0xE9 (an "é" typed in a Latin-1 terminal) in argv:
#: a lone surrogate, which no query can take.
LATIN1 = os.fsdecode(b"caf\xe9")
#: Digits Python's int() and float() take, and a command line must not.
ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
QUEUE = "cli_input"
#: Enough rows that the JSON of `jobs list --limit 1000` and of `status` outgrows a pipe's buffer.
MANY = 1000


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def refused(result: subprocess.CompletedProcess[str], status: int, *words: str) -> str:
    """The one line a refusal prints (exit ``status``, no traceback), checked for ``words``."""
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("standmeet-jobs")]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _actions(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM standmeet.operator_actions"))


@pytest.fixture
def rejected_job(database_url: str) -> Iterator[str]:
    (job,) = put_jobs(database_url, QUEUE, actor="cli_input.job", rejected_with="boom")
    yield job
    drop_queue(database_url, QUEUE)


@pytest.mark.parametrize("args, names", [
    (("jobs", "list", "--error", LATIN1), "--error"),
    (("jobs", "list", "--search", LATIN1), "--search"),
    (("jobs", "list", "--queue", LATIN1), "--queue"),
    (("jobs", "list", "--actor", LATIN1), "--actor"),
    (("jobs", "cancel", "--actor", LATIN1), "--actor"),
    (("jobs", "retry", "--state", "rejected", "--actor", LATIN1), "--actor"),
    (("jobs", "retry", "--state", "rejected", "--error", LATIN1), "--error"),
    (("queues", "pause", LATIN1), "argument queue"),
    (("outbox", "list", "--topic", LATIN1), "--topic"),
    (("outbox", "retry", "--failed", "--topic", LATIN1), "--topic"),
    (("search", LATIN1), "argument words"),
], ids=lambda v: " ".join(v).replace(LATIN1, "café") if isinstance(v, tuple) else None)
def test_an_argument_that_is_not_utf8_is_refused_in_one_line_naming_it(database_url, subprocess_env, rejected_job,
                                                                     args, names):
    before = _actions(database_url)
    line = refused(cli(subprocess_env, *args), 2, names, "not valid UTF-8", "0xe9")
    assert line.startswith("standmeet-jobs"), line
    assert _actions(database_url) == before  # nothing cancelled, retried or paused
    assert query(database_url, "SELECT \"state\"::text FROM dramatiq.queue WHERE message_id = %s",
                 (rejected_job,)) == [("rejected",)]
    assert scalar(database_url, "SELECT count(*) FROM standmeet.queue_pauses") == 0


@pytest.mark.parametrize("args, names", [
    (("outbox", "retry", "{event}"), "argument ID"),
    (("jobs", "list", "--limit", "5"), "--limit"),
    (("jobs", "list", "--offset", "5"), "--offset"),
    (("jobs", "list", "--since", "2h"), "--since"),
    (("outbox", "list", "--limit", "5"), "--limit"),
    (("status", "--check", "--max-age-s", "5"), "--max-age-s"),
    (("check", "--threads", "4"), "--threads"),
    (("search", "kettle", "--limit", "5"), "--limit"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_a_number_in_digits_other_than_ascii_is_refused_in_one_line_and_nothing_is_done(
        database_url, subprocess_env, args, names):
    (event,) = query(database_url, "INSERT INTO standmeet.outbox (topic, payload, error) VALUES"
                                   " ('cli_input.topic', '{}', 'UnknownTopic: no route') RETURNING id")[0]
    try:
        given = [a.format(event=event).translate(ARABIC_INDIC) if a[:1] in "{0123456789" else a for a in args]
        refused(cli(subprocess_env, *given), 2, names, "ASCII")
        # the event those digits spell is still failed: nothing was retried
        assert query(database_url, "SELECT error FROM standmeet.outbox WHERE id = %s", (event,)) \
            == [("UnknownTopic: no route",)]
    finally:
        query(database_url, "DELETE FROM standmeet.outbox WHERE id = %s", (event,))


def test_a_job_id_in_digits_other_than_ascii_is_refused_in_one_line(subprocess_env):
    refused(cli(subprocess_env, "jobs", "show", "1" * 32), 1, "no job")  # ASCII: looked up, and missing
    refused(cli(subprocess_env, "jobs", "show", ("1" * 32).translate(ARABIC_INDIC)), 2, "argument id", "ASCII")


@pytest.mark.parametrize("args, names", [
    (("jobs", "list", "--queue", ""), "--queue"),
    (("jobs", "list", "--actor", ""), "--actor"),
    (("jobs", "list", "--search", ""), "--search"),
    (("jobs", "list", "--error", ""), "--error"),
    (("jobs", "cancel", "--queue", ""), "--queue"),
    (("jobs", "retry", "--state", "rejected", "--actor", ""), "--actor"),
    (("outbox", "list", "--topic", ""), "--topic"),
    (("outbox", "retry", "--failed", "--topic", ""), "--topic"),
], ids=lambda v: " ".join(v) + "''" if isinstance(v, tuple) else None)
def test_an_empty_filter_is_refused_in_one_line_rather_than_taken_as_no_filter(database_url, subprocess_env,
                                                                              rejected_job, args, names):
    before = _actions(database_url)
    refused(cli(subprocess_env, *args), 2, names, "empty")
    assert _actions(database_url) == before
    assert query(database_url, "SELECT \"state\"::text FROM dramatiq.queue WHERE message_id = %s",
                 (rejected_job,)) == [("rejected",)]


def test_emit_refuses_a_payload_integer_past_pythons_digit_limit_in_one_line_and_emits_nothing(
        database_url, subprocess_env):
    before = scalar(database_url, "SELECT count(*) FROM standmeet.outbox")
    payload = '{"document_id": ' + "1" * 5000 + "}"
    refused(cli(subprocess_env, "emit", "document.written", "--payload", payload), 1, "--payload", "4300 digits")
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox") == before


@pytest.fixture
def many_rows(database_url: str) -> Iterator[None]:
    """Jobs and worker processes enough for `jobs list --limit 1000 --json` and `status --json`
    to print more than a pipe holds (the command is still writing when its reader goes)."""
    put_jobs(database_url, QUEUE, MANY, actor="cli_input.job")
    query(database_url, "INSERT INTO standmeet.worker_processes (id, hostname, pid, queues, stopped_at)"
                        " SELECT gen_random_uuid(), 'cli-input-' || i, i, ARRAY[%s], now()"
                        " FROM generate_series(1, %s) AS i", (QUEUE, MANY))
    yield
    drop_queue(database_url, QUEUE)
    query(database_url, "DELETE FROM standmeet.worker_processes WHERE hostname LIKE 'cli-input-%%'")


@pytest.mark.parametrize("args", [("jobs", "list", "--limit", str(MANY), "--json"), ("status", "--json"),
                                  ("jobs", "list", "--limit", str(MANY))],
                         ids=["jobs list --json", "status --json", "jobs list"])
def test_a_reader_that_goes_away_after_the_first_line_ends_the_command_quietly(subprocess_env, many_rows, args):
    # Given the command's output, buffered as in an operator's shell, read by someone who
    # stops after one line (`| head -1`)
    env = {k: v for k, v in subprocess_env.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen([*CLI, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()
        # When it writes the rest
        stderr = proc.stderr.read().decode()
        status = proc.wait(timeout=60)
    # Then it exits without a traceback or a complaint about the pipe
    assert first, stderr
    assert status in (1, 141, -13), (status, stderr)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr and "Exception ignored" not in stderr, stderr


def test_check_exits_1_in_one_line_when_the_database_is_unreachable(subprocess_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    unreachable = {**subprocess_env, "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/app"}
    result = cli(unreachable, "check")
    refused(result, 1, "cannot reach the database", f"127.0.0.1:{port}")
    assert "ok:" not in result.stdout, result.stdout


def test_check_exits_1_in_one_line_when_the_schema_is_not_migrated(subprocess_env, admin_url):
    name = testdb.unique_name("smt_check_unmigrated")
    testdb.query(admin_url, f'CREATE DATABASE "{name}"')
    try:
        result = cli({**subprocess_env, "DATABASE_URL": testdb.with_dbname(admin_url, name)}, "check")
        refused(result, 1, "run `standmeet-jobs migrate`")
        assert "ok:" not in result.stdout, result.stdout
    finally:
        testdb.drop_database(admin_url, name)


def test_check_passes_on_a_reachable_migrated_database_saying_what_it_did(subprocess_env):
    result = cli(subprocess_env, "check", "--queues", "index")
    assert result.returncode == 0, result.stderr
    assert "ok: index.max_workers 4 + relay 1 = 5" in result.stdout, result.stdout
