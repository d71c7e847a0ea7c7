"""``standmeet-jobs``: the operator's command line (a process entry point).

    standmeet-jobs migrate                 create or update the schema (idempotent)
    standmeet-jobs check [MODULE …]        the start-up checks (the connection budget…)
    standmeet-jobs run [MODULE …]          migrate, then run worker processes (python -m
                                           broker.worker MODULE …) and the scheduler until
                                           Ctrl-C / SIGTERM
    standmeet-jobs dashboard               the web dashboard (loopback:8420 unless told)
    standmeet-jobs db url|stop             the database in use; stop the embedded server
    standmeet-jobs status | jobs … | queues …   what runs and what failed; retry, cancel,
                                           pause (see broker/opscli.py)

Every other command is an application's (``broker.app.command``): for those, the
modules named by ``STANDMEET_APP_MODULES`` (comma-separated; default ``actors``) are
loaded first. The runtime itself imports nothing of the application.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

from broker.budget import check_budget
from broker.embedded import resolve_database_url, stop_embedded
from broker.errors import ConfigError, StandmeetError
from broker.logging_setup import configure_logging
from broker.migrate import migrate
from broker.settings import LOG_FORMATS, Settings, undeclared

logger = logging.getLogger("standmeet")

#: Grace given to child processes beyond the worker shutdown timeout before SIGKILL.
CHILD_EXIT_GRACE_S = 5.0
#: A second Ctrl-C forces the exit only this long after the first signal.
FORCE_AFTER_S = 1.0
#: A crashed child is restarted after a back-off that doubles (reset once it ran a while).
RESTART_MIN_BACKOFF_S = 1.0
RESTART_MAX_BACKOFF_S = 30.0
RESTART_RESET_AFTER_S = 60.0


#: The commands the runtime owns: they never load the application's modules.
RUNTIME_COMMANDS = frozenset({"migrate", "check", "run", "dashboard", "db", "status", "jobs", "queues"})
#: The application modules loaded for every other command (comma-separated).
APP_MODULES_VARIABLE = "STANDMEET_APP_MODULES"


def app_modules() -> list[str]:
    return [m.strip() for m in (os.environ.get(APP_MODULES_VARIABLE) or "actors").split(",") if m.strip()]


def load_modules(modules: Sequence[str]) -> None:
    """Import the modules that declare actors, queues and commands; one line if one is missing."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                raise StandmeetError(f"cannot load module {module!r}: no module named {exc.name!r}") from None
            raise


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
    if _command_of(argv) not in RUNTIME_COMMANDS:
        try:
            load_modules(app_modules())
        except StandmeetError as exc:
            if _command_of(argv) is not None:
                print(f"standmeet-jobs: {exc}", file=sys.stderr)
                return 1  # --help goes on with the runtime's commands only
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format or _env_log_format(), level=logging.DEBUG if args.verbose else logging.INFO)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    os.environ.setdefault("PGCONNECT_TIMEOUT", "5")  # libpq: an unreachable server answers in seconds
    try:
        return int(args.func(args) or 0)
    except StandmeetError as exc:
        print(f"standmeet-jobs: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a database error past the preflight: one line, no traceback
        import psycopg

        if not isinstance(exc, psycopg.Error):
            raise
        from broker.preflight import first_line

        print(f"standmeet-jobs: database error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return 1


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line naming what was wrong (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="standmeet-jobs", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help="text (default) or json, one object a line (also STANDMEET_LOG_FORMAT)")
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("migrate", help="create or update the database schema")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("check", help="the start-up checks (connection budget, declared rules); exit 1 when one fails")
    p.add_argument("modules", nargs="*", metavar="MODULE", help="modules declaring actors (default: actors)")
    p.add_argument("--queues", nargs="*", help="queues this process would serve (default: all)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("run", help="migrate, then run the workers and the scheduler")
    p.add_argument("positional_modules", nargs="*", metavar="MODULE",
                   help="modules declaring actors (default: actors)")
    p.add_argument("--queues", nargs="*", help="queues to serve (default: all)")
    p.add_argument("--processes", type=int, default=1, help="worker processes (default 1)")
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
                   help="a module declaring actors, for the workers to import (repeatable; default: actors)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS,
                   help="text or json, for this process and its children")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("dashboard", help="serve the web dashboard (see and steer the jobs in a browser)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; others need STANDMEET_DASHBOARD_PASSWORD)")
    p.add_argument("--port", type=int, default=8420, help="port (default 8420)")
    p.add_argument("--read-only", action="store_true", help="show everything, change nothing")
    p.set_defaults(func=cmd_dashboard)

    from broker import app, opscli

    opscli.add_commands(sub)
    for command in app.REGISTRY.commands.values():  # the loaded application's commands
        p = sub.add_parser(command.name, help=command.help)
        p.set_defaults(func=command.run)
        command.setup(p)

    p = sub.add_parser("db", help="the database in use")
    p.add_argument("action", choices=["url", "stop"], help="print its URL, or stop the embedded server")
    p.set_defaults(func=cmd_db)
    return parser


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    url = resolve_database_url(settings)
    from broker import log_database

    log_database(settings, url)
    applied = migrate(url)
    if applied:
        for m in applied:
            print(f"applied {m.version:04d}_{m.name}")
    else:
        print("schema up to date")
    return 0


def served(settings: Settings, modules: Sequence[str], queues: Sequence[str] | None) -> list[str]:
    """Load ``modules``; the queues a worker of theirs serves (``queues``, checked, or all)."""
    load_modules(modules)
    known = sorted(settings.queues)
    unknown = sorted(set(queues or ()) - set(known))
    if unknown:
        raise StandmeetError(f"unknown queue(s) {', '.join(unknown)}; the known queues are {', '.join(known)}")
    return list(queues) if queues else known


def cmd_check(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    budget = check_budget(settings, served(settings, args.modules or ["actors"], args.queues))
    for line in undeclared():  # the loaded modules' settings count as declared
        print(f"warning: {line}")
    print(f"ok: {budget.describe()}")
    print(f"broker pool: {budget.broker_pool_size} connections for {budget.consumers} consumers and acks")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from broker.dashboard import serve
    from broker.dashboard.security import check_bind

    settings = Settings.from_env()
    check_bind(args.host, settings.dashboard_password)  # before touching the database
    serve(settings, resolve_database_url(settings), host=args.host, port=args.port, read_only=args.read_only)
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    if args.action == "url":
        print(resolve_database_url(settings))
    elif stop_embedded(settings):
        print("embedded Postgres stopped")
    else:
        print("no embedded Postgres is running in", settings.embedded_dir)
    return 0


def _env_log_format() -> str:
    try:
        return Settings.from_env().log_format
    except ConfigError:
        return "text"  # the command reports the malformed setting itself


def cmd_run(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    args.modules = [*(args.positional_modules or []), *(args.modules or [])] or ["actors"]
    queues = served(settings, args.modules, args.queues)
    budget = check_budget(settings, queues)
    url = resolve_database_url(settings)
    from broker import log_database

    log_database(settings, url)
    if not migrate(url):  # each migration applied logs its own line
        logger.info("schema up to date")
    logger.info("connection budget: %s", budget.describe())

    shutdown_ms = args.worker_shutdown_timeout
    if shutdown_ms is None:
        shutdown_ms = int(settings.worker_shutdown_timeout_s * 1000)
    threads = args.threads or sum(settings.queue(q).max_workers for q in queues)
    log_format = getattr(args, "log_format", None) or settings.log_format
    env = {**os.environ, "DATABASE_URL": url, "STANDMEET_LOG_FORMAT": log_format}
    worker = [
        sys.executable, "-m", "broker.worker", *(args.modules or []),
        "--threads", str(threads),
        "--worker-shutdown-timeout", str(shutdown_ms),
        *(["--queues", *queues] if args.queues else []),
    ]
    commands = [worker for _ in range(max(1, args.processes))]
    if not args.no_scheduler and importlib.util.find_spec("periodic.__main__") is not None:
        commands.append([sys.executable, "-m", "periodic", *args.modules])
    with serving_metrics(settings, url, env):
        return supervise(commands, env=env, shutdown_s=shutdown_ms / 1000 + CHILD_EXIT_GRACE_S)


@contextmanager
def serving_metrics(settings: Settings, url: str, env: dict[str, str]) -> Iterator[None]:
    """With STANDMEET_METRICS_PORT: one /metrics for every child (prometheus_client's
    multiprocess mode, in a folder made here and removed after), plus the database
    gauges, computed here once per scrape."""
    if settings.metrics_port is None:
        yield
        return
    import shutil
    import tempfile

    from broker.metrics import registry_for, serve

    folder = tempfile.mkdtemp(prefix="standmeet-metrics-")
    env["PROMETHEUS_MULTIPROC_DIR"] = folder
    registry = registry_for(url, multiprocess_dir=folder, rescue_after_s=settings.rescue_after_s)
    try:
        server = serve(registry, settings.metrics_host, settings.metrics_port)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                          f"{exc.strerror or exc}") from exc
    logger.info("metrics: http://%s:%d/metrics", settings.metrics_host, server.port)
    try:
        yield
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _child_exited(pid: int, env: dict[str, str]) -> None:
    """A child is gone: its live gauges (jobs in progress) no longer count."""
    folder = env.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, folder)


def supervise(commands: list[list[str]], *, env: dict[str, str], shutdown_s: float) -> int:
    """Run the children until SIGTERM/SIGINT, restarting one that dies (with back-off).

    The first signal is forwarded as SIGTERM: each child gets its full shutdown timeout
    (a Ctrl-C also reaches them directly, through the process group; they wait all the
    same). A deliberate second Ctrl-C more than a second later forwards SIGINT, which
    makes them exit at once, and `run` exits 1.
    """
    first_signal_at: list[float] = []
    forced: list[bool] = []
    children: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, frame: object) -> None:
        now = time.monotonic()
        if not first_signal_at:
            first_signal_at.append(now)
            return
        if signum == signal.SIGINT and now - first_signal_at[0] > FORCE_AFTER_S and not forced:
            forced.append(True)
            logger.warning("second Ctrl-C: forcing the workers to exit now; running jobs are cut off")
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGINT)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    children.extend(subprocess.Popen(cmd, env=env) for cmd in commands)
    for child, cmd in zip(children, commands, strict=True):
        logger.info("started pid %d: %s", child.pid, " ".join(cmd[1:]))
    started_at = [time.monotonic()] * len(children)
    restart_at: list[float | None] = [None] * len(children)
    backoff = [RESTART_MIN_BACKOFF_S] * len(children)
    try:
        while not first_signal_at:
            now = time.monotonic()
            for n, child in enumerate(children):
                if restart_at[n] is None and child.poll() is not None:
                    ran = now - started_at[n]
                    if ran > RESTART_RESET_AFTER_S:
                        backoff[n] = RESTART_MIN_BACKOFF_S
                    logger.error("pid %d (%s) exited with %s after %.1f s; restarting it in %.1f s",
                                 child.pid, " ".join(commands[n][1:3]), child.returncode, ran, backoff[n])
                    restart_at[n] = now + backoff[n]
                    backoff[n] = min(backoff[n] * 2, RESTART_MAX_BACKOFF_S)
                due = restart_at[n]
                if due is not None and now >= due:
                    children[n] = subprocess.Popen(commands[n], env=env)
                    started_at[n], restart_at[n] = now, None
                    logger.info("restarted pid %d: %s", children[n].pid, " ".join(commands[n][1:]))
            time.sleep(0.2)
        alive = [c for c in children if c.poll() is None]
        logger.info("stopping: SIGTERM to %s; running jobs get up to %.0f s",
                    ", ".join(str(c.pid) for c in alive) or "none", shutdown_s - CHILD_EXIT_GRACE_S)
        for child in alive:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + shutdown_s
        for child in alive:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("pid %d did not stop in time; killing it", child.pid)
                child.kill()
                child.wait()
            _child_exited(child.pid, env)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 1 if forced else 0


if __name__ == "__main__":
    sys.exit(main())
