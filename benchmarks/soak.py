"""The soak: one relay (and a resolver) at a steady load for minutes, its memory sampled.

A relay runs for months as a sidecar: its resident memory must stay flat. The relay and the
resolver are the real programs with default settings; their RSS is read from /proc every few
seconds, latency is summarised minute by minute, and at the end every event must have arrived
exactly once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks import processes
from benchmarks.latency import percentile
from benchmarks.steady import Consumer, Producer
from benchmarks.workload import Servers, reset

WARMUP = 60.0  # memory after the first minute is the baseline growth is measured from


def slope_mb_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per hour."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (m - mean_m) for t, m in samples) / var * 3600


def run(servers: Servers, seconds: float, rate: int, logdir: Path,
        sample_every: float = 5.0) -> dict[str, Any]:
    reset(servers)
    consumer = Consumer(servers, "soak")
    resolver = processes.resolver(servers, logdir, "soak-resolver")
    relay = processes.relay(servers, logdir, "soak-relay")
    samples: list[tuple[float, float, float]] = []
    try:
        relay.log_field("relay_started", "instance")
        resolver.log_field("resolver_started", "action")
        producer = Producer(servers, "soak", rate, seconds)
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            samples.append((round(elapsed, 1), round(relay.rss_mb(), 2),
                            round(resolver.rss_mb(), 2)))
            time.sleep(sample_every)
        produced = producer.result()
        received = consumer.wait_for(range(produced.count), timeout=120)
        relay_peak, resolver_peak = relay.peak_rss_mb(), resolver.peak_rss_mb()
        samples.append((round(time.monotonic() - started, 1), round(relay.rss_mb(), 2),
                        round(resolver.rss_mb(), 2)))
    finally:
        relay.stop()
        resolver.stop()
        final = consumer.stop()
    final.check_exactly_once(produced.count, servers.db_url, "soak")
    after_warmup = [(t, m) for t, m, _r in samples if t >= min(WARMUP, seconds / 2)]
    baseline = after_warmup[0][1]
    return {
        "seconds": seconds, "offered_events_per_s": rate, "events": produced.count,
        "exactly_once": True,
        "relay_rss_mb": {"baseline": baseline, "end": samples[-1][1],
                         "peak": round(relay_peak, 1),
                         "growth_after_warmup": round(samples[-1][1] - baseline, 2),
                         "slope_mb_per_hour": round(slope_mb_per_hour(after_warmup), 2)},
        "resolver_rss_mb": {"end": samples[-1][2], "peak": round(resolver_peak, 1)},
        "latency_by_minute": _latency_by_minute(produced.commit_at, received.arrived_at),
        "samples": [{"t": t, "relay_rss_mb": m, "resolver_rss_mb": r} for t, m, r in samples],
    }


def _latency_by_minute(commit_at: Any, arrived_at: Any) -> list[dict[str, float]]:
    if not commit_at:
        return []
    start = commit_at[0]
    minutes: dict[int, list[float]] = {}
    for seq, committed in enumerate(commit_at):
        minutes.setdefault(int((committed - start) // 60), []).append(
            (arrived_at[seq] - committed) * 1000)
    out = []
    for minute, values in sorted(minutes.items()):
        values.sort()
        out.append({"minute": minute, "events": len(values),
                    "p50_ms": round(percentile(values, 0.5), 2),
                    "p99_ms": round(percentile(values, 0.99), 2),
                    "max_ms": round(values[-1], 2)})
    return out
