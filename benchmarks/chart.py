"""PNG charts of a benchmark run's JSON (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def draw_run(results: dict[str, Any], path: Path) -> None:
    """Throughput by relay count against the ceiling, latency percentiles, and both sweeps."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (thr, lat), (batch, window) = axes
    ceiling = results["ceiling"]["median"]

    counts = ("1", "2", "4")
    bare = [ceiling, *(results["ceiling"]["publishers"][n]["median"] for n in counts[1:])]
    relays = [results["relay"][n]["median"] for n in counts]
    plain = results["plain_commit"]["median"]
    width = 0.38
    groups = [thr.bar([i - width / 2 for i in range(3)], bare, width, color="#999",
                      label="bare pika publishers (ceiling: 1)"),
              thr.bar([i + width / 2 for i in range(3)], relays, width, color="#1f77b4",
                      label="relay processes (2PC)"),
              thr.bar([3 + width / 2], [plain], width, color="#ff7f0e",
                      label="relay, plain COMMIT")]
    for group in groups:
        for bar in group:
            value = bar.get_height()
            thr.annotate(f"{value:,.0f}\n{value / ceiling:.2f}x",
                         (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                         fontsize=7)
    thr.axhline(ceiling, color="#777", linestyle="--", linewidth=1)
    thr.set_xticks(range(4), ["x1", "x2", "x4", "x1"])
    thr.set_xlabel("processes")
    thr.set_ylabel("events/s (median of rounds)")
    queues = results["settings"].get("sink_queues", 1)
    thr.set_title(f"Throughput, {results['settings']['events']:,} events, "
                  f"batch {results['settings']['batch_size']}, "
                  f"{queues} sink queue{'s' if queues > 1 else ''}")
    thr.set_ylim(0, max(*bare, *relays, plain) * 1.55)  # room for the legend above the bars
    thr.legend(fontsize=7, loc="upper right")

    runs = results["latency"]
    width = 0.25
    for i, key in enumerate(("p50_ms", "p99_ms", "max_ms")):
        xs = [j + (i - 1) * width for j in range(len(runs))]
        lat.bar(xs, [r[key] for r in runs], width, label=key.removesuffix("_ms"))
    lat.set_xticks(range(len(runs)), [f"{r['offered_events_per_s']:,} ev/s" for r in runs])
    lat.set_ylabel("ms, producer COMMIT to consumer")
    lat.set_title("Latency at steady offered load (1 relay, defaults)")
    lat.legend()

    for count, sweep in results["batch_sweep"].items():
        sizes = sorted(sweep, key=int)
        batch.plot([int(s) for s in sizes], [sweep[s] for s in sizes], marker="o",
                   label=f"relay x{count}")
    batch.axhline(ceiling, color="#777", linestyle="--", linewidth=1, label="ceiling")
    batch.set_xscale("log")
    batch.set_xticks([int(s) for s in sizes], sizes)
    batch.minorticks_off()
    batch.set_xlabel("batch size (OUTBOX_BATCH_SIZE)")
    batch.set_ylabel("events/s")
    batch.set_title("Batch size sweep")
    batch.legend()

    sweep = results["ceiling"]["window_sweep"]
    windows = sorted(sweep, key=int)
    window.plot([int(w) for w in windows], [sweep[w] for w in windows], marker="o",
                color="#777")
    window.set_xscale("log")
    window.set_xticks([int(w) for w in windows], windows)
    window.minorticks_off()
    window.set_xlabel("messages in flight (unconfirmed)")
    window.set_ylabel("messages/s")
    window.set_title("Ceiling: bare publisher, in-flight window sweep")

    fig.suptitle(f"outbox-relay benchmark: {results['machine']['summary']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def draw_soak(results: dict[str, Any], path: Path) -> None:
    """Resident memory of the relay and the resolver over the soak, and p99 latency by minute."""
    plt = _pyplot()
    fig, (mem, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    samples = results["samples"]
    minutes = [s["t"] / 60 for s in samples]
    mem.plot(minutes, [s["relay_rss_mb"] for s in samples], label="relay")
    mem.plot(minutes, [s["resolver_rss_mb"] for s in samples], label="resolver")
    mem.set_ylim(0, max(120.0, max(s["relay_rss_mb"] for s in samples) * 1.2))
    mem.axhline(100, color="#c33", linestyle="--", linewidth=1, label="target 100 MB")
    mem.set_xlabel("minutes")
    mem.set_ylabel("RSS, MB")
    mem.set_title(f"Memory at {results['offered_events_per_s']:,} events/s")
    mem.legend()
    by_minute = results["latency_by_minute"]
    lat.plot([m["minute"] for m in by_minute], [m["p50_ms"] for m in by_minute], marker=".",
             label="p50")
    lat.plot([m["minute"] for m in by_minute], [m["p99_ms"] for m in by_minute], marker=".",
             label="p99")
    lat.set_xlabel("minute")
    lat.set_ylabel("ms")
    lat.set_title("Latency by minute")
    lat.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
