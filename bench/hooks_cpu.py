"""What each policy costs a run: one thread calling a run's hooks, no database in the loop.

A run here is what a worker thread does around a job's body, and nothing else: the
broker's ``before_process_message`` hooks, the actor's function bracketed as a job
(``broker.engine.runs.as_run``), then the ``after_process_message`` hooks. No claim, no
settle, no consumer: what is left is the policies' own Python. It is measured four ways,
each the best of ``--passes`` passes of ``--n`` runs (the minimum: this is a cost, and a
shared machine only ever adds to it); a pass measures every configuration once, in turn. A run's message proxy is made as the consumer that
hands it out makes it (ours: ``ClaimedMessage``, its fields plain attributes; Dramatiq's:
its ``MessageProxy``), before the clock starts:

* **ours**: our broker as a worker configures it, every policy on, the job log line
  written by the batched handler to a file;
* **without <policy>**: the same, that one middleware taken out of the list;
* **Dramatiq's**: the same loop through ``StubBroker`` with Dramatiq's default middleware.

Prints microseconds a run, each policy's cost (ours minus ours without it; a policy whose
hooks a run skips costs what judging that takes), then ``ratio: N.NN`` (ours / Dramatiq's).
The figures are this thread's CPU alone: what the job log's writer thread or the
settler spend is not in them (``bench/worker_cpu.py`` counts the whole process).

    python bench/hooks_cpu.py --n 20000 --passes 9
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages and tests
    sys.path.insert(0, str(ROOT))

import dramatiq  # noqa: E402
from dramatiq.broker import MessageProxy  # noqa: E402

from bench.worker_cpu import log_like_a_worker  # noqa: E402
from tests.support import db as testdb  # noqa: E402

QUEUE = "index"


def noop(i: int) -> None:
    pass


def runs_of(broker: dramatiq.Broker, fn: Callable[..., Any], message: dramatiq.Message,
            n: int, proxy_of: Callable[[dramatiq.Message], MessageProxy] = MessageProxy) -> float:
    """Microseconds of this thread's CPU a run, over ``n`` runs of ``message`` through
    ``broker``'s run hooks around ``fn``, each run's message proxy made by ``proxy_of``
    (as the broker's consumer makes it) before the clock starts."""
    emit_before, emit_after = broker.emit_before, broker.emit_after
    proxies = [proxy_of(message.copy()) for _ in range(n)]
    c0 = time.thread_time()
    for proxy in proxies:
        emit_before("process_message", proxy)
        result = fn(*proxy.args)
        emit_after("process_message", proxy, result=result)
    spent = time.thread_time() - c0
    # what the settler's thread does with each batch, untimed: the metrics the runs noted
    # written (else they pile up, and each pass would run slower than the one before)
    for listener in getattr(broker, "settle_listeners", ()):
        listener()
    return spent * 1e6 / n


def best(measure: Callable[[], float], passes: int) -> float:
    return min(measure() for _ in range(passes))


def ours(admin_url: str, n: int, passes: int) -> dict[str, float]:
    """Microseconds a run through our broker: with every policy, and without each one."""
    from bench.throughput import _ours_broker, declare
    from broker.engine.consumer import ClaimedMessage
    from broker.engine.runs import as_run

    def claimed(message: dramatiq.Message) -> MessageProxy:
        return ClaimedMessage(message, claim=1, claimed_at=time.time())

    url, broker = _ours_broker(admin_url, 8)
    try:
        actor = declare(broker, noop, "bench.noop", QUEUE)
        broker.emit_after("process_boot")  # as a worker process: the time limit's timers run
        message = actor.message(1)
        fn = as_run(actor.fn)
        runs_of(broker, fn, message, n, claimed)  # warm: the first pass pays for what is made once
        # Each pass measures every configuration once, in turn, so that a machine that
        # slows or speeds up over the minutes weighs on all of them alike.
        configurations: list[tuple[str, Any]] = [("ours", None)] + [
            (f"without {type(m).__name__}", m) for m in broker.middleware]
        figures: dict[str, float] = {}
        for _ in range(passes):
            for name, left_out in configurations:
                at = broker.middleware.index(left_out) if left_out is not None else -1
                if left_out is not None:
                    broker.middleware.remove(left_out)
                try:
                    spent = runs_of(broker, fn, message, n, claimed)
                finally:
                    if left_out is not None:
                        broker.middleware.insert(at, left_out)
                figures[name] = min(spent, figures.get(name, spent))
        return figures
    finally:
        broker.emit_before("process_stop")
        broker.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def dramatiqs(n: int, passes: int) -> float:
    """Microseconds a run through StubBroker's emit with Dramatiq's default middleware."""
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import default_middleware

    stub = StubBroker(middleware=[m() for m in default_middleware])
    try:
        actor = dramatiq.actor(noop, broker=stub, actor_name="bench.noop", queue_name=QUEUE)
        stub.emit_after("process_boot")
        message = actor.message(1)
        return best(lambda: runs_of(stub, actor.fn, message, n), passes)
    finally:
        stub.emit_before("process_stop")
        stub.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="runs per pass")
    parser.add_argument("--passes", type=int, default=9, help="passes of each; the fastest is kept")
    args = parser.parse_args(argv)
    admin_url = testdb.server_url()
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "jobs.log"), "a", encoding="utf-8") as log:
        log_like_a_worker(log)
        figures = ours(admin_url, args.n, args.passes)
        logging.getLogger().handlers[0].flush()
    floor = dramatiqs(args.n, args.passes)
    whole = figures.pop("ours")
    print(f"dramatiq {dramatiq.__version__}, one thread, {args.n:,} runs a pass, best of {args.passes} passes")
    print(f"ours, every policy: {whole:.1f} µs a run")
    for name, without in sorted(figures.items(), key=lambda item: item[1]):
        print(f"  {name}: {without:.1f} µs a run, so it costs {whole - without:+.1f}")
    print(f"Dramatiq's default middleware: {floor:.1f} µs a run")
    print(f"ratio: {whole / floor:.2f} (ours / Dramatiq's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
