"""The instruction counter (benchmarks/studies/instructions.py) runs end to end in a small size, so it
cannot rot: to_message in Python processes under callgrind, the claim on a PostgreSQL started
under callgrind (devenv.servers' wrapper). Three of the row shapes: each shape's build is two
Python processes under callgrind, most of the run's minutes (the others differ only in the row
built)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_instructions_smoke(tmp_path: Path) -> None:
    out = tmp_path / "instructions.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.instructions", "--rows", "400", "--batch", "200",
         "--keys", "100", "--shuffled-keys", "--shapes", "none,keys,ids", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counted = json.loads(out.read_text())
    assert set(counted["build"]) == {"none", "keys", "ids"}
    assert set(counted["claim"]) == {"none", "keys"} and counted["shuffled_keys"] is True
    # Counts, not timings: a keyed row is more work than a keyless one, in both places.
    assert 0 < counted["build"]["none"] < counted["build"]["keys"]
    assert counted["build"]["none"] < counted["build"]["ids"]  # two properties more
    assert 0 < counted["claim"]["none"] < counted["claim"]["keys"]
