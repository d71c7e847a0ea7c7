"""``standmeet-jobs dashboard``: see and steer the jobs in a browser.

Server-rendered pages (Starlette, Jinja2) over the queries of :mod:`broker.ops`; a
little hand-written JavaScript refreshes the open page. See :mod:`.security` for
who may listen, look and act.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable

from broker.app import PeriodicJob
from broker.dashboard.app import DashboardConfig
from broker.dashboard.security import check_bind, parse_allowed_hosts
from broker.dashboard.server import create_app
from broker.errors import ConfigError
from broker.settings import Settings

__all__ = ["DashboardConfig", "config_from_settings", "create_app", "serve"]

logger = logging.getLogger("standmeet.dashboard")


def declared_periodic_jobs() -> tuple[PeriodicJob, ...]:
    """The periodic jobs this process declares (the rest come from the schedules the
    schedulers recorded)."""
    from broker import app

    return tuple(app.periodic_jobs())


def config_from_settings(settings: Settings, url: str, *, host: str = "127.0.0.1",
                         read_only: bool = False) -> DashboardConfig:
    """The dashboard's configuration from the settings, for one listening address."""
    return DashboardConfig(
        database_url=url, read_only=read_only, hide_args=settings.dashboard_hide_args,
        user=settings.dashboard_user, password=settings.dashboard_password,
        rescue_after_s=settings.rescue_after_s, queues=tuple(settings.queues),
        periodic_jobs=declared_periodic_jobs(), bind_host=host,
        allowed_hosts=parse_allowed_hosts(settings.dashboard_allowed_hosts),
        secure_cookie=settings.dashboard_secure_cookie,
    )


def listen(host: str, port: int) -> socket.socket:
    """The dashboard's listening socket, bound before anything is said or served: a busy
    port (or an address this machine does not have) is a :class:`ConfigError` in one line
    naming the cause and the option that fixes it."""
    where = f"{host if ':' not in host else f'[{host}]'}:{port}"
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as exc:
        raise ConfigError(f"cannot serve the dashboard on {where}: {exc.strerror or exc}; pass --host "
                          "with an address of this machine") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"cannot serve the dashboard on {where}: the port {port} is in use; pass --port "
                              "with a free one") from None
        raise ConfigError(f"cannot serve the dashboard on {where}: {exc.strerror or exc}; pass another "
                          "--host or --port") from None
    return sock


def serve(settings: Settings, url: str, *, host: str, port: int, read_only: bool = False,
          load_pages: Callable[[], None] | None = None) -> None:
    """Serve the dashboard until Ctrl-C / SIGTERM; refuses a non-loopback host without a
    password, a malformed setting, and a port it cannot listen on (before loading
    anything or saying where it serves). ``load_pages`` then loads the modules that
    declare the applications' pages (``broker.app.page``)."""
    check_bind(host, settings.dashboard_password)
    parse_allowed_hosts(settings.dashboard_allowed_hosts)  # a malformed one refused before anything is loaded
    sock = listen(host, port)
    with sock:
        if load_pages is not None:
            load_pages()
        config = config_from_settings(settings, url, host=host, read_only=read_only)
        import uvicorn

        app = create_app(config)
        auth = "HTTP basic auth" if settings.dashboard_password else "no auth (loopback)"
        logger.info("dashboard on http://%s:%d/ (%s%s)", host if ":" not in host else f"[{host}]", port, auth,
                    ", read-only" if read_only else "")
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                              server_header=False))
        server.run(sockets=[sock])
