"""Latency from the producer's COMMIT to the consumer's receipt at a steady offered load.

One relay (the real program, default settings) relays what a steady producer commits; the
first ``warmup`` seconds are relayed and checked but not counted. Then every event must have
arrived exactly once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import processes
from benchmarks.steady import Consumer, Producer
from benchmarks.workload import Servers, reset


@dataclass
class LatencyRun:
    rate: int
    events: int
    measured: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    relay_peak_rss_mb: float

    def as_dict(self) -> dict[str, float]:
        return {"offered_events_per_s": self.rate, "events": self.events,
                "measured": self.measured, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "max_ms": self.max_ms, "relay_peak_rss_mb": self.relay_peak_rss_mb}


def percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered) - 1e-9)))
    return ordered[rank - 1]


def latencies_ms(commit_at: list[float], arrived_at: list[float], first: int) -> list[float]:
    """Ascending receipt-minus-commit of every event from sequence ``first`` on."""
    return sorted((arrived_at[s] - commit_at[s]) * 1000 for s in range(first, len(commit_at)))


def measure(servers: Servers, rate: int, seconds: float, warmup: float, logdir: Path,
            **relay_settings: str) -> LatencyRun:
    reset(servers)
    prefix = f"lat{rate}"
    consumer = Consumer(servers, prefix)
    relay = processes.relay(servers, logdir, f"latency-{rate}", **relay_settings)
    try:
        relay.log_field("relay_started", "instance")
        time.sleep(0.5)  # connected and polling
        produced = Producer(servers, prefix, rate, warmup + seconds).result()
        received = consumer.wait_for(range(produced.count), timeout=60)
        peak = relay.peak_rss_mb()
    finally:
        relay.stop()
        final = consumer.stop()
    final.check_exactly_once(produced.count, servers.db_url, f"latency run at {rate}/s")
    first = next((s for s, t in enumerate(produced.commit_at)
                  if t >= produced.commit_at[0] + warmup), produced.count)
    samples = latencies_ms(list(produced.commit_at), list(received.arrived_at), first)
    return LatencyRun(rate, produced.count, len(samples), round(percentile(samples, 0.50), 2),
                      round(percentile(samples, 0.99), 2), round(samples[-1], 2), round(peak, 1))
