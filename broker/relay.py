"""A relay process: ``python -m broker.relay`` (a process entry point).

Worker processes and the scheduler already run the relay; this runs one on its own,
for tests, benchmarks and a backlog that needs extra hands.

    python -m broker.relay [MODULE …] [--exit-when-idle] [--batch 1000]

The modules (default: ``actors``, :data:`broker.boot.DEFAULT_APP_MODULES`) declare the topics and routes it relays; events of
other topics are left pending for a process that routes them.
"""

from __future__ import annotations

import logging
import signal
import sys

from broker import detach
from broker.boot import DEFAULT_APP_MODULES, OneLineParser, boot, bounded_int
from broker.exits import CONFIG_REFUSED_EXIT
from broker.observability.stacks import dump_stacks_on_request
from broker.outbox import Relay

#: The most rows one pass may take (``--batch``).
BATCH_MOST = 100_000


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m broker.relay", description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", default=list(DEFAULT_APP_MODULES),
                        help=f"modules that declare routes (default: {', '.join(DEFAULT_APP_MODULES)})")
    parser.add_argument("--exit-when-idle", action="store_true", help="exit once the outbox is empty")
    parser.add_argument("--batch", type=bounded_int(low=1, high=BATCH_MOST), default=None,
                        help="rows per pass (default: STANDMEET_RELAY_BATCH)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dump_stacks_on_request()

    from broker.errors import StandmeetError

    try:
        broker = boot(args.modules)
    except StandmeetError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return CONFIG_REFUSED_EXIT
    import psycopg

    from broker.pg.preflight import first_line, wait_until_migrated

    stop = detach.StopEvent()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if not wait_until_migrated(broker.url, stop=stop, who="relay"):
        return 0
    relay = Relay(broker.url, batch=args.batch or broker.settings.relay_batch, poll_s=broker.settings.relay_poll_s,
                  heartbeat_s=broker.settings.heartbeat_s)
    logging.getLogger("standmeet.relay").info("relaying the topics %s", ", ".join(relay.topics) or "(none)")
    if args.exit_when_idle:
        try:
            total = relay.drain_once(stop)
        except (StandmeetError, psycopg.Error) as exc:  # one line, no traceback: the outbox keeps its events
            print(f"relay: the outbox could not be relayed: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
            return 1
        finally:
            relay.close()
        print(f"relayed {total} event(s)" + (" before it was stopped" if stop.is_set() else ""))
        return 0
    relay.run(stop)
    relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
