"""Crash points: a relay launched by the tests kills itself at a named step only when the
environment asks; the installed relay reads no such setting at all."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from devenv import crash_points, launch
from devenv.crash_points import crash_hook
from outbox_relay.relay import cli
from outbox_relay.relay.faults import CRASH_POINTS, no_fault
from tests.conftest import package_sources

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record os.kill calls instead of dying."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: calls.append((pid, sig)))
    return calls


def test_hook_is_a_no_op_without_the_env_var(kills: list[tuple[int, int]]) -> None:
    hook = crash_hook({})

    for point in CRASH_POINTS:
        hook(point)

    assert kills == []


def test_empty_env_var_disables_the_hook(kills: list[tuple[int, int]]) -> None:
    hook = crash_hook({"OUTBOX_TEST_CRASH_AT": ""})

    hook("after_claim")

    assert kills == []


def test_unknown_crash_point_is_refused() -> None:
    with pytest.raises(ValueError, match="OUTBOX_TEST_CRASH_AT must be one of after_claim, "):
        crash_hook({"OUTBOX_TEST_CRASH_AT": "after_lunch"})


def test_hook_kills_the_process_only_at_its_point(kills: list[tuple[int, int]]) -> None:
    hook = crash_hook({"OUTBOX_TEST_CRASH_AT": "after_ledger"})

    for point in ("after_claim", "after_prepare", "mid_publish", "after_publish"):
        hook(point)
    assert kills == []
    hook("after_ledger")

    assert kills == [(os.getpid(), signal.SIGKILL)]


def test_crash_after_skips_that_many_passes(kills: list[tuple[int, int]]) -> None:
    hook = crash_hook({"OUTBOX_TEST_CRASH_AT": "after_prepare", "OUTBOX_TEST_CRASH_AFTER": "2"})

    hook("after_prepare")
    hook("after_prepare")
    hook("after_commit")
    assert kills == []
    hook("after_prepare")

    assert len(kills) == 1


def test_hook_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch,
                                          kills: list[tuple[int, int]]) -> None:
    monkeypatch.setenv("OUTBOX_TEST_CRASH_AT", "after_commit")
    monkeypatch.delenv("OUTBOX_TEST_CRASH_AFTER", raising=False)

    crash_hook()("after_commit")

    assert len(kills) == 1


def test_every_point_the_code_passes_is_a_known_crash_point() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "relay").glob("*.py"))
    passed = set(re.findall(r"fault\(\"(\w+)\"\)", source))

    assert passed == set(CRASH_POINTS)


def test_stall_sleeps_once_at_the_point_instead_of_dying(
    kills: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr("devenv.crash_points.time.sleep", sleeps.append)
    hook = crash_hook({"OUTBOX_TEST_CRASH_AT": "after_publish", "OUTBOX_TEST_CRASH_AFTER": "1",
                       "OUTBOX_TEST_STALL_SECONDS": "2.5"})

    for _ in range(4):
        hook("after_prepare")
        hook("after_publish")

    assert sleeps == [2.5]
    assert kills == []


def test_the_installed_programs_read_no_crash_point_setting() -> None:
    """A production deployment cannot switch a crash point on: no file of the wheel names the
    variables (devenv/, where the hook lives, is not in it)."""
    for path in package_sources():
        assert "OUTBOX_TEST_" not in path.read_text("utf-8"), path


def test_launch_runs_the_crash_point_relay_only_when_asked() -> None:
    assert launch.command("relay", "migrate")[1:] == ["-m", "outbox_relay.relay", "migrate"]
    assert launch.command("relay", crash_points=True)[1:] == ["-m", "devenv.crash_points"]
    assert launch.command("resolver", crash_points=True)[1:] == ["-m", "outbox_relay.resolver"]
    assert launch.wants_crash_points({"OUTBOX_TEST_CRASH_AT": "after_claim"})
    assert not launch.wants_crash_points({"OUTBOX_TEST_CRASH_AT": "", "OUTBOX_TABLE": "x"})


def test_the_crash_point_relay_runs_the_relays_cli_with_the_hook(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    given: list[object] = []
    monkeypatch.setattr(cli, "main", lambda argv, *, fault: given.append((argv, fault)) or 0)
    monkeypatch.delenv("OUTBOX_TEST_CRASH_AT", raising=False)
    assert crash_points.main(["migrate"]) == 0
    assert given == [(["migrate"], no_fault)]
    monkeypatch.setenv("OUTBOX_TEST_CRASH_AT", "after_commit")
    assert crash_points.main([]) == 0
    assert given[-1][1] is not no_fault  # type: ignore[index]
    monkeypatch.setenv("OUTBOX_TEST_CRASH_AT", "after_lunch")
    assert crash_points.main([]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("outbox-relay: error: OUTBOX_TEST_CRASH_AT must be one of")
