"""``standmeet-jobs``: the operator's command line (a process entry point).

    standmeet-jobs migrate [MODULE …]      create or update the schema (idempotent): the
                                           runtime's tables, then the modules' own
    standmeet-jobs check [MODULE …]        the start-up checks (the connection budget…, the
                                           database reachable and its schema current)
    standmeet-jobs run [MODULE …]          check the connections, migrate, then supervise
                                           worker processes (python -m broker.worker
                                           MODULE …) and the scheduler until Ctrl-C / SIGTERM
    standmeet-jobs dashboard               the web dashboard (loopback:8420 unless told),
                                           with the pages of the STANDMEET_APP_MODULES
    standmeet-jobs db url|stop             the database in use; stop the embedded server
    standmeet-jobs status | jobs … | queues …   what runs and what failed; retry, cancel,
                                           pause (see broker/cli/ops.py)

Every other command is an application's (``broker.app.command``): for those, the
modules named by ``STANDMEET_APP_MODULES`` (comma-separated; default ``actors``) are
loaded first. The runtime itself imports nothing of the application.

``run``'s supervisor, and what it guarantees, is :mod:`broker.cli.supervisor`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from broker.boot import (
    APP_MODULES_VARIABLE,
    DEFAULT_APP_MODULES,
    app_modules,
    boot,
    bounded_int,
    load_modules,
)

# Only what ``--help`` needs is imported here (it answers without Dramatiq, psycopg's pools,
# Starlette or the application): each command imports what it uses.
from broker.cli.common import (
    PROCESSES_MOST,
    CommandLineParser,
    ascii_number,
    check_counts,
    say,
    threads_per_worker,
)

__all__ = ["PROCESSES_MOST", "check_counts", "main", "say", "threads_per_worker"]

#: The log formats (``broker.settings.LOG_FORMATS``, named here so that ``--help`` imports no settings).
LOG_FORMATS = ("text", "json")
#: The runtime's own commands (built here) and their one-line help.
OWN_COMMANDS = {
    "migrate": "create or update the database schema",
    "check": "the start-up checks (connection budget, declared rules, the database reachable and migrated); "
             "exit 1 when one fails",
    "run": "migrate, then run the workers and the scheduler",
    "dashboard": "serve the web dashboard (see and steer the jobs in a browser)",
    "db": "the database in use; stop the embedded server",
}
#: The operators' commands (built by ``broker.cli.ops``, imported only to run or show one of them).
OPS_COMMANDS = {
    "status": "queues, worker processes, periodic jobs and the outbox at a glance",
    "jobs": "list, show, retry and cancel jobs",
    "queues": "list, pause and resume queues",
    "outbox": "events not relayed yet (pending, unrouted, failed); re-relay failed ones",
}
#: The commands the runtime owns: their arguments are its own (only `dashboard` and `check`
#: load the application's modules, for its pages and its settings).
RUNTIME_COMMANDS = frozenset(OWN_COMMANDS) | frozenset(OPS_COMMANDS)


def _command_of(argv: Sequence[str]) -> str | None:
    words = iter(argv)
    for word in words:
        if word == "--log-format":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    if command is not None and command not in RUNTIME_COMMANDS:  # an application's command
        from broker.errors import StandmeetError

        try:
            boot(app_modules())
        except StandmeetError as exc:
            print(f"standmeet-jobs: {exc}", file=sys.stderr)
            return 1
    parser = build_parser(command)
    args = parser.parse_args(argv)
    from broker.observability.logs import configure_logging

    configure_logging(args.log_format or _env_log_format(), level=logging.DEBUG if args.verbose else logging.INFO)
    from broker.observability.stacks import dump_stacks_on_request

    dump_stacks_on_request()  # `run`, the dashboard, a long `migrate`: where each thread waits
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    os.environ.setdefault("PGCONNECT_TIMEOUT", "5")  # libpq: an unreachable server answers in seconds
    from broker.errors import StandmeetError

    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away is met here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        if not _stdout_broken():
            raise
        return _stdout_closed()
    except StandmeetError as exc:
        say(str(exc))
        return 1
    except KeyboardInterrupt:  # Ctrl-C: psycopg has cancelled the statement on the server
        say("interrupted")
        return 130
    except UnicodeEncodeError:  # an argument no parser type checked (every one is, as it is read)
        bad = _not_utf8_arguments(argv)
        if not bad:
            raise
        say(f"{bad[0]} is not valid UTF-8 text: give it in UTF-8")
        return 2
    except Exception as exc:  # a database error past the preflight: one line, no traceback
        import psycopg

        if not isinstance(exc, psycopg.Error):
            raise
        from broker.pg.preflight import first_line

        say(f"database error: {type(exc).__name__}: {first_line(exc)}")
        return 1


def _stdout_closed() -> int:
    """What a command does when whoever read its output went away (``… --json | head -1``):
    as rich does for the tables, nothing more is written to stdout and it exits 1 quietly (the
    rest of the output, still buffered, goes to the null device at the interpreter's exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return 1


def _stdout_broken() -> bool:
    """Whether stdout is a pipe nobody reads any more (a broken pipe met elsewhere, on a
    socket, is not this)."""
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # POLLERR is always reported
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no stdout: take it as said
        return True


def _not_utf8_arguments(argv: Sequence[str]) -> list[str]:
    """The arguments of ``argv`` that are not valid UTF-8, each named with its option."""
    named = []
    for i, word in enumerate(argv):
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:
            option, equals, _ = word.partition("=")
            if word.startswith("--") and equals:
                named.append(f"argument {option} {word!r}")
            elif i and argv[i - 1].startswith("-") and "=" not in argv[i - 1]:
                named.append(f"argument {argv[i - 1]} {word!r}")
            else:
                named.append(f"argument {word!r}")
    return named


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line, built in full for ``command`` only (every command is listed):
    ``--help`` and each runtime command import nothing they do not use."""
    parser = CommandLineParser(
        prog="standmeet-jobs", description=__doc__.split("\n")[0],
        epilog=f"An application's commands (from the modules {APP_MODULES_VARIABLE} names, default {', '.join(DEFAULT_APP_MODULES)}) "
        "are loaded when named: standmeet-jobs COMMAND --help.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help="text (default) or json, one object a line (also STANDMEET_LOG_FORMAT)")
    sub = parser.add_subparsers(metavar="COMMAND")
    builders: dict[str, Callable[[argparse.ArgumentParser], None]] = {
        "migrate": _migrate_arguments, "check": _check_arguments, "run": _run_arguments,
        "dashboard": _dashboard_arguments, "db": _db_arguments,
    }
    for name, help_text in OWN_COMMANDS.items():
        if name in ("db",):
            continue  # listed last, as before
        p = sub.add_parser(name, help=help_text)
        if name == command:
            builders[name](p)
    if command in OPS_COMMANDS:
        from broker.cli import ops as opscli

        opscli.add_commands(sub)
    else:
        for name, help_text in OPS_COMMANDS.items():
            sub.add_parser(name, help=help_text)
    if command is not None and command not in RUNTIME_COMMANDS:
        from broker import app

        for app_command in app.REGISTRY.commands.values():  # the loaded application's commands
            p = sub.add_parser(app_command.name, help=app_command.help)
            p.set_defaults(func=app_command.run)
            app_command.setup(p)
    p = sub.add_parser("db", help=OWN_COMMANDS["db"])
    if command == "db":
        _db_arguments(p)
    return parser


def _migrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("modules", nargs="*", metavar="MODULE",
                   help=f"modules whose declared migrations follow the runtime's (default: "
                        f"{', '.join(DEFAULT_APP_MODULES)}), looked up in the current directory first")
    p.set_defaults(func=cmd_migrate)


def _check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("modules", nargs="*", metavar="MODULE",
                   help=f"modules declaring actors (default: {', '.join(DEFAULT_APP_MODULES)}), looked up in the current "
                        "directory first")
    p.add_argument("--queues", nargs="*", help="queues this process would serve (default: all)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads per worker process (default: the sum of the served queues' limits)")
    p.add_argument("--processes", type=int, default=None,
                   help="also check that `run --processes N` (with the scheduler) fits in the server's connections")
    p.set_defaults(func=cmd_check)


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("positional_modules", nargs="*", metavar="MODULE",
                   help=f"modules declaring actors (default: {', '.join(DEFAULT_APP_MODULES)}), looked up in the current "
                        "directory first")
    p.add_argument("--queues", nargs="*", help="queues to serve (default: all)")
    p.add_argument("--processes", type=int, default=1,
                   help="worker processes (default 1); refused when they do not fit in the server's connections")
    p.add_argument(
        "--threads", type=int, default=0,
        help="threads per worker process (default: the sum of the served queues' limits)",
    )
    p.add_argument(
        "--worker-shutdown-timeout", type=int, default=None, metavar="MS",
        help="how long a worker waits for running jobs on SIGTERM, in milliseconds "
        "(default: STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S, 20 s)",
    )
    p.add_argument("--no-scheduler", action="store_true", help="do not start the scheduler process")
    p.add_argument("--module", action="append", dest="modules", metavar="MODULE",
                   help=f"a module declaring actors, for the workers to import (repeatable; default: "
                        f"{', '.join(DEFAULT_APP_MODULES)})")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS,
                   help="text or json, for this process and its children")
    p.set_defaults(func=cmd_run)


def _dashboard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; others need STANDMEET_DASHBOARD_PASSWORD)")
    p.add_argument("--port", type=ascii_number(bounded_int(low=1, high=65535)), default=8420, help="port (default 8420)")
    p.add_argument("--read-only", action="store_true", help="show everything, change nothing")
    p.set_defaults(func=cmd_dashboard)


def _db_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["url", "stop"],
                   help="print its URL, or stop the embedded server (saying which worker processes are "
                   "still connected)")
    p.set_defaults(func=cmd_db)


def cmd_migrate(args: argparse.Namespace) -> int:
    from broker.pg.embedded import resolve_database_url
    from broker.pg.migrate import migrate
    from broker.settings import Settings

    settings = Settings.from_env()
    load_modules(app_modules(args.modules or ()))  # they declare their migrations (broker.app.migrations)
    url = resolve_database_url(settings)
    from broker import log_database

    log_database(settings, url)
    from broker import app

    applied = migrate(url, record_queues=list(app.REGISTRY.queues))  # the queues of the modules loaded above
    if applied:
        for m in applied:
            print(f"recorded {m.describe()} (the runtime's {m.replaces} applied it)" if m.adopted
                  else f"applied {m.describe()}")
    else:
        print("schema up to date")
    return 0



def cmd_check(args: argparse.Namespace) -> int:
    from broker.pg.budget import (
        Fleet,
        check_budget,
        check_fleet,
        scheduler_connections,
        served_queues,
    )
    from broker.pg.embedded import resolve_database_url
    from broker.pg.preflight import check_database
    from broker.settings import Settings, undeclared

    settings = Settings.from_env()
    check_counts(args.threads, args.processes)
    load_modules(app_modules(args.modules or ()))
    queues = served_queues(args.queues)
    budget = check_budget(settings, queues, threads=threads_per_worker(settings, queues, args.threads))
    for line in undeclared():  # the loaded modules' settings count as declared
        print(f"warning: {line}")
    url = resolve_database_url(settings)
    # What a worker meets at its start: the database reachable, its schema (the runtime's
    # and the loaded modules') current; each failure one line, exit 1.
    check_database(url)
    print(f"ok: {budget.describe()}")
    scheduler = scheduler_connections(settings)
    print(f"per process: {budget.process.describe()}")
    print(f"per process: {scheduler.describe()}")
    if args.processes is not None:
        fleet = Fleet(processes=args.processes, worker=budget.process, scheduler=scheduler,
                      supervisor=1 if settings.metrics_port is not None else 0)
        print(f"ok: {check_fleet(settings, url, fleet)}")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from broker.dashboard import serve
    from broker.dashboard.security import check_bind
    from broker.pg.embedded import resolve_database_url
    from broker.settings import Settings

    settings = Settings.from_env()
    check_bind(args.host, settings.dashboard_password)  # before touching the database
    serve(settings, resolve_database_url(settings), host=args.host, port=args.port, read_only=args.read_only,
          load_pages=lambda: load_modules(app_modules()))  # the applications' pages (broker.app.page)
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from broker.pg.embedded import resolve_database_url, stop_embedded
    from broker.settings import Settings

    settings = Settings.from_env()
    if args.action == "url":
        print(resolve_database_url(settings))
        return 0
    from broker.pg.embedded import connected_workers

    workers = connected_workers(settings)
    if workers:  # the operator asked: it stops anyway, saying what follows
        print(connected_workers_line(workers), flush=True)
    if stop_embedded(settings):
        print("embedded Postgres stopped")
    else:
        print("no embedded Postgres is running in", settings.embedded_dir)
    return 0


def connected_workers_line(workers: Sequence[tuple[str, int]]) -> str:
    """What ``db stop`` says before stopping a server worker processes still use."""
    named = ", ".join(f"{host} pid {pid}" for host, pid in workers)
    return (f"{len(workers)} worker process(es) still connected ({named}): stopping the server anyway; "
            "they log the outage and reconnect when it is back")


def _env_log_format() -> str:
    from broker.errors import ConfigError
    from broker.settings import Settings

    try:
        return Settings.from_env().log_format
    except ConfigError:
        return "text"  # the command reports the malformed setting itself


def cmd_run(args: argparse.Namespace) -> int:
    """``run``: see :mod:`broker.cli.supervisor` (imported only to run it)."""
    from broker.cli.supervisor import cmd_run as run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
