"""The chaos run in short form: every kind of fault in turn under load, hostile rows mixed into
the traffic, the hostile neighbours' poisoned ledger records and foreign prepared transactions
beside it, then the checker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.core  # run on every tested PostgreSQL (CONTRIBUTING.md)


def test_chaos_run_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, "-m", "devenv.chaos", "--duration", "45", "--fault-gap", "1.5", "3",
         "--cycle", "--rate", "300", "--seed", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = json.loads(out.read_text())
    # Each kind of fault happened at least once, and the checker found nothing wrong.
    for kind in ("relay_kills", "postgres_restarts", "rabbitmq_restarts", "connection_cuts",
                 "black_holes"):
        assert figures[kind] >= 1, figures
    assert figures["events"] > 5000, figures
    assert figures["lost"] == 0 and figures["unexpected"] == 0, figures
    assert figures["left_in_outbox"] == 0 and figures["in_doubt_left"] == 0, figures
    assert figures["delivered"] == figures["events"] + figures["duplicated"], figures
    # Per-key order: every event's first delivery after its key's older events' (4 relays).
    assert figures["relays"] == 4 and figures["order_violations"] == 0, figures
    # Hostile rows were mixed in; each ended in the dead-letter table, none was published, and
    # no relay or resolver exited because of one.
    assert figures["hostile_rows"] >= 10, figures
    assert figures["hostile_dead_lettered"] == figures["hostile_rows"], figures
    assert figures["unexpected_exits"] == 0, figures
    assert_neighbours_held_off(figures)


def assert_neighbours_held_off(figures: dict[str, Any]) -> None:
    """Each attack of the hostile mix happened (the runs begin with each: a forged order header
    among the first hostile rows, a poisoned takeover and a foreign transaction of each reason
    at once, retried until one counts), and did nothing: the resolver rejected every poisoned
    record of a takeover and committed none of their batches (the run's verdict), and left
    every foreign transaction prepared (rolled back by the run itself), saying so in its log."""
    assert figures["forged_order_header_rows"] >= 1, figures
    assert figures["poisoned_takeovers"] >= 1, figures
    assert figures["poisoned_ledger_records"] >= 20 * figures["poisoned_takeovers"], figures
    assert figures["ledger_records_rejected"] >= 20 * figures["poisoned_takeovers"], figures
    by_reason = figures["foreign_prepared_by_reason"]
    assert by_reason.get("gid", 0) >= 1 and by_reason.get("owner", 0) >= 1, figures
    assert figures["foreign_left_prepared"] == figures["foreign_prepared"], figures
    assert figures["foreign_reported"] == figures["foreign_prepared"], figures
