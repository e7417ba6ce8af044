"""Relay x1 / x2 / x4 as a user runs them: real ``outbox-relay run`` processes (issue 9).

The in-process rounds (throughput.py) time the relay's own loop from a pre-filled outbox. Here
the real program runs with default settings: the relays are started, connected and idle
(polling an empty outbox), then ``events`` rows arrive in one transaction, and the clock runs
from its COMMIT until the sink queue holds them all (the burst shape of bursts.py, once, on a
freshly truncated and analyzed table).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import processes
from benchmarks.workload import Servers, SinkDepth, burst, reset


@dataclass(frozen=True)
class ProgramsRun:
    rate: float  # events a second, from the COMMIT until the sink holds them all
    # CPU seconds over those same seconds: PostgreSQL's, RabbitMQ's and the relays' own.
    cpu_seconds: dict[str, float]


def run(servers: Servers, logdir: Path, relays: int, events: int, tag: str) -> ProgramsRun:
    reset(servers)
    programs = [processes.relay(servers, logdir, f"cli-{tag}-x{relays}-{i}")
                for i in range(relays)]
    meter = servers.cpu_meter(relay=lambda: [program.pid for program in programs])
    depth = SinkDepth(servers)
    try:
        for program in programs:
            program.log_field("relay_started", "instance")
        time.sleep(0.5)  # connected and polling
        seconds = burst(servers, depth, f"cli{tag}x{relays}", events, meter=meter)
    finally:
        depth.close()
        for program in programs:
            program.stop()
    return ProgramsRun(events / seconds, meter.seconds)


def rate(servers: Servers, logdir: Path, relays: int, events: int, tag: str) -> float:
    return run(servers, logdir, relays, events, tag).rate
