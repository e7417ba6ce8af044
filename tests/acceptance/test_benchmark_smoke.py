"""The benchmark command runs end to end (a few seconds), so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--events", "2000", "--batch-size", "200",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    for key in ("ceiling_msgs_per_s", "relay_1_events_per_s", "relay_2_events_per_s",
                "relay_4_events_per_s", "plain_commit_1_events_per_s"):
        assert figures[key] > 0, figures
    assert set(figures["ratios"]) == {"relay_1_vs_ceiling", "relay_4_vs_ceiling",
                                      "2pc_vs_plain_commit"}
