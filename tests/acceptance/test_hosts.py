"""Many hosts, one Postgres: three "hosts" in network namespaces run `standmeet-jobs run`.

The database host is a bridge in the root namespace with a Postgres of the test's own,
listening on the bridge's address only; each host is a namespace with its own hostname on
that bridge (``tests/support/netns.py``), running ``standmeet-jobs run
tests.support.hostjobs`` (``tests/support/hostjobs.py``). Runs are observed where a
partitioned host can still write: a file per process, stamped with the one monotonic
clock all the hosts share (they share a kernel), read by the test afterwards.

* a 5,000-job drain: the limits hold per process, ``status --json`` lists each host's worker;
* a partition longer than the rescue window, of a host running jobs longer than it: its
  claims are rescued by the others, nothing is lost, no job runs on two hosts at the same
  time, the duplicates are bounded by what it held, it steps down (one line) and, healed,
  logs each claim it lost; no stale settle; the keyed lease is never held by two hosts;
* SIGKILL of every process of a host: its jobs are rescued within the rescue window and a
  heartbeat;
* clocks 90 s ahead and behind: no false rescue, no early lease expiry, each periodic job
  once per period (by the database's clock).

Root and ``ip netns`` are needed (CI runs the suite as root); elsewhere the module skips,
saying why. Timings: a heartbeat of 1 s and a rescue window of 6 s (twice the suite's
others: three hosts of three processes share the machine's cores).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest

from tests.support import db as testdb
from tests.support import netns
from tests.support.db import query, scalar, wait_for

HEARTBEAT_S = 1.0
RESCUE_AFTER_S = 6.0
#: A worker that cannot confirm its heartbeat this long steps down (Settings.step_down_after_s).
STEP_DOWN_S = RESCUE_AFTER_S / 2
#: The partition: well past the rescue window, so that the others rescue and re-run.
PARTITION_S = 2.5 * RESCUE_AFTER_S
#: A long job's first run (longer than the rescue window and the partition: cut off, it would
#: still be running when the others re-run it) and any later run (quick: the test ends sooner).
LONG_FIRST_S = 30.0
LONG_AGAIN_S = 2.0
#: The keyed jobs: their limit and lease (hostjobs reads them), and each run's length.
KEYED_LIMIT_S, LEASE_S, KEYED_RUN_S = 5.0, 8.0, 2.0
TICK_S = 4.0
#: Periods observed with three schedulers, then with the two skewed ones alone.
PHASE_PERIODS = 5
SKEW_S = 90.0
#: The drain (HOSTS_DRAIN_JOBS makes it smaller while developing).
DRAIN_JOBS = int(os.environ.get("HOSTS_DRAIN_JOBS") or 5000)
LIMITS = {"hosts": 4, "hostlong": 3, "hostkeyed": 2, "hosttick": 1}
MODULE = "tests.support.hostjobs"
STANDMEET = str(Path(sys.executable).with_name("standmeet-jobs"))
SHUTDOWN_MS = 2000
#: The keyed lease's table (tests/support/hostjobs.py takes and gives back its rows).
LEASE_TABLE = """
CREATE TABLE IF NOT EXISTS host_leases (key text PRIMARY KEY, token uuid, busy_until timestamptz)
"""


@dataclass
class Fleet:
    net: netns.Network
    server: netns.Server
    url: str

    def env(self, runs: Path) -> dict[str, str]:
        """The hosts' environment: this test's database and timings, nothing of the suite's."""
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("STANDMEET_", "PG", "HOSTJOBS_", "PROMETHEUS_")) and k != "DATABASE_URL"}
        return {
            **base,
            "DATABASE_URL": self.url,
            "PYTHONPATH": str(netns.ROOT),
            "PYTHONUNBUFFERED": "1",
            "STANDMEET_HEARTBEAT_S": str(HEARTBEAT_S),
            "STANDMEET_RESCUE_AFTER_S": str(RESCUE_AFTER_S),
            "STANDMEET_MIN_BACKOFF_MS": "10",
            "STANDMEET_MAX_BACKOFF_MS": "200",
            "HOSTJOBS_DIR": str(runs),
            "HOSTJOBS_KEYED_LIMIT_S": str(KEYED_LIMIT_S),
            "HOSTJOBS_LEASE_S": str(LEASE_S),
            "HOSTJOBS_TICK_S": str(TICK_S),
        }


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    reason = netns.missing_reason()
    if reason:
        pytest.skip(f"many hosts need network namespaces: {reason}")
    with netns.network(3) as net, netns.postgres(net.gateway) as server:
        url = testdb.create_template(server.admin_url, "smt_hosts")
        testdb.query(url, LEASE_TABLE)
        yield Fleet(net, server, url)


class Hosts:
    """The hosts' `run` processes of one test, stopped (and healed) at its end."""

    def __init__(self, fleet: Fleet, folder: Path) -> None:
        self.fleet = fleet
        self.folder = folder
        self.runs = folder / "runs"
        self.runs.mkdir()
        self.procs: dict[str, netns.HostProcess] = {}
        self.since = scalar(fleet.url, "SELECT clock_timestamp()")

    def start(self, *names: str, scheduler: bool = False, offsets: dict[str, float] | None = None) -> None:
        for name in names:
            cmd = [STANDMEET, "run", MODULE, "--worker-shutdown-timeout", str(SHUTDOWN_MS),
                   *([] if scheduler else ["--no-scheduler"])]
            self.procs[name] = netns.HostProcess(
                self.fleet.net, self.fleet.net.host(name), cmd, env=self.fleet.env(self.runs),
                log=self.folder / f"{name}.log", clock_offset_s=(offsets or {}).get(name))
        self.wait(lambda: set(names) <= set(self.workers()), timeout_s=90,
                  what=f"a live worker on each of {', '.join(names)}")

    def wait(self, condition: Any, *, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
        """``wait_for``, with the end of each host's log in the failure."""
        try:
            return wait_for(condition, timeout_s=timeout_s, interval_s=interval_s, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.tails()}") from None

    def workers(self) -> dict[str, tuple[str, int]]:
        """{host: (worker id, pid)} of the live workers started by this test."""
        rows = query(self.fleet.url,
                     "SELECT hostname, id::text, pid FROM standmeet.worker_processes"
                     " WHERE stopped_at IS NULL AND started_at >= %s AND 'hosts' = ANY(queues)"
                     " AND heartbeat_at > now() - make_interval(secs => %s) ORDER BY started_at",
                     (self.since, RESCUE_AFTER_S))
        return {host: (wid, pid) for host, wid, pid in rows}

    def log(self, name: str) -> str:
        return self.procs[name].text()

    def tails(self) -> str:
        return "\n".join(f"--- {n}:\n{p.text()[-1500:]}" for n, p in self.procs.items())

    def stop(self) -> None:
        for host in self.fleet.net.hosts:
            if host.partitioned:
                self.fleet.net.heal(host)
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.stop(timeout_s=SHUTDOWN_MS / 1000 + 15)
        for host in self.fleet.net.hosts:
            left = self.fleet.net.kill_all(host)
            assert not left, f"processes left in {host.name} after its `run` stopped: {left}"


@pytest.fixture
def hosts(fleet: Fleet, tmp_path: Path) -> Iterator[Hosts]:
    running = Hosts(fleet, tmp_path)
    try:
        yield running
    finally:
        running.stop()


# -- what the runs recorded ------------------------------------------------------------------


@dataclass
class Run:
    run: str
    message: str
    claim: int | None
    queue: str
    key: str | None
    host: str
    pid: int
    worker: str
    t0: float              # monotonic, shared by all the hosts
    t1: float | None       # None: never ended (its process was killed or stopped under it)
    wall0: float
    wall1: float | None
    outcome: str | None


def read_runs(folder: Path) -> list[Run]:
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            (starts if record["ev"] == "start" else ends)[record["run"]] = record
    runs = []
    for run_id, s in starts.items():
        e = ends.get(run_id)
        runs.append(Run(run_id, s["m"], s["claim"], s["q"], s["key"], s["host"], s["pid"], s["worker"],
                        s["mono"], e["mono"] if e else None, s["wall"], e["wall"] if e else None,
                        e["outcome"] if e else None))
    return runs


def max_concurrency(runs: list[Run], until: float) -> int:
    """The most runs in progress at once (an unfinished run lasts until ``until``)."""
    events = sorted([(r.t0, 1) for r in runs] + [(r.t1 if r.t1 is not None else until, -1) for r in runs],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def overlapping_pairs(runs: list[Run], until: float) -> list[tuple[Run, Run, float]]:
    """Pairs of ``runs`` that were in progress at the same time, with how long they overlapped."""
    pairs = []
    ordered = sorted(runs, key=lambda r: r.t0)
    for i, a in enumerate(ordered):
        a1 = a.t1 if a.t1 is not None else until
        for b in ordered[i + 1:]:
            if b.t0 >= a1:
                break
            b1 = b.t1 if b.t1 is not None else until
            pairs.append((a, b, min(a1, b1) - b.t0))
    return pairs


def by(runs: list[Run], attribute: str) -> dict[Any, list[Run]]:
    groups: dict[Any, list[Run]] = defaultdict(list)
    for r in runs:
        groups[getattr(r, attribute)].append(r)
    return groups


def describe(run: Run, origin: float) -> str:
    end = f"{run.t1 - origin:+.1f}" if run.t1 is not None else "never"
    return f"{run.host} claim {run.claim} [{run.t0 - origin:+.1f} s, {end}] {run.outcome or 'unfinished'}"


def enqueue(url: str, messages: list[dramatiq.Message[Any]]) -> list[str]:
    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(0, len(messages), 1000):
            conn.execute(sql_enqueue.ENQUEUE.encode(), enqueue_params(messages[i:i + 1000]))
    return [m.message_id for m in messages]


def message(queue: str, actor: str, *args: Any, **kwargs: Any) -> dramatiq.Message[Any]:
    return dramatiq.Message(queue_name=queue, actor_name=actor, args=args, kwargs=kwargs, options={})


def states(url: str, ids: list[str]) -> dict[str, tuple[str, int, int, str | None, float]]:
    """{id: (state, claims, crashes, suspect_of, mtime as epoch)}"""
    rows = query(url, "SELECT message_id::text, state::text, claims, crashes, suspect_of::text,"
                      " extract(epoch FROM mtime)::float8 FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                 (ids,))
    return {r[0]: (r[1], r[2], r[3], r[4], r[5]) for r in rows}


def all_done(url: str, ids: list[str]) -> bool:
    return scalar(url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state = 'done'",
                  (ids,)) == len(ids)


def held_by(url: str, worker_id: str) -> list[tuple[str, str, bool, int]]:
    """(message id, queue, started, claim) of what a worker process holds."""
    return [(r[0], r[1], bool(r[2]), int(r[3])) for r in query(
        url, "SELECT message_id::text, queue_name, started_at IS NOT NULL, claims FROM dramatiq.queue"
             " WHERE worker_id = %s AND state = 'consumed'", (worker_id,))]


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line.lower()]


# -- a. the drain ----------------------------------------------------------------------------------


def test_three_hosts_drain_the_jobs_within_each_process_limit(fleet: Fleet, hosts: Hosts) -> None:
    # Given `standmeet-jobs run` on three hosts, each with its own hostname
    hosts.start("host1", "host2", "host3")
    status = json.loads(subprocess.run([STANDMEET, "status", "--json"], env=fleet.env(hosts.runs),
                                       capture_output=True, text=True, timeout=60, check=True).stdout)
    live = {(w["host"], w["pid"]) for w in status["workers"] if w["alive"]}
    workers = hosts.workers()
    # Then `status --json` lists each host's worker (three processes, three hosts)
    assert {(host, pid) for host, (_, pid) in workers.items()} <= live, (workers, status["workers"])
    assert len({pid for _, pid in workers.values()}) == 3
    print(f"\nhosts: status lists {sorted(live)}")

    # When they drain the jobs
    started = time.monotonic()
    ids = enqueue(fleet.url, [message("hosts", "hosts.short", 5.0) for _ in range(DRAIN_JOBS)])
    hosts.wait(lambda: all_done(fleet.url, ids), timeout_s=60 + DRAIN_JOBS / 20, interval_s=0.5,
             what=f"{DRAIN_JOBS} jobs done")
    took = time.monotonic() - started

    # Then every job ran, each on one host, and no process ran more than the queue's limit at once
    runs = [r for r in read_runs(hosts.runs) if r.message in set(ids)]
    per_message = Counter(r.message for r in runs)
    assert len(per_message) == DRAIN_JOBS
    assert all(r.outcome == "ok" for r in runs)
    per_process = by(runs, "pid")
    most = {(rs[0].host, pid): max_concurrency(rs, time.monotonic()) for pid, rs in per_process.items()}
    print(f"hosts: {DRAIN_JOBS} jobs in {took:.1f} s, per host {dict(Counter(r.host for r in runs))}; "
          f"most at once per process {most} (limit {LIMITS['hosts']}); "
          f"{sum(per_message.values()) - len(per_message)} duplicate run(s)")
    assert len({r.host for r in runs}) == 3
    assert all(n <= LIMITS["hosts"] for n in most.values()), most
    assert sum(per_message.values()) == DRAIN_JOBS


# -- b, c. a partition -------------------------------------------------------------------------


def test_a_partitioned_host_steps_down_and_nothing_runs_on_two_hosts_at_once(fleet: Fleet, hosts: Hosts) -> None:
    url = fleet.url
    # Given host2 running three long jobs (a first run outlasts the partition; a re-run is
    # quick) and keyed jobs (two keys, one lease each), with host1 and host3 idle beside it
    hosts.start("host2")
    long_ids = enqueue(url, [message("hostlong", "hosts.long", LONG_FIRST_S, LONG_AGAIN_S) for _ in range(4)])
    keyed_ids = enqueue(url, [message("hostkeyed", "hosts.keyed", f"key-{i % 2}", KEYED_RUN_S) for i in range(12)])
    victim_id = hosts.workers()["host2"][0]
    hosts.wait(lambda: sum(1 for _, q, s, _ in held_by(url, victim_id) if q == "hostlong" and s) == 3,
             timeout_s=30, what="host2 running three long jobs")
    hosts.start("host1", "host3")
    ids = long_ids + keyed_ids
    held = held_by(url, victim_id)
    # When host2 is cut off (its link down) for longer than the rescue window
    fleet.net.partition(fleet.net.host("host2"))
    cut = time.monotonic()
    print(f"\nhosts: host2 cut off holding {len(held)} claim(s): "
          f"{sorted((q, 'started' if s else 'prefetched') for _, q, s, _ in held)}")
    # (its claims are rescued by the others meanwhile)
    rescued = hosts.wait(lambda: not held_by(url, victim_id) and time.monotonic(), timeout_s=PARTITION_S,
                       interval_s=0.1, what="host2's claims rescued during the partition")
    print(f"hosts: host2's claims all taken back {rescued - cut:.1f} s into the partition")
    time.sleep(max(0.0, cut + PARTITION_S - time.monotonic()))  # the partition itself
    # and then healed
    fleet.net.heal(fleet.net.host("host2"))
    healed = time.monotonic()
    hosts.wait(lambda: all_done(url, ids), timeout_s=90, interval_s=0.2, what="every job done")
    started_held = [m for m, _, s, _ in held if s]
    try:  # host2 says which claims it lost, once it can prove it lives again
        hosts.wait(lambda: len(lines_with(hosts.log("host2"), "lost claim")) >= len(started_held),
                 timeout_s=4 * RESCUE_AFTER_S, interval_s=0.2, what="host2's lost-claim lines")
    except AssertionError:
        pass  # asserted below, with everything else measured
    end = time.monotonic()
    log2 = hosts.log("host2")
    hosts.stop()

    runs = [r for r in read_runs(hosts.runs) if r.message in set(ids)]
    final = states(url, ids)
    per_message = by(runs, "message")
    lost = [m for m in ids if final[m][0] != "done" or not any(r.outcome == "ok" for r in per_message.get(m, []))]
    duplicates = sum(len(rs) - 1 for rs in per_message.values() if len(rs) > 1)
    # the same job on two hosts at once
    twice = [(a, b, t) for rs in per_message.values() for a, b, t in overlapping_pairs(rs, end) if a.host != b.host]
    # the keyed lease held by two runs at once (whatever their hosts)
    keyed = [r for r in runs if r.queue == "hostkeyed"]
    lease_overlaps = [(a, b, t) for rs in by(keyed, "key").values() for a, b, t in overlapping_pairs(rs, end)]
    # a stale settle: the message's final claim is not the run that returned last, or the
    # message was settled before that run ended (an older claim's settle was written)
    stale = []
    for m, (state, claims, _, _, mtime) in final.items():
        winner = [r for r in per_message.get(m, []) if r.claim == claims and r.outcome == "ok"]
        if state == "done" and (not winner or mtime < winner[0].wall1 - 0.01):  # type: ignore[operator]
            stale.append((m, claims, [describe(r, cut) for r in per_message.get(m, [])]))
    victims_runs = [r for r in runs if r.host == "host2"]
    # every claim host2 held was taken back and its job run to the end under a later claim:
    # elsewhere, or on host2 itself once it was back (a keyed job snoozed behind its lease)
    rerun_later = [m for m, _, _, claim in held if any(r.claim > claim and r.outcome == "ok"
                                                       for r in per_message.get(m, []))]
    # how long before the others re-ran a job host2 had been running, its run there had ended
    margins = [b.t0 - (a.t1 if a.t1 is not None else end) for rs in per_message.values()
               for a in rs if a.host == "host2" for b in rs if b.host != "host2" and b.t0 >= a.t0]
    stepping_down = lines_with(log2, "stepping down")
    lost_claims = lines_with(log2, "lost claim")
    suspects = [(m[:8], final[m][2], final[m][3] is not None) for m, _, _, _ in held]
    print(f"hosts: partition {PARTITION_S:.0f} s, healed at +{healed - cut:.1f} s; {len(runs)} runs of {len(ids)} jobs, "
          f"{duplicates} duplicate(s) (host2 held {len(held)}, {len(started_held)} started), {len(lost)} lost")
    print(f"hosts: runs on host2: {[describe(r, cut) for r in victims_runs]}")
    print(f"hosts: same job on two hosts at once: {len(twice)} "
          + "; ".join(f"{a.message[:8]}: {describe(a, cut)} / {describe(b, cut)} ({t:.1f} s together)"
                      for a, b, t in twice))
    print(f"hosts: keyed lease held twice at once: {len(lease_overlaps)} "
          + "; ".join(f"{a.key}: {describe(a, cut)} / {describe(b, cut)}" for a, b, _ in lease_overlaps))
    print(f"hosts: host2's held claims (crashes, suspect): {suspects}; a run on host2 ended "
          f"{min(margins, default=float('nan')):.1f} s before the same job started elsewhere, at the least "
          f"(step-down after {STEP_DOWN_S:g} s, rescue after {RESCUE_AFTER_S:g} s)")
    print(f"hosts: host2 logged {len(stepping_down)} 'stepping down' and {len(lost_claims)} 'lost claim' line(s)"
          + "".join(f"\n    {line}" for line in stepping_down + lost_claims))
    print(f"hosts: stale settles: {stale}")
    print(f"hosts: the partition test took {end - cut:.1f} s after the cut")

    # Then nothing is lost, and host2's claims were run by the others
    assert not lost, lost
    assert sorted(rerun_later) == sorted(m for m, _, _, _ in held), (held, rerun_later)
    # the keyed lease was never held by two hosts at once
    assert not lease_overlaps
    # no job ran on two hosts at the same time, and the duplicates are bounded by what host2 held
    assert not twice, f"{len(twice)} job(s) ran on two hosts at once"
    assert duplicates <= len(held)
    # host2 stepped down once, and named each claim it lost when healed
    assert len(stepping_down) == 1, stepping_down
    assert len(lost_claims) >= len(started_held), lost_claims
    # and no stale settle was written
    assert not stale


# -- d. SIGKILL of a host ------------------------------------------------------------------------


def test_a_killed_hosts_jobs_are_rescued_within_the_window(fleet: Fleet, hosts: Hosts) -> None:
    url = fleet.url
    # Given host3 running three long jobs, host1 and host2 idle beside it
    hosts.start("host3")
    ids = enqueue(url, [message("hostlong", "hosts.long", LONG_FIRST_S, LONG_AGAIN_S) for _ in range(3)])
    victim_id = hosts.workers()["host3"][0]
    hosts.wait(lambda: sum(1 for _, _, s, _ in held_by(url, victim_id) if s) == 3, timeout_s=30,
             what="host3 running three long jobs")
    hosts.start("host1", "host2")
    held = held_by(url, victim_id)
    # When every process of host3 is SIGKILLed (its process group)
    hosts.procs["host3"].kill()
    killed = time.monotonic()
    left = fleet.net.pids(fleet.net.host("host3"))
    # Then its jobs are taken back within a rescue window and a heartbeat of the kill
    rescued = hosts.wait(lambda: not held_by(url, victim_id) and time.monotonic(), timeout_s=4 * RESCUE_AFTER_S,
                       interval_s=0.05, what="host3's jobs rescued")
    hosts.wait(lambda: all_done(url, ids), timeout_s=60, interval_s=0.2, what="every job done")
    runs = [r for r in read_runs(hosts.runs) if r.message in set(ids)]
    restarts = sorted(r.t0 - killed for r in runs if r.host != "host3")
    last_beat = scalar(url, "SELECT extract(epoch FROM heartbeat_at)::float8 FROM standmeet.worker_processes"
                            " WHERE id = %s", (victim_id,))
    first_rerun_wall = min(r.wall0 for r in runs if r.host != "host3")
    final = states(url, ids)
    print(f"\nhosts: host3 killed holding {len(held)}; taken back {rescued - killed:.2f} s later "
          f"(window {RESCUE_AFTER_S + HEARTBEAT_S:.0f} s), re-run at {[f'+{t:.2f}' for t in restarts]} s; "
          f"first re-run {first_rerun_wall - last_beat:.2f} s after its last heartbeat; "
          f"crashes/suspect {[(v[2], v[3] is not None) for v in final.values()]}")
    assert not left, f"host3 still had processes after SIGKILL of its group: {left}"
    assert all(v[0] == "done" for v in final.values())
    assert rescued - killed <= RESCUE_AFTER_S + HEARTBEAT_S + 0.5
    assert first_rerun_wall - last_beat >= RESCUE_AFTER_S - 0.05
    assert sum(1 for r in runs if r.host != "host3") >= len(held)


# -- e. clocks ahead and behind ----------------------------------------------------------------------


def test_skewed_clocks_cause_no_false_rescue_no_early_expiry_and_one_run_per_period(
    fleet: Fleet, hosts: Hosts
) -> None:
    url = fleet.url
    reason = netns.faketime_missing_reason()
    if reason:
        pytest.skip(f"a host's clock cannot be shifted: {reason}")
    offsets = {"host1": SKEW_S, "host3": -SKEW_S}
    # Given host1's clock 90 s ahead and host3's 90 s behind (Python and psycopg work there,
    # the database's clock is not moved)
    for name, offset in offsets.items():
        seen = netns.check_clock(fleet.net, fleet.net.host(name), url, offset, env=fleet.env(hosts.runs))
        print(f"\nhosts: {name} at {offset:+.0f} s sees {seen}")
        assert abs(seen["wall_skew"] - offset) < 10 and 0 <= seen["mono_skew"] < 10
        assert -1 < seen["db_skew"] < 10 and 0.19 < seen["wait"] < 1 and 0.19 < seen["sleep"] < 1
    # and the three hosts running their schedulers too
    hosts.start("host1", "host2", "host3", scheduler=True, offsets=offsets)
    hosts.wait(lambda: all("scheduler running" in hosts.log(n) for n in hosts.procs), timeout_s=60,
             what="the three schedulers running")
    window_start = scalar(url, "SELECT extract(epoch FROM clock_timestamp())::float8")
    # When they run long jobs (longer than the rescue window), keyed jobs and short ones
    ids = enqueue(url, [message("hostlong", "hosts.long", 1.5 * RESCUE_AFTER_S, 1.5 * RESCUE_AFTER_S)
                        for _ in range(6)])
    keyed_ids = enqueue(url, [message("hostkeyed", "hosts.keyed", f"skew-{i % 3}", KEYED_RUN_S)
                              for i in range(12)])
    short_ids = enqueue(url, [message("hosts", "hosts.short", 5.0) for _ in range(300)])
    all_ids = ids + keyed_ids + short_ids
    hosts.wait(lambda: all_done(url, all_ids), timeout_s=120, interval_s=0.5, what="every job done")
    # (and the schedulers tick for five periods; then host2, the one whose clock is right and
    # so always ticks first, stops, and host1 and host3 tick alone for five more)
    now = lambda: scalar(url, "SELECT extract(epoch FROM clock_timestamp())::float8")  # noqa: E731
    time.sleep(max(0.0, window_start + PHASE_PERIODS * TICK_S + 0.5 - now()))
    hosts.procs["host2"].stop(timeout_s=SHUTDOWN_MS / 1000 + 15)
    alone_from = now()
    time.sleep(max(0.0, alone_from + PHASE_PERIODS * TICK_S + 0.5 - now()))
    window_end = now()
    end = time.monotonic()
    logs = {n: hosts.log(n) for n in hosts.procs}
    hosts.stop()

    runs = [r for r in read_runs(hosts.runs) if r.message in set(all_ids)]
    final = states(url, all_ids)
    per_message = Counter(r.message for r in runs)
    twice = [m for m, n in per_message.items() if n > 1]
    blamed = [m for m, v in final.items() if v[2] or v[3]]
    rescues = {n: lines_with(text, "crash rescue") for n, text in logs.items()}
    keyed = [r for r in runs if r.queue == "hostkeyed"]
    lease_overlaps = [(a, b, t) for rs in by(keyed, "key").values() for a, b, t in overlapping_pairs(rs, end)]
    ticks = query(url, "SELECT message->>'actor_name', extract(epoch FROM enqueued_at)::float8, message_id::text"
                       " FROM dramatiq.queue WHERE message->>'actor_name' IN ('hosts.tick', 'maintenance.rescue')"
                       " AND enqueued_at >= to_timestamp(%s) - interval '60 s'", (window_start,))
    tick_periods = Counter(math.floor(t / TICK_S) for actor, t, _ in ticks
                           if actor == "hosts.tick" and window_start <= t < window_end)
    full = range(math.ceil(window_start / TICK_S), math.floor(window_end / TICK_S))
    per_period = [tick_periods.get(p, 0) for p in full]
    split = sum(1 for p in full if p * TICK_S < alone_from)
    rescue_periods = Counter(math.floor(t / 30) for actor, t, _ in ticks if actor == "maintenance.rescue")
    tick_runs = Counter(r[0] for r in query(url, "SELECT message_id::text FROM test_runs WHERE actor = 'hosts.tick'"))
    enqueued_by = {n: len([line for line in text.splitlines() if "periodic hosts-tick: enqueued" in line])
                   for n, text in logs.items()}
    print(f"hosts: {len(all_ids)} jobs on skewed hosts, per host and queue "
          f"{sorted(Counter((r.host, r.queue) for r in runs).items())}; run twice: {len(twice)}; "
          f"blamed: {len(blamed)}; crash-rescue lines {({n: len(v) for n, v in rescues.items()})}")
    print(f"hosts: keyed lease held twice at once: {len(lease_overlaps)} "
          + "; ".join(f"{a.key}: {describe(a, end)} / {describe(b, end)}" for a, b, _ in lease_overlaps))
    print(f"hosts: hosts.tick enqueued per {TICK_S:g} s period of the database's clock: three schedulers "
          f"{per_period[:split]}, then host1 (+90 s) and host3 (-90 s) alone {per_period[split:]}; "
          f"'enqueued' lines per host {enqueued_by}; runs per tick message "
          f"{sorted(Counter(tick_runs.values()).items())}; maintenance.rescue per 30 s period "
          f"{sorted(rescue_periods.values())}")

    # Then no job was taken back from a live host, nor run twice
    assert all(v[0] == "done" for v in final.values())
    assert not any(rescues.values()), rescues
    assert not blamed and not twice
    # no keyed lease expired early (two holders at once)
    assert not lease_overlaps
    # and each periodic job ran once per period of the database's clock, whichever
    # schedulers were running (the skewed ones alone included)
    assert len(per_period) >= 2 * PHASE_PERIODS - 2
    assert all(n == 1 for n in per_period), per_period
    assert enqueued_by["host1"] + enqueued_by["host3"] >= PHASE_PERIODS - 2, enqueued_by
    assert all(n <= 1 for n in rescue_periods.values()), rescue_periods
    assert all(n == 1 for n in tick_runs.values())


def test_nothing_is_left_of_the_hosts_after_each_test(fleet: Fleet) -> None:
    # (the module's fixtures remove the namespaces, the bridge and the server at its end)
    for host in fleet.net.hosts:
        assert fleet.net.pids(host) == []
    assert re.fullmatch(r"10\.231\.\d+\.1", fleet.net.gateway)
