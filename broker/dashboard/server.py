"""The dashboard's ASGI application: its routes (``pages``, and the applications'
declared with ``broker.app.page``), security and connection pool."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from broker.app import dashboard_pages
from broker.dashboard import pages
from broker.dashboard.app import (
    NAV,
    STATEMENT_TIMEOUT_MS,
    DashboardConfig,
    brief_target,
    format_age,
    format_ts,
    pretty_json,
)
from broker.dashboard.security import (
    BasicAuth,
    Csrf,
    HostGuard,
    OriginGuard,
    SecurityHeaders,
    allowed_hosts,
)
from broker.pg.pool import open_pool


def create_app(config: DashboardConfig) -> Starlette:
    """The ASGI application; its lifespan opens (and closes) a small connection pool."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool = open_pool(config.database_url, max_size=config.pool_max_size, timeout_s=config.connect_timeout_s,
                         name="standmeet-dashboard", statement_timeout_ms=STATEMENT_TIMEOUT_MS)
        app.state.pool = pool
        try:
            yield
        finally:
            pool.close()

    declared = dashboard_pages()
    # the runtime's templates first (an application's extend base.html), then each application's
    loaders: list[jinja2.BaseLoader] = [jinja2.PackageLoader("broker.dashboard", "templates")]
    for package, folder in dict.fromkeys(p.templates for p in declared if p.templates is not None):
        loaders.append(jinja2.PackageLoader(package, folder))
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(age=format_age, ts=format_ts, pretty=pretty_json, brief=brief_target)
    templates = Jinja2Templates(env=env)

    # Outermost first: every answer gets the headers; a foreign Host is refused before
    # anything else is looked at, a foreign POST before its credentials or form are read.
    middleware = [Middleware(SecurityHeaders),
                  Middleware(HostGuard, allowed=allowed_hosts(config.bind_host, config.allowed_hosts)),
                  Middleware(OriginGuard)]
    if config.password:
        middleware.append(Middleware(BasicAuth, user=config.user, password=config.password))
    app = Starlette(
        routes=[*pages.routes(), Mount("/static", StaticFiles(packages=[("broker.dashboard", "static")]),
                                       name="static")],
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.templates = templates
    app.state.csrf = Csrf.new()
    app.state.nav = [*NAV, *((p.path, p.title) for p in declared if p.title is not None)]
    return app
