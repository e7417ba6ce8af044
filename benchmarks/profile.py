"""Where a relay's time goes: py-spy samples the relay process of a throughput run.

``--profile`` runs relay x1 once more under ``py-spy record --idle`` (idle samples included:
waiting for the broker is the point) and reports, for each step of the protocol, the share of
the relay loop's samples spent in it. py-spy comes with the ``bench`` extra.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

ANCHOR = "Relay.run_batch"
PHASES = (  # label, function as py-spy names it, unless inside this one
    ("1 claim (when none was made ahead)", "OutboxStore.claim", "Relay._claim_ahead"),
    ("  build messages", "Relay._build", None),
    ("2 PREPARE TRANSACTION", "OutboxStore.prepare", None),
    ("3 write the batch", "AmqpPublisher._publish_all", None),
    ("  claim the next batch meanwhile", "Relay._claim_ahead", None),
    ("3 wait for the confirms", "AmqpPublisher._wait_for_confirms", None),
    ("4 ledger record and its confirm", "AmqpPublisher.record_batch", None),
    ("5 COMMIT PREPARED", "OutboxStore.finish", None),
)


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise RuntimeError("py-spy not found: install the bench extra (pip install -e '.[bench]')")
    return found


class Profiler:
    """py-spy recording the processes it is started on, until stopped."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, pids: list[int]) -> None:
        for pid in pids:
            self._procs.append(subprocess.Popen(
                [py_spy(), "record", "--pid", str(pid), "--idle", "--nonblocking", "--rate", "250",
                 "--format", "raw", "--output", f"{self.output}.{pid}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def stop(self) -> str:
        """Stop recording; the collapsed stacks of every process, concatenated."""
        for proc in self._procs:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        text = "".join(path.read_text() for path in sorted(self.output.parent.glob(
            f"{self.output.name}.*")))
        self._procs.clear()
        return text


def phases(collapsed: str) -> dict[str, float]:
    """Share (%) of the relay loop's samples in each phase, from py-spy's raw output."""
    total = 0
    inside: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or ANCHOR not in stack:
            continue
        samples = int(count)
        total += samples
        for label, function, unless in PHASES:
            if f"{function} (" in stack and not (unless and f"{unless} (" in stack):
                inside[label] += samples
    # No sample at all is possible in a run shorter than py-spy's attach (a smoke run): the
    # shares are then 0, and the printed table says how many samples they rest on.
    shares = {label: round(100 * inside[label] / max(total, 1), 1) for label, _f, _u in PHASES}
    return {**shares, "samples": total}
