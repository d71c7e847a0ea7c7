from __future__ import annotations

import os
from pathlib import Path

import pytest

import actors.queues  # noqa: F401  (declares the application's queues these tests count)
from broker import app
from broker.errors import BudgetError, ConfigError
from broker.pg.budget import (
    BACKEND_LISTEN_CONNECTIONS,
    BACKEND_POOL_CONNECTIONS,
    SCHEDULER_TICK_THREADS,
    Connections,
    Fleet,
    ServerRoom,
    check_budget,
    check_server_room,
    compute_budget,
    process_connections,
    scheduler_connections,
)
from broker.settings import Settings

#: The queues the application (actors) declares; other test modules declare more of their
#: own in the same process, so these tests name the ones they are about.
APPLICATION_QUEUES = ("index", "notify", "webhook", "maintenance", "fetch")


def test_the_default_configuration_is_the_table_of_r1():
    settings = Settings.from_env({})
    limits = {name: (q.max_workers, q.time_limit_s)
              for name, q in settings.queues.items() if name in APPLICATION_QUEUES}
    assert limits == {
        "index": (4, 30.0), "notify": (2, 30.0), "webhook": (8, 15.0),
        "maintenance": (1, 600.0), "fetch": (3, 60.0),
    }
    assert settings.pool_max_size == 40
    assert settings.database_url is None


def test_queue_limits_and_pool_come_from_prefixed_variables():
    settings = Settings.from_env({
        "STANDMEET_QUEUE_INDEX_MAX_WORKERS": "6",
        "STANDMEET_QUEUE_WEBHOOK_TIME_LIMIT_S": "12.5",
        "STANDMEET_POOL_MAX_SIZE": "60",
        "DATABASE_URL": "postgresql://db/app",
    })
    assert settings.queue("index").max_workers == 6
    assert settings.queue("webhook").time_limit_ms == 12_500
    assert settings.pool_max_size == 60
    assert settings.database_url == "postgresql://db/app"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"STANDMEET_QUEUE_INDEX_MAX_WORKERS": "four"}, "STANDMEET_QUEUE_INDEX_MAX_WORKERS='four' is not a whole number"),
        ({"STANDMEET_QUEUE_INDEX_MAX_WORKERS": "0"}, "STANDMEET_QUEUE_INDEX_MAX_WORKERS=0 is below its minimum of 1"),
        ({"STANDMEET_QUEUE_FETCH_TIME_LIMIT_S": "nan"}, "STANDMEET_QUEUE_FETCH_TIME_LIMIT_S='nan'"),
        ({"STANDMEET_POOL_MAX_SIZE": "1"}, "STANDMEET_POOL_MAX_SIZE=1 is below its minimum of 2"),
    ],
)
def test_a_malformed_setting_is_named_in_the_error(env, message):
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert message in str(info.value)


def test_the_default_budget_is_19_of_20():
    budget = check_budget(Settings.from_env({}), APPLICATION_QUEUES)
    assert budget.total == 19
    assert budget.limit == 20


def test_over_budget_names_each_term_and_the_limit():
    settings = Settings.from_env({"STANDMEET_QUEUE_NOTIFY_MAX_WORKERS": "4"})
    with pytest.raises(BudgetError) as info:
        check_budget(settings, APPLICATION_QUEUES)
    text = str(info.value)
    for term in ("index.max_workers 4", "notify.max_workers 4", "webhook.max_workers 8",
                 "maintenance.max_workers 1", "fetch.max_workers 3", "relay 1", "= 21", "= 20"):
        assert term in text


def test_a_process_serving_fewer_queues_counts_only_those():
    settings = Settings.from_env({"STANDMEET_QUEUE_WEBHOOK_MAX_WORKERS": "30"})
    assert compute_budget(settings, ["index", "notify"]).total == 7
    with pytest.raises(BudgetError):
        check_budget(settings, ["webhook"])


def test_any_queue_has_documented_defaults_and_its_own_variables():
    settings = Settings.from_env({"STANDMEET_QUEUE_BULK_EMAIL_MAX_WORKERS": "5",
                                  "STANDMEET_QUEUE_BULK_EMAIL_TIME_LIMIT_S": "42"})
    emails = settings.queue("bulk-email")
    assert (emails.max_workers, emails.time_limit_s) == (5, 42.0)
    other = settings.queue("reports")
    assert (other.max_workers, other.time_limit_s) == (1, 600.0)


def test_a_malformed_variable_of_any_queue_is_refused_with_its_name():
    with pytest.raises(ConfigError, match="STANDMEET_QUEUE_REPORTS_MAX_WORKERS"):
        Settings.from_env({"STANDMEET_QUEUE_REPORTS_MAX_WORKERS": "lots"})


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_refused_with_the_variable(value):
    with pytest.raises(ConfigError, match="STANDMEET_QUEUE_INDEX_TIME_LIMIT_S"):
        Settings.from_env({"STANDMEET_QUEUE_INDEX_TIME_LIMIT_S": value})


def test_a_rescue_window_shorter_than_two_heartbeats_is_refused():
    with pytest.raises(ConfigError, match="STANDMEET_RESCUE_AFTER_S"):
        Settings.from_env({"STANDMEET_HEARTBEAT_S": "5", "STANDMEET_RESCUE_AFTER_S": "9"})


def test_a_minimum_back_off_above_the_maximum_is_refused():
    with pytest.raises(ConfigError, match="STANDMEET_MIN_BACKOFF_MS"):
        Settings.from_env({"STANDMEET_MIN_BACKOFF_MS": "10", "STANDMEET_MAX_BACKOFF_MS": "5"})


def test_the_embedded_folder_is_the_users_data_folder_whatever_the_working_directory(tmp_path, monkeypatch):
    import platformdirs

    from broker.settings import Settings

    first = Settings.from_env({}).embedded_dir
    monkeypatch.chdir(tmp_path)
    assert Settings.from_env({}).embedded_dir == first
    assert first.is_absolute() and first == Path(platformdirs.user_data_dir("standmeet-jobs", appauthor=False)) / "pgdata"
    assert Settings.from_env({"STANDMEET_EMBEDDED_DIR": "/srv/pg"}).embedded_dir == Path("/srv/pg")


@pytest.mark.parametrize("url, words", [("nonsense", "not a valid Postgres URL"),
                                        ("postgresql://u:hunter2@[::1", "not a valid Postgres URL"),
                                        ("postgresql://u:hunter2@h:port/db", "port 'port'")])
def test_a_malformed_database_url_is_named_without_its_password(url, words):
    from broker.errors import ConfigError
    from broker.settings import Settings

    with pytest.raises(ConfigError, match=words) as refused:
        Settings.from_env({"DATABASE_URL": url})
    assert str(refused.value).startswith("DATABASE_URL") and "hunter2" not in str(refused.value)


def test_passwords_are_masked_in_what_is_logged():
    from broker.settings import masked_url

    assert masked_url("postgresql://bob:s3cret@db:5432/app") == "postgresql://bob:***@db:5432/app"
    assert masked_url("host=db password='a b' user=bob") == "host=db password=*** user=bob"
    assert masked_url("postgresql://db/app") == "postgresql://db/app"


def test_a_worker_process_counts_the_brokers_own_connections_beside_its_pool_share():
    settings = Settings.from_env({"STANDMEET_BROKER_ACK_CONNECTIONS": "3"})
    connections = process_connections(settings, APPLICATION_QUEUES)
    backend = BACKEND_POOL_CONNECTIONS + BACKEND_LISTEN_CONNECTIONS
    assert dict(connections.terms) == {
        "jobs": 18, "periodic ticks": 0, "relay": 1, "consumers": 5, "settler": 1, "heartbeat": 1,
        "broker sends": 3, "results": backend, "rate limits": backend, "receipt listeners": len(app.awaited_queues()),
    }
    assert connections.total == 18 + 1 + 5 + 1 + 1 + 3 + 2 * backend + len(app.awaited_queues())
    assert connections.describe().startswith(f"a worker process holds at most {connections.total} connections: "
                                              "jobs 18 + relay 1 + consumers 5 + settler 1 + heartbeat 1 + broker sends 3")


def test_fewer_threads_than_the_queues_limits_run_fewer_jobs_at_once():
    settings = Settings.from_env({})
    assert dict(process_connections(settings, APPLICATION_QUEUES, threads=4).terms)["jobs"] == 4
    assert dict(process_connections(settings, APPLICATION_QUEUES, threads=400).terms)["jobs"] == 18
    # the pool's half is checked on the queues' limits whatever the threads (as the worker's boot does)
    assert compute_budget(settings, APPLICATION_QUEUES, threads=4).total == 19


def test_the_scheduler_holds_its_ticks_its_relay_and_the_send_pool():
    connections = scheduler_connections(Settings.from_env({}))
    ticks = min(len(app.periodic_jobs()), SCHEDULER_TICK_THREADS)
    assert [(name, n) for name, n in connections.terms if n] == [("periodic ticks", ticks), ("relay", 1),
                                                                 ("broker sends", 4)]
    assert connections.describe().startswith("the scheduler holds at most")


def _room(**overrides: object) -> ServerRoom:
    values: dict[str, object] = {"server": "db:5432", "max_connections": 100, "superuser_reserved": 3, "reserved": 0,
                                 "reserve": 10, "others": (("psql", 2), ("standmeet-app", 6))}
    return ServerRoom(**{**values, **overrides})  # type: ignore[arg-type]


def _fleet(processes: int, per_worker: int = 30, scheduler: int = 11) -> Fleet:
    return Fleet(processes=processes, worker=Connections("a worker process", (("jobs", per_worker),)),
                 scheduler=Connections("the scheduler", (("relay", scheduler),)))


def test_the_server_gives_max_connections_less_what_is_reserved_and_what_others_hold():
    room = _room()
    assert room.free == 100 - 3 - 10 - 8
    assert room.describe() == ("max_connections 100 − superuser_reserved_connections 3 − "
                               "STANDMEET_SERVER_CONNECTIONS_RESERVE 10 − 8 held now by other clients "
                               "(psql 2, standmeet-app 6) = 79")
    assert "reserved_connections 5 −" in _room(reserved=5).describe()


def test_a_fleet_that_fits_passes_and_one_more_process_is_refused_naming_every_number():
    room = _room()  # 79 free: two workers of 30 and the scheduler's 11 fit (71), three do not (101)
    check_server_room(_fleet(2), room)
    with pytest.raises(BudgetError) as refused:
        check_server_room(_fleet(3), room)
    text = str(refused.value)
    assert "\n" not in text
    for words in ("3 worker processes × 30 + the scheduler 11 = 101 connections", "db:5432 has 79 to give",
                  "max_connections 100", "superuser_reserved_connections 3", "STANDMEET_SERVER_CONNECTIONS_RESERVE 10",
                  "8 held now by other clients (psql 2, standmeet-app 6)", "Lower --processes (2 fit)"):
        assert words in text, text


def test_when_not_one_worker_fits_the_refusal_says_what_else_to_lower():
    with pytest.raises(BudgetError, match="Not one worker process fits: lower --threads"):
        check_server_room(_fleet(1), _room(reserve=90))


def test_many_other_clients_are_named_by_the_largest_and_the_rest_counted():
    others = tuple((f"app-{i}", 10 - i) for i in range(7))
    assert "(app-0 10, app-1 9, app-2 8, app-3 7, 15 more)" in _room(others=others).describe()


def test_the_suite_runs_on_an_embedded_server_of_its_own_never_the_one_a_developer_runs():
    # Given no DATABASE_URL, the suite's embedded folder (set by tests/conftest.py) is not
    # the folder `standmeet-jobs run` uses by default, wherever the user data folder is
    from tests.support import db as testdb

    default = Settings.from_env({}).embedded_dir
    assert testdb.suite_embedded_dir() != default
    assert testdb.suite_embedded_dir().parent == default.parent
    assert testdb.suite_embedded_dir("/srv/tests-pg") == Path("/srv/tests-pg")
    if not os.environ.get("DATABASE_URL"):  # what the suite's own processes are given
        assert Settings.from_env().embedded_dir != default
