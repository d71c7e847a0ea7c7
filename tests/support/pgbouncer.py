"""Debian's PgBouncer in front of the test server, as production runs it.

``with pgbouncer(server_url, mode="transaction") as bouncer:`` starts ``/usr/sbin/pgbouncer``
on ``127.0.0.1:<free port>`` in front of ``server_url``'s server (the embedded one, on its
Unix socket, or ``DATABASE_URL``'s), with a configuration of its own in a temporary
folder, and stops it (and removes the folder) on the way out, even when the test fails.
``bouncer.url(url)`` is the same database, user and password through the pooler.

Stock settings on purpose: ``pool_mode`` as asked, ``default_pool_size`` 20 unless told,
``ignore_startup_parameters`` unset (so a client that sends ``options`` is refused, as a
managed PgBouncer refuses it); only ``max_client_conn`` is raised, so that the number of
test clients is never what runs out. Client authentication is ``trust``, with an
``auth_file`` naming the server's user (and its password, if the URL carries one, which
PgBouncer then uses to log in to the server).

PgBouncer refuses to run as root: as root it is started with ``-u USER``, where USER is
the owner of the server's socket folder (the embedded server's own user, the only one
that may open its socket), else ``postgres``, else ``nobody``; the temporary folder is
given to that user.

``python -m tests.support.pgbouncer transaction [URL]`` runs one in the foreground and
prints its URL, for trying the runtime by hand.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

PGBOUNCER = os.environ.get("STANDMEET_TEST_PGBOUNCER") or "/usr/sbin/pgbouncer"
MODES = ("transaction", "session")
#: PgBouncer's own default pool size.
STOCK_POOL_SIZE = 20
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
#: Connection parameters that name where the server is: the pooler's replace them.
_WHERE = ("host", "hostaddr", "port")


def missing_reason() -> str | None:
    """Why PgBouncer cannot run here (None when it can)."""
    if not os.access(PGBOUNCER, os.X_OK) and shutil.which("pgbouncer") is None:
        return (f"PgBouncer is not installed ({PGBOUNCER} is missing): Debian's pgbouncer package, "
                "which .ci/run installs with apt-get")
    return None


def executable() -> str:
    return PGBOUNCER if os.access(PGBOUNCER, os.X_OK) else str(shutil.which("pgbouncer"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as(server_host: str) -> str | None:
    """The user PgBouncer runs as (None: this process's own, when it is not root)."""
    if os.geteuid() != 0:
        return None
    if server_host.startswith("/"):
        try:
            owner = pwd.getpwuid(os.stat(server_host).st_uid).pw_name
        except (OSError, KeyError):
            owner = "root"
        if owner != "root":
            return owner
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("PgBouncer refuses to run as root and this machine has no 'postgres' or 'nobody' user")


def _quote(value: str) -> str:
    """A value inside a PgBouncer connection string (libpq quoting)."""
    if value and all(c not in value for c in " '\\="):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """One PgBouncer process; see the module's docstring."""

    def __init__(self, server_url: str, *, mode: str = "transaction", default_pool_size: int = STOCK_POOL_SIZE,
                 max_client_conn: int = 2000, settings: dict[str, str] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"pool mode {mode!r}: one of {', '.join(MODES)}")
        self.server = conninfo_to_dict(server_url)
        self.mode = mode
        self.default_pool_size = default_pool_size
        self.max_client_conn = max_client_conn
        self.settings = dict(settings or {})
        self.port = 0
        self.folder: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = str(self.server.get("user") or pwd.getpwuid(os.geteuid()).pw_name)

    # -- where clients go -----------------------------------------------------------

    def url(self, url_or_dbname: str) -> str:
        """``url_or_dbname`` (a URL of the same server, or a database name) through the pooler."""
        if "=" in url_or_dbname or "://" in url_or_dbname:
            params = conninfo_to_dict(url_or_dbname)
        else:
            params = {**self.server, "dbname": url_or_dbname}
        for key in _WHERE:
            params.pop(key, None)
        params.update(host="127.0.0.1", port=str(self.port))
        return make_conninfo(**params)

    @property
    def log_path(self) -> Path:
        assert self.folder is not None
        return self.folder / "pgbouncer.log"

    def log(self) -> str:
        """What PgBouncer logged (its log file and anything it said on stderr)."""
        if self.folder is None:
            return ""
        parts = [p.read_text(errors="replace") for p in (self.log_path, self.folder / "stderr.log") if p.exists()]
        return "\n".join(parts)

    def admin(self, command: str) -> list[tuple[str | None, ...]]:
        """A command of PgBouncer's admin console (``SHOW POOLS``…), its rows as text."""
        conninfo = make_conninfo(host="127.0.0.1", port=str(self.port), dbname="pgbouncer", user=self.user,
                                 **({"password": str(self.server["password"])} if self.server.get("password") else {}))
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            result = conn.pgconn.exec_(command.encode())  # the console speaks the simple protocol only
            return [tuple(None if (v := result.get_value(r, c)) is None else v.decode()
                          for c in range(result.nfields)) for r in range(result.ntuples)]

    # -- life cycle -------------------------------------------------------------------

    def config(self) -> str:
        host = str(self.server.get("host") or "/var/run/postgresql")
        port = str(self.server.get("port") or 5432)
        target = f"host={_quote(host)} port={port}"
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self._path("users.txt")),
            "admin_users": self.user,
            "pool_mode": self.mode,
            "default_pool_size": str(self.default_pool_size),
            "max_client_conn": str(self.max_client_conn),
            "logfile": str(self.log_path),
            "pidfile": str(self._path("pgbouncer.pid")),
            **self.settings,
        }
        lines = ["[databases]", f"* = {target}", "", "[pgbouncer]", *(f"{k} = {v}" for k, v in settings.items())]
        return "\n".join(lines) + "\n"

    def _path(self, name: str) -> Path:
        assert self.folder is not None
        return self.folder / name

    def start(self) -> PgBouncer:
        reason = missing_reason()
        if reason:
            raise RuntimeError(reason)
        self.folder = Path(tempfile.mkdtemp(prefix="standmeet-pgbouncer-"))
        self.port = free_port()
        password = str(self.server.get("password") or "")
        self._path("users.txt").write_text(f'"{self.user}" "{password}"\n')
        self._path("pgbouncer.ini").write_text(self.config())
        run_as = _run_as(str(self.server.get("host") or ""))
        if run_as is not None:
            entry = pwd.getpwnam(run_as)
            for path in (self.folder, *self.folder.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.folder.chmod(0o700)
        cmd = [executable(), *(["-u", run_as] if run_as else []), str(self._path("pgbouncer.ini"))]
        with open(self._path("stderr.log"), "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            self._wait_until_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_up(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with status {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                self.admin("SHOW VERSION")
                return
            except psycopg.Error as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not answer within {START_TIMEOUT_S:g} s ({exc}): "
                                       f"{self.log()[-2000:]}") from exc
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (PgBouncer's immediate shutdown), SIGKILL if it lingers; remove the folder."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        folder, self.folder = self.folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def pgbouncer(server_url: str, *, mode: str = "transaction", default_pool_size: int = STOCK_POOL_SIZE,
              settings: dict[str, str] | None = None) -> Iterator[PgBouncer]:
    """A started PgBouncer in front of ``server_url``'s server; stopped and removed after."""
    with PgBouncer(server_url, mode=mode, default_pool_size=default_pool_size, settings=settings) as bouncer:
        yield bouncer


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else "transaction"
    if len(argv) > 1:
        server = argv[1]
    else:
        from tests.support.db import server_url

        server = server_url()
    with pgbouncer(server, mode=mode) as bouncer:
        print(bouncer.url(server), flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
