"""Every benchmark in ``bench/`` runs end to end at tiny sizes and prints its figures and
its ``ratio`` line (untimed: no speed is asserted, only that each still runs)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from bench import relay
from bench.pooler import PEERS
from broker.settings import Settings
from tests.support import db as testdb
from tests.support.pgbouncer import missing_reason
from tests.support.procs import ROOT

pytestmark = pytest.mark.slow

#: A benchmark at its smallest takes seconds; this is for a machine many times slower.
TIMEOUT_S = 600
#: The line every benchmark prints its comparison on, a number after the colon
#: (``ratio: 1.07 (saturated / idle p50)``, ``ratio rate(2) / rate(1): 1.52``).
RATIO = r"^ratio[^:\n]*: \d"
DATABASES_NAMED = "SELECT count(*) FROM pg_database WHERE datname = %s"


def run_bench(script: str, admin_url: str, *args: str, env: dict[str, str] | None = None) -> str:
    """What ``bench/<script>`` printed, once it exited 0 (its output in the failure if not)."""
    env = {**os.environ, "DATABASE_URL": admin_url, **(env or {})}
    done = subprocess.run([sys.executable, f"bench/{script}", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def assert_lines(out: str, *patterns: str) -> None:
    """Each pattern matches a line of ``out``, and so does the ratio line."""
    for pattern in (*patterns, RATIO):
        assert re.search(pattern, out, re.MULTILINE), f"no line matches {pattern!r} in:\n{out}"


def test_the_cost_curve_drains_a_tiny_backlog_and_prints_its_figures(admin_url: str) -> None:
    out = run_bench("cost_curve.py", admin_url, "--n", "200")
    assert "size 200: median" in out
    assert "ms/job" in out and "dead tuples" in out
    assert "ratio rate(200) / rate(200): 1.00" in out


def test_the_worker_cpu_bench_drains_ours_and_the_stub_floor_and_prints_ours_over_the_floor(admin_url: str) -> None:
    out = run_bench("worker_cpu.py", admin_url, "--n", "200", "--runs", "1")
    assert_lines(out, r"^ours: [\d,]+ .* jobs/s, [\d.]+ .* ms CPU per job \(200 job log lines written\)$",
                 r"^floor \(StubBroker, default middleware\): [\d,]+ .* ms CPU per job$")


def test_the_worker_cpu_bench_can_drain_ours_with_dramatiqs_policies_only_and_then_writes_no_job_log_line(
        admin_url: str) -> None:
    out = run_bench("worker_cpu.py", admin_url, "--n", "200", "--runs", "1", "--policies", "dramatiq",
                    "--by-thread")
    assert_lines(out, r"^ours with Dramatiq's policies only \(the rest taken out: a diagnostic, not a worker\)$",
                 r"^ours: [\d,]+ .* jobs/s, [\d.]+ .* ms CPU per job \(0 job log lines written\)$",
                 r"^ours by thread, µs of CPU a job: worker threads [\d.]+ .*, consumer [\d.]+ .*, "
                 r"settler [\d.]+ .*, log writer [\d.]+ .*, the rest [\d.]+ ")


def test_the_worker_cpu_bench_keeps_a_named_policy_beside_dramatiqs_and_then_writes_its_job_log_lines(
        admin_url: str) -> None:
    out = run_bench("worker_cpu.py", admin_url, "--n", "200", "--runs", "1", "--policies", "dramatiq",
                    "--keep", "JobLog")
    assert_lines(out, r"^ours with Dramatiq's policies only, and JobLog \(the rest taken out",
                 r"^ours: [\d,]+ .* ms CPU per job \(200 job log lines written\)$")


def test_the_worker_cpu_bench_refuses_a_policy_to_keep_that_our_broker_does_not_have_in_one_line(
        admin_url: str) -> None:
    done = subprocess.run([sys.executable, "bench/worker_cpu.py", "--n", "20", "--runs", "1", "--policies",
                           "dramatiq", "--keep", "JobLog,NoSuchPolicy"],
                          env={**os.environ, "DATABASE_URL": admin_url}, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode != 0
    assert done.stderr.strip() == "--keep: our broker has no middleware named NoSuchPolicy", done.stderr


def test_the_hooks_cpu_bench_times_a_run_with_every_policy_and_without_each_and_prints_ours_over_dramatiqs(
        admin_url: str) -> None:
    out = run_bench("hooks_cpu.py", admin_url, "--n", "50", "--passes", "1", "--without-otel")
    assert_lines(out, r"; OpenTelemetry API: absent$", r"^ours, every policy: [\d.]+ µs a run$",
                 r"^  without TimeLimit: [\d.]+ µs a run, so it costs [-+][\d.]+$",
                 r"^  without JobLog: [\d.]+ µs a run, so it costs [-+][\d.]+$",
                 r"^ours with Dramatiq's policies only \(.*TimeLimit.*Retries; the rest taken out\): [\d.]+ µs a run$",
                 r"^Dramatiq's default middleware: [\d.]+ µs a run$")


def test_the_settle_cpu_bench_times_both_ways_of_running_a_settle_and_prints_their_ratio(admin_url: str) -> None:
    out = run_bench("settle_cpu.py", admin_url, "--n", "20", "--runs", "1")
    assert_lines(out, r"^psycopg's own conversion and list dumpers: [\d.]+ .* µs of CPU per settle of 6$",
                 r"^LongStatement \(converted once, arrays as text\): [\d.]+ .* µs of CPU per settle of 6$")


def test_the_bulk_bench_times_enqueue_many_beside_postgres_copying_the_same_rows(admin_url: str) -> None:
    out = run_bench("bulk.py", admin_url, "--n", "200", "--runs", "1")
    assert_lines(out, r"^build \(Dramatiq's actor.message\): [\d.]+ ",
                 r"^floor \(Postgres copying the rows, made beforehand, and committing\): [\d.]+ ",
                 r"^ours \(enqueue_many\): [\d.]+ .*, of which this process's CPU [\d.]+ ",
                 r"^bulk rate, build \+ ours: [\d,]+ messages/s; bound, build \+ floor: [\d,]+ messages/s$")


def test_the_scale_script_drains_with_one_and_two_processes_within_their_limits(admin_url: str) -> None:
    out = run_bench("scale.py", admin_url, "--n", "200", "--processes", "1,2")
    assert "1 process(es): median" in out and "2 process(es): median" in out
    assert "EXCEEDED" not in out
    assert "ratio rate(2) / rate(1):" in out


def test_throughput_runs_every_phase_for_ours_and_vanilla_and_prints_ours_over_vanilla(admin_url: str) -> None:
    missing = [name for name in ("dramatiq_pg", "psycopg2") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"throughput.py compares with vanilla dramatiq-pg: {', '.join(missing)} not installed "
                    "(pip install --no-deps dramatiq-pg psycopg2-binary)")
    out = run_bench("throughput.py", admin_url, "--runs", "1", "--drain", "20", "--sleep-jobs", "1",
                    "--backlog", "20", "--vanilla-backlog", "20", "--latency", "1")
    assert_lines(out,
                 r"^run 1: drain 20: ours [\d,]+ msg/s, vanilla [\d,]+ msg/s",
                 r"^median drain: ours [\d,]+ msg/s, vanilla dramatiq-pg [\d,]+ msg/s$",
                 r"^median sleeping-job efficiency: ours [\d.]+%, vanilla dramatiq-pg [\d.]+%$",
                 r"^median backlog: ours \(20\) [\d,]+ msg/s with at most \d+ locks, vanilla \(20\)",
                 r"^median idle enqueue->start p50/p99: ours [\d.]+/[\d.]+ ms, vanilla [\d.]+/[\d.]+ ms$")


def test_the_relay_bench_relays_with_one_and_three_processes_and_prints_three_over_one(admin_url: str) -> None:
    events = Settings.from_env().relay_batch + 1  # the fewest it accepts: two passes
    out = run_bench("relay.py", admin_url, "--runs", "1", "--events", str(events), "--latency", "1")
    assert_lines(out,
                 rf"^run 1: {events} events: one relay [\d,]+ events/s, three relays [\d,]+ events/s",
                 r"^median: one relay [\d,]+ events/s, three relays [\d,]+ events/s$",
                 r"^median CPU per event, relay/backend: one relay [\d.]+/[\d.]+ µs",
                 r"^median idle emit->start on the index queue: p50 [\d.]+ ms, p99 [\d.]+ ms$")


def test_the_relay_bench_refuses_a_backlog_that_one_pass_takes_whole(capsys: pytest.CaptureFixture[str]) -> None:
    # one pass relays it all in one transaction: no span to time the rate by (it divided by zero)
    events = Settings.from_env().relay_batch
    with pytest.raises(SystemExit) as refused:
        relay.main(["--runs", "1", "--events", str(events)])
    assert refused.value.code == 2
    assert "--events must exceed one relay pass" in capsys.readouterr().err


def test_receipts_are_timed_idle_and_saturated_and_print_saturated_over_idle(admin_url: str) -> None:
    out = run_bench("receipts.py", admin_url, "--runs", "1", "--writes", "1")
    assert_lines(out,
                 r"^run 1 idle: 1 writes, write->indexed p50 [\d.]+ ms",
                 r"^run 1 saturated: 1 writes, write->indexed p50 [\d.]+ ms",
                 r"^median idle: p50 [\d.]+ ms, p95 [\d.]+ ms, p99 [\d.]+ ms",
                 r"^median saturated: p50 [\d.]+ ms, p95 [\d.]+ ms, p99 [\d.]+ ms",
                 r"^ratio: [\d.]+ \(saturated / idle p50\)")


def test_the_pooler_bench_drains_direct_and_through_pgbouncer_and_prints_pooled_over_direct(
        admin_url: str) -> None:
    reason = missing_reason() or (None if PEERS.exists() else f"the peers' harness is not at {PEERS}")
    if reason:
        pytest.skip(reason)
    database = testdb.unique_name("bench_pooler_smoke")
    out = run_bench("pooler.py", admin_url, "--runs", "1", "--n", "200", "--database", database,
                    env={"BENCH_PG_SERVER": admin_url})
    assert_lines(out,
                 r"^  run 1 direct: [\d,]+ jobs/s",
                 r"^  run 1 pooled: [\d,]+ jobs/s",
                 r"^median direct [\d,]+ jobs/s, through PgBouncer [\d,]+ jobs/s$")
    assert testdb.scalar(admin_url, DATABASES_NAMED, (database,)) == 0


def test_the_webhook_benchmark_delivers_twice_times_the_index_queue_and_prints_its_figures(admin_url, monkeypatch):
    monkeypatch.setenv("BENCH_VERBOSE", "1")
    out = run_bench("webhooks.py", admin_url, "--events", "1", "--runs", "2", "--writes", "1",
                    "--counters-within-s", "0")
    # both runs delivered every one of their 20 (the second from an empty queue), and the
    # CPU of the worker, the server's processes and the endpoint process is printed
    assert out.count("deliveries: 20 to 20 fast endpoints (in their own process) at") == 2, out
    assert "median deliveries/s:" in out and "database transactions per delivery" in out
    assert "Postgres backends" in out and "the endpoint process" in out
    # and the index queue's latency idle and beside a saturated webhook queue, as a ratio
    assert_lines(out, r"^ratio: [\d.]+")
