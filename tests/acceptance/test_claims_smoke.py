"""The steady-state claim counter (benchmarks/studies/claims.py) runs end to end in a small size, so it
cannot rot, and counts what it says: with keys held by batches in flight, claims still come back
full (their rows are stepped over, not locked and left: sql/queries.sql)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import ROOT


def study(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """Run ``python -m benchmarks.studies.<name> *args``; the JSON it wrote."""
    out = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.studies.{name}", *args, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written: dict[str, Any] = json.loads(out.read_text())
    return written


def claims(tmp_path: Path, *args: str) -> dict[str, Any]:
    return study(tmp_path, "claims", "--rows", "8000", "--relays", "2", *args)


def test_claims_smoke(tmp_path: Path) -> None:
    keyless = claims(tmp_path, "--keys", "0")
    # Counts, not timings: the same for the same rows on any machine.
    assert keyless["claims"] == 4 and keyless["rows_a_claim_median"] == 2000
    keyed = claims(tmp_path, "--keys", "1000", "--shuffled-keys")
    # 1,000 keys at random distances: most keys of the next rows are held by the other
    # relay's batch in flight. The claim steps over those rows and fills its batch from the
    # rows behind them (it locked them and left them, half empty, before).
    assert keyed["rows_a_claim_median"] == 2000
    assert keyed["claim_cpu_s"] > 0


def test_claims_callgrind_smoke(tmp_path: Path) -> None:
    counted = claims(tmp_path, "--keys", "0", "--rows", "4000", "--callgrind")
    assert counted["claims"] == 2
    # The claim sessions' backends did the claims, and a count of them came back: a drained
    # row costs PostgreSQL tens of thousands of instructions.
    assert 10_000 < counted["claim_instructions_a_row"] < 1_000_000


def test_claim_cost_smoke(tmp_path: Path) -> None:
    """benchmarks/studies/claim_cost.py: small claims timed, and PostgreSQL's work by statement
    where pg_stat_statements is installed."""
    cost = study(tmp_path, "claim_cost", "--claims", "50", "--rows", "5")
    assert cost["claims"] == 50 and cost["claim_commit_us_median"] > 0
    queries = [s["query"] for s in cost["statements"]]
    assert not queries or any("Step 1 of the protocol" in q for q in queries), queries
