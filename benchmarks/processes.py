"""The real programs (``python -m relay``, ``python -m resolver``) as the benchmark runs them.

Default settings throughout, except what a benchmark on shared servers must set: the URLs, no
metrics port (the default one may be taken by another run) and JSON logs (the recovery
benchmark reads the relay's instance id from its start-up line).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.cpu import CpuMeter
from benchmarks.profile import Profiler
from benchmarks.workload import Servers
from devenv import launch

_SPAWN = mp.get_context("spawn")  # fresh interpreters: each process's memory is its own


class Program:
    """One running relay or resolver process (``args``: a command of it, such as ``compact``)
    with its log file."""

    def __init__(self, module: str, servers: Servers, logdir: Path, name: str, *args: str,
                 **settings: str) -> None:
        env = launch.program_env(servers.db_url, servers.amqp_url,
                                 **{"OUTBOX_LOG_FORMAT": "json", **settings})
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self.proc = launch.launch(module, env, self.log_path, *args)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mb(self) -> float:
        return status_kb(self.pid, "VmRSS") / 1024

    def peak_rss_mb(self) -> float:
        """The kernel's high-water mark of this process's resident memory."""
        return status_kb(self.pid, "VmHWM") / 1024

    def log_field(self, action: str, field: str, timeout: float = 20.0) -> str:
        """A field of the first JSON log line with ``action`` (waits for it to be written)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("{") and f'"{action}"' in line:
                    return str(json.loads(line)[field])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: no {action!r} log line; see {self.log_path}")

    def stop(self) -> int:
        """SIGTERM (the batch in flight finishes), SIGKILL if it does not exit in 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def relay(servers: Servers, logdir: Path, name: str, **settings: str) -> Program:
    return Program("relay", servers, logdir, name, **settings)


def resolver(servers: Servers, logdir: Path, name: str = "resolver", **settings: str) -> Program:
    return Program("resolver", servers, logdir, name, **settings)


def status_kb(pid: int, key: str) -> int:
    """A field of /proc/<pid>/status, in kB (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {key}")


def run_together(target: Callable[..., None], arguments: list[tuple[Any, ...]],
                 meter: CpuMeter, profiler: Profiler | None = None) -> tuple[float, list[Any]]:
    """One spawned process per argument tuple, all let go at once; their start time and results.

    ``target(*arguments, ready, go, done)`` connects, releases ``ready``, waits for ``go``,
    works, and puts its result on ``done``: connecting and interpreter start-up are not timed.
    """
    ready, go, done = _SPAWN.Semaphore(0), _SPAWN.Event(), _SPAWN.Queue()
    procs = [_SPAWN.Process(target=target, args=(*args, ready, go, done)) for args in arguments]
    for proc in procs:
        proc.start()
    for _ in procs:
        if not ready.acquire(timeout=60):
            raise RuntimeError(f"a {target.__name__} process did not connect within 60 s")
    if profiler is not None:
        profiler.start([proc.pid for proc in procs if proc.pid is not None])
    meter.start()
    started = time.monotonic()
    go.set()
    results = [done.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(30)
        if proc.exitcode != 0:
            raise RuntimeError(f"a {target.__name__} process exited with {proc.exitcode}")
    return started, results
