"""The command line against bad input, a missing or unmigrated database, and secrets: one line
naming the cause, a non-zero exit, quickly, and never a traceback."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import db as testdb
from tests.support.procs import ROOT
from tests.support.smtp import smtp_server


def cli(env: dict[str, str], *args: str, cwd: Path = ROOT, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], env=env, cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=60)


def refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one line a refusal prints (exit 1, no traceback), checked for ``words``."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("standmeet-jobs:")]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "payload, words",
    [
        ('{"document_id": NaN}', "nan"),
        ('{"document_id": 1, "x": Infinity}', "inf"),
        ('{"document_id": 1, "x": "a\\u0000b"}', "NUL"),
        ('{"document_id": 1, "x": "\\ud800"}', "lone surrogate"),
        ("[" * 20_000 + "]" * 20_000, "nested too deeply"),
        ('{"document_id": 1, "x": ' + "[" * 40 + "]" * 40 + "}", "deeper than 32"),
        ("not json", "not JSON"),
    ],
)
def test_emit_refuses_bad_payloads_with_one_line(subprocess_env, payload, words):
    refused(cli(subprocess_env, "emit", "document.written", "--payload", payload), words)


def test_write_and_search_refuse_bad_input(subprocess_env, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("Title\n" + "x" * 500)
    refused(cli({**subprocess_env, "STANDMEET_DOCUMENT_MAX_BYTES": "100"}, "write", str(big)),
            "over the limit of 100", "STANDMEET_DOCUMENT_MAX_BYTES")
    nul = tmp_path / "nul.txt"
    nul.write_text("Title\nbefore\x00after")
    refused(cli(subprocess_env, "write", str(nul)), "NUL")
    refused(cli(subprocess_env, "search", "kettle", "--limit", "-1"), "--limit")


@pytest.mark.parametrize("limit", ["nan", "inf", "-1", "0"])
def test_sources_add_refuses_a_time_limit_that_is_not_finite_and_positive(subprocess_env, limit):
    env = {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    refused(cli(env, "sources", "add", "http://127.0.0.1:9/feed", "--kind", "json", "--time-limit-s", limit),
            "time limit")


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest", "http://100.100.100.200/", "http://[::ffff:a9fe:a9fe]/",
                                 "http://[fd00:ec2::254]/", "http://100.64.1.1/", "http://[2002:7f00:1::]/",
                                 "http://" + "a" * 70 + ".example/", "http://example.test:99999/"])
def test_webhooks_and_sources_refuse_forbidden_urls_metadata_even_when_allowed(subprocess_env, url):
    refused(cli(subprocess_env, "webhooks", "add", url, "--events", "x"))
    refused(cli(subprocess_env, "sources", "add", url, "--kind", "json"))
    if "169.254.169.254" in url or "100.100.100.200" in url:
        everything = {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "0.0.0.0/0,::/0"}
        refused(cli(everything, "webhooks", "add", url, "--events", "x"), "cloud metadata")


def test_database_problems_are_one_line_naming_the_cause_within_15_s(subprocess_env, tmp_path, admin_url):
    doc = tmp_path / "doc.txt"
    doc.write_text("Title\nbody\n")
    commands = [("emit", "document.written", "--payload", '{"document_id": 1}'), ("write", str(doc)),
                ("sources", "list"), ("webhooks", "list"), ("search", "x")]
    malformed = {**subprocess_env, "DATABASE_URL": "postgresql://u:hunter2@[::1"}
    port = _closed_port()
    unreachable = {**subprocess_env, "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/app"}
    for args in commands:
        line = refused(cli(malformed, *args), "DATABASE_URL")
        assert "hunter2" not in line
        start = time.monotonic()
        refused(cli(unreachable, *args), f"127.0.0.1:{port}")
        assert time.monotonic() - start < 15
    with smtp_server() as (smtp_port, _):
        env = {**unreachable, "STANDMEET_SMTP_HOST": "127.0.0.1", "STANDMEET_SMTP_PORT": str(smtp_port)}
        refused(cli(env, "mail", "test", "ops@example.test"), f"127.0.0.1:{port}")
    # a database nobody migrated: the command to run is named
    name = testdb.unique_name("smt_unmigrated")
    with testdb.psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(testdb.sql.SQL("CREATE DATABASE {}").format(testdb.sql.Identifier(name)))
    try:
        empty = {**subprocess_env, "DATABASE_URL": testdb.with_dbname(admin_url, name)}
        for args in commands:
            refused(cli(empty, *args), "run `standmeet-jobs migrate`")
    finally:
        testdb.drop_database(admin_url, name)


def test_mail_test_names_the_smtp_server_when_it_is_unreachable(subprocess_env):
    port = _closed_port()
    env = {**subprocess_env, "STANDMEET_SMTP_HOST": "127.0.0.1", "STANDMEET_SMTP_PORT": str(port)}
    start = time.monotonic()
    result = cli(env, "mail", "test", "ops@example.test")
    assert time.monotonic() - start < 15
    refused(result, f"127.0.0.1:{port}", "SMTP")


def test_webhook_secrets_from_a_file_or_stdin_short_ones_refused_never_printed_or_stored(
    subprocess_env, database_url, tmp_path
):
    env = {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    short = "whsec_" + base64.b64encode(b"x" * 10).decode()
    line = refused(cli(env, "webhooks", "add", "http://127.0.0.1:9/h", "--events", "x", "--secret", short),
                   "at least 24")
    assert short not in line
    refused(cli(env, "webhooks", "add", "http://127.0.0.1:9/h", "--events", "x", "--secret", "whsec_"), "at least 24")
    secrets = ["whsec_" + base64.b64encode(f"secret number {n} for the dump check".encode()).decode() for n in range(3)]
    given = cli(env, "webhooks", "add", "http://127.0.0.1:9/a", "--events", "x", "--secret", secrets[0])
    path = tmp_path / "secret"
    path.write_text(secrets[1] + "\n")
    from_file = cli(env, "webhooks", "add", "http://127.0.0.1:9/b", "--events", "x", "--secret-file", str(path))
    from_stdin = cli(env, "webhooks", "add", "http://127.0.0.1:9/c", "--events", "x", "--secret", "-",
                     stdin=secrets[2] + "\n")
    listed = cli(env, "webhooks", "list")
    for result in (given, from_file, from_stdin, listed):
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        assert not any(s in result.stdout or s in result.stderr for s in secrets)
    from tests.integration.test_webhook_secrets import database_text

    dump = database_text(database_url)
    assert not any(s in dump or s.removeprefix("whsec_") in dump for s in secrets)
    assert "secret number" not in dump


def test_db_url_is_the_same_from_any_working_directory(subprocess_env, tmp_path):
    here = cli(subprocess_env, "db", "url")
    elsewhere = cli(subprocess_env, "db", "url", cwd=tmp_path)
    assert here.returncode == elsewhere.returncode == 0
    assert here.stdout == elsewhere.stdout and here.stdout.strip()


def test_a_forbidden_url_or_short_secret_is_refused_before_the_database_is_needed(subprocess_env):
    down = {**subprocess_env, "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{_closed_port()}/app"}
    refused(cli(down, "webhooks", "add", "http://169.254.169.254/", "--events", "x"), "cloud metadata")
    refused(cli(down, "sources", "add", "http://100.100.100.200/", "--kind", "rss"), "cloud metadata")
    refused(cli(down, "sources", "add", "http://8.8.8.8/", "--kind", "rss", "--time-limit-s", "nan"), "time limit")
    refused(cli(down, "webhooks", "add", "http://8.8.8.8/", "--events", "x", "--secret", "whsec_AAAA"), "at least 24")


def parser_refused(result: subprocess.CompletedProcess[str], option: str, *words: str) -> str:
    """The one line the parser prints for an option out of range (exit 2, no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"argument {option}: " in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args, option, words", [
    (("jobs", "list", "--since", "99999999999d"), "--since", ("'99999999999d' is too long ago", "0s to 36500d")),
    (("jobs", "list", "--since", "1" + "0" * 400 + "s"), "--since", ("0s to 36500d",)),
    (("jobs", "retry", "--state", "rejected", "--since", "36501d"), "--since", ("0s to 36500d",)),
    (("jobs", "cancel", "--queue", "index", "--since", "99999999999d"), "--since", ("0s to 36500d",)),
    (("jobs", "list", "--limit", "0"), "--limit", ("give 1 to 1000",)),
    (("jobs", "list", "--limit", "99999999999999999999999"), "--limit", ("give 1 to 1000",)),
    (("jobs", "list", "--offset", "-1"), "--offset", ("give 0 to 100000000",)),
    (("jobs", "list", "--offset", "1e9"), "--offset", ("not a whole number",)),
    (("status", "--check", "--max-age-s", "nan"), "--max-age-s", ("give 0 to 2592000",)),
    (("status", "--check", "--max-age-s", "inf"), "--max-age-s", ("give 0 to 2592000",)),
    (("status", "--check", "--max-age-s", "-5"), "--max-age-s", ("give 0 to 2592000",)),
    (("outbox", "list", "--limit", "-1"), "--limit", ("give 1 to 1000",)),
    (("webhooks", "deliveries", "99999999999999999999"), "endpoint", ("give 1 to 9223372036854775807",)),
    (("webhooks", "deliveries", "--limit", "100000"), "--limit", ("give 1 to 1000",)),
    (("dashboard", "--port", "70000"), "--port", ("give 1 to 65535",)),
    (("dashboard", "--port", "-1"), "--port", ("give 1 to 65535",)),
])
def test_numbers_and_ages_out_of_range_are_refused_by_the_parser_in_one_line(subprocess_env, args, option, words):
    down = {**subprocess_env, "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{_closed_port()}/app"}
    parser_refused(cli(down, *args), option, *words)  # before any database is needed


@pytest.mark.parametrize("args, words", [
    (("--worker-shutdown-timeout", "-5"), "--worker-shutdown-timeout -5: give 0 to 86400000 milliseconds"),
    (("--worker-shutdown-timeout", "99999999999999"), "give 0 to 86400000 milliseconds"),
    (("--threads", "100000"), "--threads 100000: give 1 to 10000 threads per worker process"),
    (("--processes", "99999999999"), "--processes 99999999999: give 1 to 1000000 worker processes"),
])
def test_run_refuses_numbers_out_of_range_before_starting_anything(subprocess_env, args, words):
    result = cli(subprocess_env, "run", "--no-scheduler", *args)
    assert result.returncode == 78, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("standmeet-jobs: --") and words in line, line
    assert "Traceback" not in result.stderr and "started pid" not in result.stderr, result.stderr


def test_check_refuses_numbers_out_of_range_in_one_line(subprocess_env):
    refused(cli(subprocess_env, "check", "--threads", "-1"), "--threads -1: give 1 to 10000 threads")
    refused(cli(subprocess_env, "check", "--processes", "0"), "--processes 0: give 1 to 1000000")


@pytest.mark.parametrize("args, status, words", [
    (("--worker-shutdown-timeout", "-5"), 78, "worker: --worker-shutdown-timeout -5: give 0 to 86400000 milliseconds"),
    (("--threads", "-2"), 78, "worker: --threads -2: give 1 to 10000 threads"),
    (("--threads", "inf"), 2, "python -m broker.worker: argument --threads: invalid int value: 'inf'"),
])
def test_the_worker_refuses_numbers_out_of_range_in_one_line(subprocess_env, args, status, words):
    result = subprocess.run([sys.executable, "-m", "broker.worker", "tests.support.jobs", *args], env=subprocess_env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(words), line
    assert "Traceback" not in result.stderr


def test_the_scheduler_refuses_a_bad_argument_in_one_line(subprocess_env):
    result = subprocess.run([sys.executable, "-m", "periodic", "--supervised-by", "me"], env=subprocess_env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "python -m periodic: argument --supervised-by: invalid int value: 'me'"], result.stderr


def test_migrate_says_an_unreachable_database_in_one_line(subprocess_env):
    port = _closed_port()
    result = cli({**subprocess_env, "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/app"}, "migrate")
    line = refused(result, "cannot connect to migrate", f"{port}")
    # every other line is a log line of its own (a time first), none the rest of that message
    others = [ln for ln in result.stderr.splitlines() if ln and ln != line]
    assert all(ln[:4].isdigit() for ln in others), result.stderr
