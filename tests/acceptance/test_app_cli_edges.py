"""The application's settings and commands at their edges, as real processes: every number
has a maximum, a wait is finite, `write` exits once it has its answer, `webhooks add`
labels what it prints, and `webhooks rotate-secrets` re-encrypts under a new key."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from cryptography.fernet import Fernet

from actors.settings import AppSettings
from broker.settings import variable
from tests.support.db import query, scalar
from tests.support.procs import ROOT, worker_cmd

A, B, C = (Fernet.generate_key().decode() for _ in range(3))
#: Every numeric setting of the application, with a value far past any maximum.
NUMERIC = [(variable(name, info), "1" + "0" * 300 if info.annotation is int else "1e300")
           for name, info in AppSettings.model_fields.items() if info.annotation in (int, float)]


def cli(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], env=env, cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=60)


def one_line(result: subprocess.CompletedProcess[str], status: int = 1) -> str:
    """The one line a refusal prints (no traceback)."""
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("standmeet-jobs:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("name, value", NUMERIC, ids=[name for name, _ in NUMERIC])
def test_check_refuses_every_numeric_setting_past_its_finite_maximum_in_one_line(subprocess_env, name, value):
    line = one_line(cli({**subprocess_env, name: value}, "check"))
    assert f"{name}=" in line and "is above its maximum of" in line, line


def test_a_worker_refuses_to_start_with_a_setting_past_its_maximum_in_one_line(subprocess_env):
    started = subprocess.run(worker_cmd(module="actors"), env={**subprocess_env, "STANDMEET_WEBHOOK_LEASE_S": "1e300"},
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert started.returncode == 78, (started.returncode, started.stderr)
    assert "Traceback" not in started.stderr
    lines = [line for line in started.stderr.splitlines() if "STANDMEET_WEBHOOK_LEASE_S" in line]
    assert len(lines) == 1 and "is above its maximum of 3600" in lines[0], started.stderr


@pytest.mark.parametrize("wait", ["1e300", "inf", "nan", "-1", "3601"])
def test_write_refuses_a_wait_that_is_not_finite_and_bounded_before_storing_anything(
    subprocess_env, database_url, tmp_path, wait
):
    doc = tmp_path / "doc.txt"
    doc.write_text("Title\nbody")
    before = scalar(database_url, "SELECT count(*) FROM standmeet.documents")
    line = one_line(cli(subprocess_env, "write", str(doc), "--wait-s", wait))
    assert "--wait-s" in line and "from 0 to 3600" in line, line
    assert scalar(database_url, "SELECT count(*) FROM standmeet.documents") == before


def test_write_exits_as_soon_as_it_has_printed_its_answer(subprocess_env, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Title\nbody")
    gaps = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "broker.cli", "write", str(doc), "--wait-s", "0"],
                                env=subprocess_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None
            answer = json.loads(proc.stdout.readline())
            answered = time.monotonic()
            assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
            gaps.append(time.monotonic() - answered)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert answer["indexed"] is False and answer["id"] > 0
    # Nothing is left to do once the answer is out: closing its connections takes
    # a tenth of a second, not the second the receipts listener spent waiting out its poll
    assert min(gaps) < 0.5, gaps


def test_webhooks_add_labels_its_fields_and_prints_json_never_echoing_a_given_secret(subprocess_env):
    env = {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    added = cli(env, "webhooks", "add", "http://127.0.0.1:9/labelled", "--events", "a.b, c.d")
    assert added.returncode == 0, added.stderr
    fields = dict(line.split(": ", 1) for line in added.stdout.splitlines())
    assert list(fields) == ["id", "url", "events", "secret"]
    assert int(fields["id"]) > 0 and fields["url"] == "http://127.0.0.1:9/labelled" and fields["events"] == "a.b,c.d"
    assert fields["secret"].startswith("whsec_")
    as_json = cli(env, "webhooks", "add", "http://127.0.0.1:9/json", "--events", "x", "--json")
    assert as_json.returncode == 0, as_json.stderr
    made = json.loads(as_json.stdout)
    assert made["id"] == int(fields["id"]) + 1 and made["url"] == "http://127.0.0.1:9/json"
    assert made["events"] == ["x"] and made["secret"].startswith("whsec_")
    given = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWY="
    quiet = cli(env, "webhooks", "add", "http://127.0.0.1:9/given", "--events", "x", "--json", "--secret", "-",
                stdin=given + "\n")
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["secret"] is None and given not in quiet.stdout + quiet.stderr


def test_rotate_secrets_re_encrypts_with_the_first_key_once_and_names_what_no_key_decrypts(
    subprocess_env, database_url
):
    env = {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    tests_key = subprocess_env["STANDMEET_SECRET_KEY"]  # the other tests' endpoints are under it
    for key, n in ((A, 1), (A, 2), (C, 3)):
        assert cli({**env, "STANDMEET_SECRET_KEY": key}, "webhooks", "add", f"http://127.0.0.1:9/r{n}",
                   "--events", "x").returncode == 0
    lost = scalar(database_url, "SELECT id FROM standmeet.webhook_endpoints WHERE url = 'http://127.0.0.1:9/r3'")
    everything = scalar(database_url, "SELECT count(*) FROM standmeet.webhook_endpoints")
    # B first, A still decrypts: everything not under B is re-encrypted, in batches of one
    rotated = cli({**env, "STANDMEET_SECRET_KEY": f"{B}, {A},{tests_key}"}, "webhooks", "rotate-secrets",
                  "--batch-size", "1")
    line = one_line(rotated)
    assert line == (f"standmeet-jobs: webhook endpoint {lost}: secret 1 of 1 cannot be decrypted by any key "
                    "of STANDMEET_SECRET_KEY; left as it is")
    assert rotated.stdout.startswith(f"re-encrypted {everything - 1} secret(s) with the first key"), rotated.stdout
    again = cli({**env, "STANDMEET_SECRET_KEY": f"{B},{A},{tests_key}"}, "webhooks", "rotate-secrets")
    assert again.stdout.startswith("re-encrypted 0 secret(s)") and f"{everything - 1} already were" in again.stdout
    stored = [s for (secrets,) in query(database_url, "SELECT secrets FROM standmeet.webhook_endpoints WHERE id <> %s",
                                        (lost,)) for s in secrets]
    assert all(Fernet(B.encode()).decrypt(s.removeprefix("fernet:").encode()) for s in stored)
    # a malformed key: the variable and its position, one line, before the database is read
    bad = one_line(cli({**env, "STANDMEET_SECRET_KEY": f"{B},not-a-key"}, "webhooks", "rotate-secrets"))
    assert "STANDMEET_SECRET_KEY: key 2 of 2 is not a Fernet key" in bad and B not in bad


@pytest.mark.parametrize("count", ["0", "-5", "100000000"])
def test_webhooks_ping_refuses_a_count_out_of_its_range_in_one_line(subprocess_env, count):
    refused = cli(subprocess_env, "webhooks", "ping", "1", "--count", count)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"standmeet-jobs webhooks ping: argument --count: {count} is out of range: give 1 to 10000"]


def test_webhooks_replay_takes_an_age_or_a_time_and_refuses_anything_else_in_one_line(subprocess_env):
    for since in ("2h", "2026-01-01T00:00:00"):  # (a time with no zone is UTC, as everywhere in the CLI)
        replayed = cli(subprocess_env, "webhooks", "replay", "--failed-since", since)
        assert replayed.returncode == 0 and replayed.stdout.endswith("delivery(ies) queued again\n"), replayed.stderr
    refused = cli(subprocess_env, "webhooks", "replay", "--failed-since", "last tuesday")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "standmeet-jobs: --failed-since 'last tuesday' is neither an ISO time nor an age like 15m, 2h or 1d"]
