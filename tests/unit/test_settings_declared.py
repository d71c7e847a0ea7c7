"""Settings declared once: the contract of variable names, one-line refusals, undeclared
variables, the application's settings apart from the runtime's, and the configuration page's tables."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors import settings as app_settings
from actors.settings import AppSettings
from broker import app
from broker.errors import ConfigError, StartupRefused
from broker.settings import Settings, declared_variables, replace, undeclared, warn_undeclared

ROOT = Path(__file__).resolve().parent.parent.parent

#: Every variable an operator may have set before the settings were declared once: an
#: outside contract, none may be renamed or dropped.
CONTRACT = """DATABASE_URL STANDMEET_EMBEDDED_DIR STANDMEET_SECRET_KEY STANDMEET_DOCUMENT_MAX_BYTES
STANDMEET_POOL_MAX_SIZE STANDMEET_BROKER_ACK_CONNECTIONS STANDMEET_UNKNOWN_ACTOR_DELAY_S
STANDMEET_UNKNOWN_ACTOR_MAX_CLAIMS STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S STANDMEET_MAX_RETRIES
STANDMEET_MIN_BACKOFF_MS STANDMEET_MAX_BACKOFF_MS STANDMEET_HEARTBEAT_S STANDMEET_RESCUE_AFTER_S
STANDMEET_MAX_CRASHES STANDMEET_RETENTION_DAYS STANDMEET_PRUNE_BATCH STANDMEET_OUTBOX_MAX_PAYLOAD_BYTES
STANDMEET_RELAY_BATCH STANDMEET_RELAY_POLL_S STANDMEET_OUTBOX_RETENTION_HOURS STANDMEET_MAX_WAITERS
STANDMEET_RECEIPT_WAIT_S STANDMEET_SMTP_HOST STANDMEET_SMTP_PORT STANDMEET_SMTP_FROM STANDMEET_SMTP_STARTTLS
STANDMEET_SMTP_USERNAME STANDMEET_SMTP_PASSWORD STANDMEET_SMTP_TIMEOUT_S STANDMEET_SEARCH_BACKEND
STANDMEET_MEILI_URL STANDMEET_MEILI_KEY STANDMEET_MEILI_INDEX STANDMEET_WEBHOOK_ALLOWED_NETWORKS
STANDMEET_WEBHOOK_LEASE_S STANDMEET_WEBHOOK_HTTP_TIMEOUT_S STANDMEET_WEBHOOK_BUSY_SNOOZE_S
STANDMEET_WEBHOOK_DISABLE_AFTER_DAYS STANDMEET_LOG_FORMAT STANDMEET_METRICS_PORT STANDMEET_METRICS_HOST
STANDMEET_DASHBOARD_USER STANDMEET_DASHBOARD_PASSWORD STANDMEET_DASHBOARD_HIDE_ARGS
STANDMEET_POOLER STANDMEET_PREPARED_STATEMENTS STANDMEET_LISTEN_DATABASE_URL STANDMEET_UNLISTENED_POLL_S
STANDMEET_TCP_USER_TIMEOUT_MS STANDMEET_SERVER_CONNECTIONS_RESERVE STANDMEET_OUTBOX_UNROUTED_MAX_AGE_S
STANDMEET_QUEUE_UNSERVED_MAX_AGE_S STANDMEET_POOLER_POOL_SIZE STANDMEET_DASHBOARD_ALLOWED_HOSTS
STANDMEET_DASHBOARD_SECURE_COOKIE STANDMEET_MESSAGE_MAX_BYTES STANDMEET_MAX_RUNS_WITHOUT_OUTCOME
STANDMEET_HISTORY_RETENTION_DAYS""".split()

APPLICATION = {"smtp_host", "smtp_port", "smtp_from", "smtp_starttls", "smtp_username", "smtp_password",
               "smtp_timeout_s", "search_backend", "meili_url", "meili_key", "meili_index", "allowed_networks",
               "webhook_lease_s", "webhook_http_timeout_s", "webhook_busy_snooze_s", "webhook_disable_after_days",
               "secret_key", "document_max_bytes"}


def test_every_variable_of_the_contract_is_declared_once():
    runtime, application = Settings.variables(), AppSettings.variables()
    assert not set(runtime) & set(application)
    assert sorted(set(runtime) | set(application)) == sorted(CONTRACT)
    assert AppSettings in app.REGISTRY.settings and set(declared_variables()) == set(CONTRACT)


def test_the_runtime_declares_none_of_the_applications_settings():
    assert not APPLICATION & set(Settings.model_fields)
    assert APPLICATION == set(AppSettings.model_fields)


@pytest.mark.parametrize("cls", [Settings, AppSettings])
def test_each_declaration_has_a_one_line_description(cls):
    for name, info in cls.model_fields.items():
        if name == "queue_env":
            continue
        assert info.description and "\n" not in info.description, name


@pytest.mark.parametrize("cls", [Settings, AppSettings])
def test_every_number_a_setting_takes_has_a_finite_upper_bound(cls):
    # Given every numeric declaration, when it is read, then it names a maximum: no value an
    # operator can type (1e300) passes `check` and overflows a timer or an allocation later
    for name, info in cls.model_fields.items():
        annotation = info.annotation
        if annotation in (int, float) or str(annotation) in ("int | None", "float | None"):
            highs = [getattr(item, "le", None) for item in info.metadata]
            assert any(high is not None and math.isfinite(high) for high in highs), name


def test_a_number_past_its_maximum_is_refused_naming_the_variable_and_the_maximum():
    with pytest.raises(ConfigError, match=r"^STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S=1e\+?300 is above its maximum of 86400$"):
        Settings.from_env({"STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S": "1e300"})
    with pytest.raises(ConfigError, match=r"^STANDMEET_QUEUE_REPORTS_TIME_LIMIT_S='1e9' is above its maximum of 604800$"):
        Settings.from_env({"STANDMEET_QUEUE_REPORTS_TIME_LIMIT_S": "1e9"})


def test_the_environment_gives_every_declared_type():
    runtime = Settings.from_env({"STANDMEET_HEARTBEAT_S": "2.5", "STANDMEET_MAX_RETRIES": " 7 ",
                                 "STANDMEET_LOG_FORMAT": "JSON", "STANDMEET_DASHBOARD_HIDE_ARGS": "yes",
                                 "STANDMEET_METRICS_PORT": "9100", "STANDMEET_EMBEDDED_DIR": "~/pg",
                                 "STANDMEET_POOL_MAX_SIZE": "  "})
    assert (runtime.heartbeat_s, runtime.max_retries, runtime.log_format) == (2.5, 7, "json")
    assert runtime.dashboard_hide_args is True and runtime.metrics_port == 9100
    assert runtime.embedded_dir == Path("~/pg").expanduser() and runtime.pool_max_size == 40  # blank: unset
    mine = AppSettings.from_env({"STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/8, ::1/128,",
                                 "STANDMEET_MEILI_URL": "http://meili:7700/", "STANDMEET_SMTP_STARTTLS": "1",
                                 "STANDMEET_SECRET_KEY": " ", "STANDMEET_SEARCH_BACKEND": "Meilisearch"})
    assert mine.allowed_networks == ("127.0.0.0/8", "::1/128")
    assert (mine.meili_url, mine.smtp_starttls, mine.secret_key, mine.search_backend) == (
        "http://meili:7700", True, None, "meilisearch")


@pytest.mark.parametrize("cls, variable, value, words", [
    (Settings, "STANDMEET_HEARTBEAT_S", "inf", "STANDMEET_HEARTBEAT_S='inf' is not a finite number"),
    (Settings, "STANDMEET_RELAY_POLL_S", "nan", "STANDMEET_RELAY_POLL_S='nan' is not a finite number"),
    (Settings, "STANDMEET_RETENTION_DAYS", "-1", "STANDMEET_RETENTION_DAYS=-1 is below its minimum of 0"),
    (Settings, "STANDMEET_MAX_RETRIES", "many", "STANDMEET_MAX_RETRIES='many' is not a whole number"),
    (Settings, "STANDMEET_PRUNE_BATCH", "2.5", "STANDMEET_PRUNE_BATCH='2.5' is not a whole number"),
    (Settings, "STANDMEET_RELAY_POLL_S", "soon", "STANDMEET_RELAY_POLL_S='soon' is not a number"),
    (Settings, "STANDMEET_METRICS_PORT", "70000", "STANDMEET_METRICS_PORT=70000 is above its maximum of 65535"),
    (Settings, "STANDMEET_LOG_FORMAT", "xml", "STANDMEET_LOG_FORMAT=xml is not one of text or json"),
    (Settings, "STANDMEET_DASHBOARD_HIDE_ARGS", "maybe", "STANDMEET_DASHBOARD_HIDE_ARGS='maybe' is not a yes/no"),
    (AppSettings, "STANDMEET_SMTP_TIMEOUT_S", "-inf", "STANDMEET_SMTP_TIMEOUT_S='-inf' is not a finite number"),
    (AppSettings, "STANDMEET_SMTP_PORT", "0", "STANDMEET_SMTP_PORT=0 is below its minimum of 1"),
    (AppSettings, "STANDMEET_DOCUMENT_MAX_BYTES", "1MB", "STANDMEET_DOCUMENT_MAX_BYTES='1MB' is not a whole number"),
    (AppSettings, "STANDMEET_SEARCH_BACKEND", "elastic", "STANDMEET_SEARCH_BACKEND=elastic is not one of"),
    (AppSettings, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS", "10.0.0.0/8,intranet",
     "STANDMEET_WEBHOOK_ALLOWED_NETWORKS: 'intranet' is not a network in CIDR form"),
])
def test_a_bad_value_is_one_line_naming_the_variable(cls, variable, value, words):
    with pytest.raises(ConfigError) as refused:
        cls.from_env({variable: value})
    text = str(refused.value)
    assert text.startswith(variable) and words in text and "\n" not in text
    assert "pydantic" not in text and "validation error" not in text


def test_the_rules_between_settings_are_refused_naming_both_variables():
    with pytest.raises(ConfigError, match="STANDMEET_RESCUE_AFTER_S=9 must be at least twice STANDMEET_HEARTBEAT_S=5"):
        Settings.from_env({"STANDMEET_HEARTBEAT_S": "5", "STANDMEET_RESCUE_AFTER_S": "9"})
    with pytest.raises(ConfigError, match="STANDMEET_MIN_BACKOFF_MS=10 is above STANDMEET_MAX_BACKOFF_MS=5"):
        Settings.from_env({"STANDMEET_MIN_BACKOFF_MS": "10", "STANDMEET_MAX_BACKOFF_MS": "5"})
    with pytest.raises(ConfigError, match="STANDMEET_WEBHOOK_HTTP_TIMEOUT_S=20 must be below STANDMEET_WEBHOOK_LEASE_S"):
        AppSettings.from_env({"STANDMEET_WEBHOOK_HTTP_TIMEOUT_S": "20"})


def test_the_webhook_timings_must_nest_around_the_queues_limit_at_start_up():
    from actors.queues import webhook_timings_nest

    webhook_timings_nest(Settings.from_env({}))  # 10 < 15 < 20
    with pytest.raises(StartupRefused, match="STANDMEET_QUEUE_WEBHOOK_TIME_LIMIT_S=25") as refused:
        webhook_timings_nest(Settings.from_env({"STANDMEET_QUEUE_WEBHOOK_TIME_LIMIT_S": "25"}))
    assert isinstance(refused.value, ConfigError) and "\n" not in str(refused.value)
    with app_settings.overridden(webhook_http_timeout_s=16.0), pytest.raises(StartupRefused, match="HTTP_TIMEOUT_S=16"):
        webhook_timings_nest(Settings.from_env({}))


def test_replace_validates_like_the_environment():
    settings = Settings.from_env({})
    assert replace(settings, heartbeat_s=0.5, rescue_after_s=3.0).heartbeat_s == 0.5
    assert settings.heartbeat_s == 5.0  # frozen: a copy
    with pytest.raises(ConfigError, match="STANDMEET_HEARTBEAT_S=-1 is below its minimum"):
        replace(settings, heartbeat_s=-1)
    with pytest.raises(ConfigError, match="STANDMEET_RESCUE_AFTER_S"):
        replace(settings, heartbeat_s=30.0)
    with pytest.raises(ConfigError, match="not a finite number"):
        replace(AppSettings.from_env({}), smtp_timeout_s=math.inf)
    assert replace(settings, database_url="postgresql://db/app").database_url == "postgresql://db/app"


def test_the_tests_environment_derives_from_the_declarations():
    from tests.conftest import TEST_OVERRIDES

    env = {f"STANDMEET_{name.upper()}": str(value) for name, value in TEST_OVERRIDES.items()}
    assert set(env) <= set(Settings.variables())
    built = Settings.from_env(env)
    assert all(getattr(built, name) == value for name, value in TEST_OVERRIDES.items())


def test_the_applications_settings_are_built_once_per_process_and_can_be_swapped():
    first = app_settings.current()
    assert app_settings.current() is first
    with app_settings.overridden(smtp_port=2525) as changed:
        assert app_settings.current() is changed and changed.smtp_port == 2525
    assert app_settings.current() is first
    app_settings.use(None)
    assert app_settings.current() is not first and app_settings.current() == first
    assert app.setting("webhook_busy_snooze_s") == first.webhook_busy_snooze_s
    with pytest.raises(ConfigError, match="no loaded application declares the setting 'smtp_hots'"):
        app.setting("smtp_hots")


def test_an_undeclared_variable_is_named_with_the_nearest_declared_one():
    lines = undeclared({"STANDMEET_HEARTBEAT": "3", "STANDMEET_SMPT_HOST": "mail", "STANDMEET_HEARTBEAT_S": "5",
                        "STANDMEET_QUEUE_BULK_EMAIL_POLL_S": "2", "STANDMEET_QUEUE_X_MAX_WORKERS": "1",
                        "STANDMEET_SMTP_PASWORD": "hunter2", "OTHER_HEARTBEAT": "1", "DATABASE_URL": "x"})
    assert lines == [
        "STANDMEET_HEARTBEAT=3 is not a setting; did you mean STANDMEET_HEARTBEAT_S?",
        "STANDMEET_SMPT_HOST=mail is not a setting; did you mean STANDMEET_SMTP_HOST?",
        "STANDMEET_SMTP_PASWORD=*** is not a setting; did you mean STANDMEET_SMTP_PASSWORD?",
    ]


def test_an_undeclared_variable_is_logged_once_per_process(caplog):
    env = {"STANDMEET_RETENTION_DAY": "3"}
    with caplog.at_level(logging.WARNING, logger="standmeet.broker.settings"):
        assert warn_undeclared(env) == warn_undeclared(env)
    logged = [r.getMessage() for r in caplog.records if "STANDMEET_RETENTION_DAY=" in r.getMessage()]
    assert logged == ["STANDMEET_RETENTION_DAY=3 is not a setting; did you mean STANDMEET_RETENTION_DAYS?"]


def test_check_prints_an_undeclared_variable_as_a_warning_before_it_checks_the_database():
    env = {**os.environ, "STANDMEET_HEARTBEAT": "3", "STANDMEET_QUEUE_INDEX_POLL_S": "2",
           "DATABASE_URL": "postgresql://check.invalid/none", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "broker.cli", "check"], env=env, capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    # (the warning does not fail it; the database it cannot reach does, in one line)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "check.invalid" in result.stderr.strip().splitlines()[-1], result.stderr
    assert "warning: STANDMEET_HEARTBEAT=3 is not a setting; did you mean STANDMEET_HEARTBEAT_S?" in result.stdout
    assert "QUEUE_INDEX_POLL_S" not in result.stdout + result.stderr
    assert result.stderr.count("STANDMEET_HEARTBEAT=3 is not a setting") == 1  # logged once


def test_the_configuration_page_holds_the_tables_the_declarations_generate(monkeypatch):
    # The generator names a database when none is set: the environment is restored after.
    monkeypatch.setenv("DATABASE_URL", os.environ.get("DATABASE_URL", "postgresql://settings-table.invalid/none"))
    spec = importlib.util.spec_from_file_location("settings_table", ROOT / "scripts" / "settings_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert script.page_tables(readme) == script.tables(), (
        "docs/configuration.md's tables differ from the declarations: run python scripts/settings_table.py --write")
    for variable in CONTRACT:
        assert f"| `{variable}` |" in readme
    for suffix in ("MAX_WORKERS", "TIME_LIMIT_S", "POLL_S", "PREFETCH"):
        assert f"| `STANDMEET_QUEUE_<NAME>_{suffix}` |" in readme
