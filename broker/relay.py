"""A relay process: ``python -m broker.relay`` (a process entry point).

Worker processes and the scheduler already run the relay; this runs one on its own,
for tests, benchmarks and a backlog that needs extra hands.

    python -m broker.relay [MODULE …] [--exit-when-idle] [--batch 1000]

The modules (default: ``actors``) declare the topics and routes it relays; events of
other topics are left pending for a process that routes them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from broker.outbox import Relay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.relay", description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", default=["actors"], help="modules that declare routes (default: actors)")
    parser.add_argument("--exit-when-idle", action="store_true", help="exit once the outbox is empty")
    parser.add_argument("--batch", type=int, default=None, help="rows per pass (default: STANDMEET_RELAY_BATCH)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import importlib

    import dramatiq

    import broker as runtime
    from broker.engine.broker import StandmeetBroker

    for module in args.modules:
        importlib.import_module(module)
    if not isinstance(dramatiq.broker.global_broker, StandmeetBroker):
        runtime.configure()
    broker = runtime.current_broker()
    relay = Relay(broker.url, batch=args.batch or broker.settings.relay_batch, poll_s=broker.settings.relay_poll_s,
                  heartbeat_s=broker.settings.heartbeat_s)
    logging.getLogger("standmeet.relay").info("relaying the topics %s", ", ".join(relay.topics) or "(none)")
    if args.exit_when_idle:
        total = relay.drain_once()
        relay.close()
        print(f"relayed {total} event(s)")
        return 0
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    relay.run(stop)
    relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
