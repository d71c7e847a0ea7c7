"""What each policy costs a run: one thread calling a run's hooks, no database in the loop.

A run here is what a worker thread does around a job's body, and nothing else: the
broker's ``before_process_message`` hooks, the actor's function bracketed as a job
(``broker.engine.runs.as_run``), then the ``after_process_message`` hooks. No claim, no
settle, no consumer: what is left is the policies' own Python, and the broker's own
bookkeeping of a run (its bracket, its settle context). It is measured four ways:

* **ours**: our broker as a worker configures it, every policy on, the job log line
  written by the batched handler to a file;
* **without <policy>**: the same, that one middleware taken out of the list;
* **with Dramatiq's policies only**: the same, every middleware taken out but those of
  Dramatiq's default list's classes (ours of the time limit and the retries are
  subclasses of them): the broker's own bookkeeping of a run beside the policies of
  Dramatiq's figure. Not the same work: our broker calls the hooks of the age limit,
  the shutdown notifications, the callbacks and the pipelines only for a run whose
  options name them (``broker.engine.hooks``), where Dramatiq calls them for every run;
* **Dramatiq's**: the same loop through ``StubBroker`` with Dramatiq's default middleware.

Each figure is the best of ``--passes`` passes of ``--n`` runs (the minimum, not a
median: this is a cost, and a shared machine only ever adds to it); a pass measures every
configuration once, in turn, so that a machine that slows or speeds up over the minutes
weighs on all of them alike. A run's message proxy is made as the consumer that hands it
out makes it (ours: ``ClaimedMessage``, its fields plain attributes; Dramatiq's: its
``MessageProxy``), and the garbage collected, before the clock starts.

Prints whether the OpenTelemetry API is importable (the tracing policy has run hooks only
then; ``--without-otel`` runs as an installation without it), microseconds a run, each
policy's cost (ours minus ours without it; a policy whose hooks a run skips costs what
judging that takes), then ``ratio: N.NN`` (ours / Dramatiq's). The figures are this
thread's CPU alone: what the job log's writer thread or the settler spend is not in them
(``bench/worker_cpu.py`` counts the whole process).

    python bench/hooks_cpu.py --n 2000 --passes 30
"""

from __future__ import annotations

import sys

if "--without-otel" in sys.argv:  # before anything imports it: as if the API were not installed
    sys.modules["opentelemetry"] = None  # type: ignore[assignment]

import argparse  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages and tests
    sys.path.insert(0, str(ROOT))

import dramatiq  # noqa: E402
from dramatiq.broker import MessageProxy  # noqa: E402

from bench.worker_cpu import dramatiqs_policy, log_like_a_worker  # noqa: E402
from tests.support import db as testdb  # noqa: E402

QUEUE = "index"
#: The name of Dramatiq's figure among the configurations.
DRAMATIQS = "Dramatiq's default middleware"
#: The name of ours with only the policies of Dramatiq's default list.
DRAMATIQS_ONLY = "with Dramatiq's policies only"


def noop(i: int) -> None:
    pass


def runs_of(broker: dramatiq.Broker, fn: Callable[..., Any], message: dramatiq.Message,
            n: int, proxy_of: Callable[[dramatiq.Message], MessageProxy] = MessageProxy) -> float:
    """Microseconds of this thread's CPU a run, over ``n`` runs of ``message`` through
    ``broker``'s run hooks around ``fn``, each run's message proxy made by ``proxy_of``
    (as the broker's consumer makes it) before the clock starts."""
    emit_before, emit_after = broker.emit_before, broker.emit_after
    proxies = [proxy_of(message.copy()) for _ in range(n)]
    gc.collect()  # a full collection (tens of ms) never lands inside a pass
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


def measured(admin_url: str, n: int, passes: int) -> tuple[dict[str, float], list[str]]:
    """Microseconds a run: through our broker with every policy, without each one and with
    Dramatiq's policies only (their names, the second value), and through Dramatiq's
    StubBroker with its default middleware."""
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import default_middleware

    from bench.throughput import _ours_broker, declare
    from broker.engine.consumer import ClaimedMessage
    from broker.engine.runs import as_run

    def claimed(message: dramatiq.Message) -> MessageProxy:
        return ClaimedMessage(message, claim=1, claimed_at=time.time())

    url, broker = _ours_broker(admin_url, 8)
    stub = StubBroker(middleware=[m() for m in default_middleware])
    try:
        actor = declare(broker, noop, "bench.noop", QUEUE)
        broker.emit_after("process_boot")  # as a worker process: the time limit's timers run
        message, fn = actor.message(1), as_run(actor.fn)
        stub_actor = dramatiq.actor(noop, broker=stub, actor_name="bench.noop", queue_name=QUEUE)
        stub.emit_after("process_boot")
        stub_message = stub_actor.message(1)
        runs_of(broker, fn, message, n, claimed)  # warm: the first pass pays for what is made once
        runs_of(stub, stub_actor.fn, stub_message, n)
        whole = list(broker.middleware)
        configurations: list[tuple[str, list[Any]]] = [("ours", [])] + [
            (f"without {type(m).__name__}", [m]) for m in whole] + [
            (DRAMATIQS_ONLY, [m for m in whole if not dramatiqs_policy(m)])]
        figures: dict[str, float] = {}
        for _ in range(passes):
            for name, left_out in configurations:
                broker.middleware[:] = [m for m in whole if m not in left_out]
                try:
                    spent = runs_of(broker, fn, message, n, claimed)
                finally:
                    broker.middleware[:] = whole
                figures[name] = min(spent, figures.get(name, spent))
            spent = runs_of(stub, stub_actor.fn, stub_message, n)
            figures[DRAMATIQS] = min(spent, figures.get(DRAMATIQS, spent))
        return figures, [type(m).__name__ for m in whole if dramatiqs_policy(m)]
    finally:
        stub.emit_before("process_stop")
        stub.close()
        broker.emit_before("process_stop")
        broker.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2_000, help="runs per pass")
    parser.add_argument("--passes", type=int, default=30, help="passes of each; the fastest is kept")
    parser.add_argument("--without-otel", action="store_true",
                        help="run as an installation without the OpenTelemetry API (the [otel] extra)")
    args = parser.parse_args(argv)
    from broker.observability import tracing

    admin_url = testdb.server_url()
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "jobs.log"), "a", encoding="utf-8") as log:
        log_like_a_worker(log)
        figures, kept = measured(admin_url, args.n, args.passes)
        logging.getLogger().handlers[0].flush()
    whole, floor, same = figures.pop("ours"), figures.pop(DRAMATIQS), figures.pop(DRAMATIQS_ONLY)
    print(f"dramatiq {dramatiq.__version__}, one thread, {args.n:,} runs a pass, best of {args.passes} passes; "
          f"OpenTelemetry API: {'importable' if tracing.enabled() else 'absent'}")
    print(f"ours, every policy: {whole:.1f} µs a run")
    for name, without in sorted(figures.items(), key=lambda item: item[1]):
        print(f"  {name}: {without:.1f} µs a run, so it costs {whole - without:+.1f}")
    print(f"ours {DRAMATIQS_ONLY} ({', '.join(kept)}; the rest taken out): {same:.1f} µs a run")
    print(f"{DRAMATIQS}: {floor:.1f} µs a run")
    print(f"ratio: {whole / floor:.2f} (ours / Dramatiq's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
