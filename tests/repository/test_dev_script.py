"""./dev installs what each command needs and no more: the demo gets the servers and the project
(with psycopg's binary build, as the image has it), never Prometheus nor the test or benchmark
dependency groups. Run with stub apt-get and pip that only record what they were asked for."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEV = (ROOT / "dev").read_text("utf-8")


def _function(name: str) -> str:
    match = re.search(rf"^{name}\(\) {{\n.*?^}}\n", DEV, re.M | re.S)
    assert match, name
    return match[0]


def _branch(command: str) -> str:
    match = re.search(rf"^    {command}\)(.*?);;", DEV, re.M | re.S)
    assert match, command
    return match[1]


def run_setup(tmp_path: Path, command: str) -> list[str]:
    """The set-up lines of ``./dev COMMAND`` with stubs: what would apt-get and pip install?"""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    log = tmp_path / "calls"
    for name, body in (("apt-get", f'echo "apt-get $*" >> {log}'), ("id", "echo 0")):
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    for tool in ("touch",):  # what the functions use besides the stubs and bash's builtins
        found = shutil.which(tool)
        assert found, tool
        (stubs / tool).symlink_to(found)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "pip $*" >> {log}\n')
    (venv / "bin" / "python").chmod(0o755)
    setup = [line.strip() for line in _branch(command).splitlines()
             if line.strip().startswith(("ensure_servers", "ensure_venv"))]
    script = (f'set -eu\nVENV={venv}\nPY=false\n{_function("ensure_servers")}'
              f'{_function("ensure_venv")}\n' + "\n".join(setup) + "\n")
    # No promtool on this PATH: the stubs only (PostgreSQL and RabbitMQ are found by path).
    subprocess.run(["/bin/bash", "-c", script], cwd=ROOT, check=True, timeout=30,
                   env={"PATH": str(stubs), "HOME": os.environ.get("HOME", "/")})
    return log.read_text().splitlines() if log.exists() else []


def test_the_demo_installs_no_prometheus_and_no_test_dependencies(tmp_path: Path) -> None:
    calls = run_setup(tmp_path, "demo")
    assert not [c for c in calls if "prometheus" in c]
    installs = [c for c in calls if "pip install -q -e" in c]
    assert installs == ["pip -m pip install -q -e .[binary]"]


def test_the_test_suite_gets_promtool_and_its_dependencies(tmp_path: Path) -> None:
    calls = run_setup(tmp_path, "test")
    assert any(c.startswith("apt-get install") and "prometheus" in c for c in calls), calls
    assert "pip -m pip install -q -e .[binary] --group test --group bench" in calls
    # pip installs dependency groups from 25.1 on: the upgrade comes first.
    assert calls.index("pip -m pip install -q --upgrade pip") < calls.index(
        "pip -m pip install -q -e .[binary] --group test --group bench")


@pytest.mark.parametrize(("command", "groups"), [
    ("chaos", ""), ("bench", " --group bench"), ("docs", " --group test"),
    ("lint", " --group test --group bench")])
def test_other_commands_install_their_own_groups(tmp_path: Path, command: str, groups: str) -> None:
    calls = run_setup(tmp_path, command)
    assert f"pip -m pip install -q -e .[binary]{groups}" in calls
    assert not [c for c in calls if "prometheus" in c]


def run_ci(tmp_path: Path, failing_call: int) -> tuple[int, list[str]]:
    """.ci/run with a stub ./dev that records each call (with OUTBOX_TEST_PG) and exits 5
    ("no tests ran") at call number ``failing_call`` (0: never)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    log = tmp_path / "calls"
    (tmp_path / "dev").write_text(
        f'#!/bin/sh\necho "${{OUTBOX_TEST_PG:-default}} $*" >> {log}\n'
        f'[ "$(wc -l < {log})" -eq {failing_call} ] && exit 5\nexit 0\n')
    (tmp_path / "dev").chmod(0o755)
    done = subprocess.run(["/bin/bash", str(tmp_path / ".ci" / "run")], timeout=30, check=False,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    return done.returncode, log.read_text().splitlines() if log.exists() else []


def test_ci_runs_the_suite_on_the_default_postgresql_then_the_core_on_18(tmp_path: Path) -> None:
    assert run_ci(tmp_path, 0) == (0, ["default test", "18 test -m core"])


@pytest.mark.parametrize("failing_call", [1, 2])
def test_ci_fails_when_a_run_runs_no_test(tmp_path: Path, failing_call: int) -> None:
    returncode, calls = run_ci(tmp_path, failing_call)
    assert returncode == 5
    assert len(calls) == failing_call  # nothing after the failure
