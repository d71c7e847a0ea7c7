"""How every process of the runtime starts: one boot shared by its entry points.

``python -m broker.worker``, ``python -m broker.relay``, ``python -m periodic`` and
``standmeet-jobs`` all start the same way, here:

1. the current directory goes first on ``sys.path`` (as ``dramatiq`` does), so that
   ``run reports`` finds ``./reports.py``;
2. :func:`boot` configures the broker (``broker.configure()``: settings, database,
   middleware) where the process starts, once, then loads the application's modules
   (:data:`DEFAULT_APP_MODULES` unless named; ``STANDMEET_APP_MODULES`` for the CLI), each
   failure to load in one line naming the module, its error and where it was raised;
3. a configuration the process must refuse (a bad setting, the connection budget, a
   module that cannot load) is one line and :data:`CONFIG_REFUSED_EXIT`, so that ``run``
   stops instead of restarting it (:func:`refuse`, :func:`die_with_supervisor`).

Importing a module of the runtime configures nothing: this is where it happens.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from broker.exits import CONFIG_REFUSED_EXIT

if TYPE_CHECKING:
    from broker.engine.broker import StandmeetBroker
    from broker.settings import Settings

logger = logging.getLogger("standmeet.boot")

#: The application's modules a process loads when none are named.
DEFAULT_APP_MODULES = ("actors",)
#: The application modules the CLI loads for its application's commands (comma-separated).
APP_MODULES_VARIABLE = "STANDMEET_APP_MODULES"
#: prctl(2): the signal a process gets when the thread that started it exits.
PR_SET_PDEATHSIG = 1


def app_modules(named: Sequence[str] = ()) -> list[str]:
    """The modules to load: those named, else ``STANDMEET_APP_MODULES``, else :data:`DEFAULT_APP_MODULES`."""
    if named:
        return list(named)
    listed = [m.strip() for m in (os.environ.get(APP_MODULES_VARIABLE) or "").split(",") if m.strip()]
    return listed or list(DEFAULT_APP_MODULES)


def boot(modules: Sequence[str], *, settings: Settings | None = None) -> StandmeetBroker:
    """Configure this process's broker (unless it is configured already), then load the
    application's ``modules``: what every entry point does first. Returns the broker in
    force after they loaded."""
    from broker import configure, services

    if services.installed() is None:
        configure(settings)
    load_modules(modules)
    # the broker in force once they are loaded: a module may configure one of its own
    # (``broker.configure()`` at its import, as Dramatiq's CLI wants); its actors moved over
    return services.current_broker()


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line naming what was wrong, exit 2 (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def bounded_int(*, low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high``, else one line saying so."""
    def whole_number(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give {low} to {high}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {low} to {high}")
        return value
    return whole_number


def bounded_float(*, low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number from ``low`` to ``high``, else one line saying so."""
    def number(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give {low:.15g} to {high:.15g}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text.strip()} is out of range: give {low:.15g} to {high:.15g}")
        return value
    return number


def die_with_supervisor(supervisor_pid: int) -> bool:
    """Have Linux send this process SIGTERM when its supervisor dies (prctl
    PR_SET_PDEATHSIG); False when the supervisor is gone already (it died before the
    request took hold, and no signal will come), and this process must not start."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            logger.warning("cannot ask to die with the supervisor (pid %d): %s", supervisor_pid, os.strerror(errno))
    return os.getppid() == supervisor_pid


def refuse(who: str, reason: str, refusal_fd: int | None) -> int:
    """Say in one line why this process refuses its configuration (on stderr, and to the
    supervisor on ``refusal_fd``); the exit status that tells it not to restart us."""
    line = " ".join(reason.split())
    print(f"{who}: {line}", file=sys.stderr, flush=True)
    if refusal_fd is not None:
        try:
            os.write(refusal_fd, line.encode()[:4000])
        except OSError:
            pass  # the supervisor still sees the exit status
    return CONFIG_REFUSED_EXIT


def look_in_current_directory() -> str:
    """Put the current directory first on ``sys.path``, as ``dramatiq`` does, so that
    ``run reports`` finds ``./reports.py`` (the children ``run`` starts inherit the
    directory and do the same). Returns the directory."""
    here = os.getcwd()
    if sys.path[:1] != [here]:
        while here in sys.path:
            sys.path.remove(here)
        sys.path.insert(0, here)
    return here


def load_modules(modules: Sequence[str]) -> None:
    """Import the modules that declare actors, queues and commands, looked up in the
    current directory first.

    A module that cannot load raises :class:`ModuleNotLoaded`: one line naming it, the
    last line of its error and where it was raised (``file:line``); our own errors raised
    by its import (a malformed setting, an unreachable database) stay what they are."""
    from broker.errors import ModuleNotLoaded, StandmeetError

    if modules:
        here = look_in_current_directory()
    for module in modules:
        try:
            importlib.import_module(module)
        except StandmeetError:
            raise
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                raise ModuleNotLoaded(
                    f"cannot load module {module!r}: no module named {exc.name!r} in {here} or on the Python "
                    "path: check the name (a module, not a file name), or run from the folder that holds it"
                ) from None
            raise ModuleNotLoaded(f"cannot load module {module!r}: {last_line(exc)}{_where(exc)}") from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a module that exits at import is refused
            raise ModuleNotLoaded(f"cannot load module {module!r}: {last_line(exc)}{_where(exc)}") from None


def last_line(exc: BaseException) -> str:
    """The last line Python prints for an exception (``ValueError: boom``), on one line."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    # a syntax error ends with its type and message; any other error starts with them (a
    # message of several lines continues below: detail)
    return lines[-1] if isinstance(exc, SyntaxError) else lines[0]


def _where(exc: BaseException) -> str:
    """`` (file:line)`` where an exception was raised: the innermost frame outside
    Python's import machinery (for a syntax error, the offending line)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen importlib")]
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def add_process_arguments(parser: argparse.ArgumentParser, *, declaring: str) -> None:
    """The arguments of every process ``run`` supervises: the modules to load (what they
    declare: ``declaring``), and the supervision options."""
    parser.add_argument("modules", nargs="*", default=list(DEFAULT_APP_MODULES),
                        help=f"modules that declare {declaring} (default: {', '.join(DEFAULT_APP_MODULES)})")
    add_supervision_arguments(parser)


def supervisor_gone(who: str, args: argparse.Namespace) -> bool:
    """Whether this process was started by a supervisor that is gone already (said in one
    line): then it must not start. Otherwise it now dies with its supervisor."""
    if args.supervised_by is not None and not die_with_supervisor(args.supervised_by):
        print(f"{who}: its supervisor (pid {args.supervised_by}) is gone: not starting", file=sys.stderr)
        return True
    return False


def add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``run`` gives each child it supervises."""
    parser.add_argument("--supervised-by", type=int, default=None, metavar="PID",
                        help="exit when this process (the parent, `standmeet-jobs run`) dies")
    parser.add_argument("--refusal-fd", type=int, default=None, metavar="FD",
                        help="write the reason of a configuration refusal to this file descriptor")


