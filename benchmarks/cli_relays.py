"""Relay x1 / x2 / x4 as a user runs them: real ``outbox-relay run`` processes (issue 9).

The in-process rounds (throughput.py) time the relay's own loop from a pre-filled outbox. Here
the real program runs with default settings: the relays are started, connected and idle
(polling an empty outbox), then ``events`` rows arrive in one transaction, and the clock runs
from its COMMIT until the sink queue holds them all (the burst shape of bursts.py, once, on a
freshly truncated and analyzed table).
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks import processes
from benchmarks.workload import Servers, SinkDepth, burst, reset


def rate(servers: Servers, logdir: Path, relays: int, events: int, tag: str) -> float:
    reset(servers)
    programs = [processes.relay(servers, logdir, f"cli-{tag}-x{relays}-{i}")
                for i in range(relays)]
    depth = SinkDepth(servers)
    try:
        for program in programs:
            program.log_field("relay_started", "instance")
        time.sleep(0.5)  # connected and polling
        seconds = burst(servers, depth, f"cli{tag}x{relays}", events)
    finally:
        depth.close()
        for program in programs:
            program.stop()
    return events / seconds
