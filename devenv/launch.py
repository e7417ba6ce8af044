"""Launch a relay or resolver of this checkout as a process with a clean environment: the one
helper of the tests, the benchmark, the demo, the chaos run and the memory run."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def program_env(database_url: str, amqp_url: str, **settings: str) -> dict[str, str]:
    """This process's environment without any OUTBOX_ setting of its own (a developer's shell
    must not leak into a run), plus the servers, metrics on a free port, this checkout
    importable, and ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_DATABASE_URL": database_url, "OUTBOX_AMQP_URL": amqp_url,
                "OUTBOX_METRICS_PORT": "0", "PYTHONPATH": str(ROOT)})
    env.update(settings)
    return env


# The programs by the short names the tests, the benchmark and the runs give them.
PROGRAMS = {"relay": "outbox_relay.relay", "resolver": "outbox_relay.resolver"}

# The relay with crash points (OUTBOX_TEST_CRASH_AT, ...): the installed relay reads no such
# variable (relay/faults.py), so a launch whose environment sets one runs this in its place.
CRASH_POINT_RELAY = "devenv.crash_points"


def wants_crash_points(env: Mapping[str, str]) -> bool:
    return any(name.startswith("OUTBOX_TEST_") and value for name, value in env.items())


def command(program: str, *args: str, crash_points: bool = False) -> list[str]:
    """The command line that runs ``program`` (``relay``, ``resolver`` or a module's name);
    ``crash_points``: the relay through devenv/crash_points.py."""
    module = PROGRAMS.get(program, program)
    if crash_points and module == PROGRAMS["relay"]:
        module = CRASH_POINT_RELAY
    return [sys.executable, "-m", module, *args]


def launch(program: str, env: dict[str, str], log_path: Path, *args: str,
           append: bool = False) -> subprocess.Popen[bytes]:
    """``python -m <program's module> args`` from the checkout (``program``: ``relay``,
    ``resolver`` or a module's name), its output to ``log_path``; a relay whose ``env`` sets
    OUTBOX_TEST_* crash points runs with them (devenv/crash_points.py)."""
    with open(log_path, "ab" if append else "wb") as log:
        return subprocess.Popen(command(program, *args, crash_points=wants_crash_points(env)),
                                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
