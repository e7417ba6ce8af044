"""The run's figures as ratios against the issue's targets, and as the printed table."""

from __future__ import annotations

from typing import Any

TARGETS = (
    # (name, key in results["ratios"] or a derived figure, comparison, bound)
    ("relay x1 / ceiling", "relay_1_vs_ceiling", ">=", 0.8),
    ("relay x4 / ceiling", "relay_4_vs_ceiling", ">=", 1.0),
    ("2PC / plain COMMIT", "2pc_vs_plain_commit", ">=", 0.9),
    ("latency p50 at 2,000 ev/s (ms)", "latency_2000_p50_ms", "<=", 10.0),
    ("latency p99 at 2,000 ev/s (ms)", "latency_2000_p99_ms", "<=", 50.0),
    ("relay x1 (real CLI process) / ceiling", "relay_cli_1_vs_ceiling", ">=", 0.8),
    ("recovery after SIGKILL, worst point's median (s)", "recovery_median_s", "<=", 0.5),
    ("recovery after SIGKILL, worst trial (s)", "recovery_max_s", "<=", 1.0),
    ("peak RSS of a relay process (MB)", "relay_peak_rss_mb", "<", 100.0),
)


def figures(results: dict[str, Any]) -> dict[str, float]:
    """The ratios and single figures the targets are checked against."""
    ceiling = results["ceiling"]["median"]
    relay = results["relay"]
    out = {
        "relay_1_vs_ceiling": relay["1"]["median"] / ceiling,
        "relay_2_vs_ceiling": relay["2"]["median"] / ceiling,
        "relay_4_vs_ceiling": relay["4"]["median"] / ceiling,
        "publishers_4_vs_ceiling": results["ceiling"]["publishers"]["4"]["median"] / ceiling,
        "2pc_vs_plain_commit": relay["1"]["median"] / results["plain_commit"]["median"],
        "relay_peak_rss_mb": max(
            [r["peak_rss_mb"] for r in relay.values()]
            + [run["relay_peak_rss_mb"] for run in results["latency"]]),
    }
    for run in results["latency"]:
        rate = run["offered_events_per_s"]
        out[f"latency_{rate}_p50_ms"] = run["p50_ms"]
        out[f"latency_{rate}_p99_ms"] = run["p99_ms"]
    for n, entry in results.get("relay_cli", {}).items():
        out[f"relay_cli_{n}_vs_ceiling"] = entry["median"] / ceiling
    out.update(recovery_figures(results["recovery"]))
    return {k: round(v, 2) for k, v in out.items()}


def recovery_figures(recovery: dict[str, Any]) -> dict[str, float]:
    """The target is per crash point: the slowest point's median, the slowest trial."""
    medians = [entry["median_s"] for entry in recovery["points"].values()
               if entry["median_s"] is not None]
    if not medians:
        return {}
    return {"recovery_median_s": max(medians), "recovery_max_s": recovery["max_s"]}


def recovery_lines(recovery: dict[str, Any]) -> list[str]:
    lines = []
    for point, entry in recovery["points"].items():
        if not entry["seconds"]:
            lines.append(f"recovery after SIGKILL at {point:14} no trial saw the batch")
            continue
        lines.append(f"recovery after SIGKILL at {point:14} p50 {entry['median_s']:.2f} s, max "
                     f"{entry['max_s']:.2f} s (trials: "
                     f"{', '.join(f'{t:.2f}' for t in entry['seconds'])})")
    return lines


def check_targets(measured: dict[str, float]) -> list[dict[str, Any]]:
    checked = []
    for name, key, op, bound in TARGETS:
        value = measured.get(key)
        met = None if value is None else (value >= bound if op == ">=" else
                                          value <= bound if op == "<=" else value < bound)
        checked.append({"target": f"{name} {op} {bound:g}", "measured": value, "met": met})
    return checked


def _cores(cpu: dict[str, float], seconds: float, key: str) -> str:
    return f"{cpu[key] / seconds:.2f}" if key in cpu and seconds > 0 else "-"


def table(results: dict[str, Any]) -> str:
    ceiling = results["ceiling"]
    lines = [
        f"{'':30}{'events/s':>10}{'x ceiling':>11}   CPU cores: {'Python':>7}{'PostgreSQL':>11}"
        f"{'RabbitMQ':>9}",
    ]

    def row(name: str, entry: dict[str, Any], python_key: str) -> None:
        cpu, seconds = entry["cpu_seconds"], entry["seconds"]
        lines.append(f"{name:30}{entry['median']:>10,.0f}{entry['median'] / ceiling['median']:>11.2f}"
                     f"{'':14}{_cores(cpu, seconds, python_key):>7}"
                     f"{_cores(cpu, seconds, 'postgresql'):>11}{_cores(cpu, seconds, 'rabbitmq'):>9}")

    row(f"ceiling (window {ceiling['window']})", ceiling, "publisher")
    for n, entry in ceiling["publishers"].items():
        row(f"  {n} bare publishers at once", entry, "publisher")
    for n in ("1", "2", "4"):
        row(f"relay x{n}", results["relay"][n], "relay")
    row("relay x1, plain COMMIT", results["plain_commit"], "relay")
    for n, entry in results.get("relay_cli", {}).items():
        lines.append(f"{'relay x' + n + ', real CLI (burst)':30}{entry['median']:>10,.0f}"
                     f"{entry['median'] / ceiling['median']:>11.2f}")
    lines.append("")
    for run in results["latency"]:
        lines.append(f"latency at {run['offered_events_per_s']:,} ev/s offered: p50 "
                     f"{run['p50_ms']} ms, p99 {run['p99_ms']} ms, max {run['max_ms']} ms "
                     f"({run['measured']:,} events)")
    lines.extend(recovery_lines(results["recovery"]))
    for count, sweep in results["batch_sweep"].items():
        lines.append(f"batch size sweep, relay x{count}: " + ", ".join(
            f"{size}: {rate:,.0f}" for size, rate in sweep.items()))
    lines.append("ceiling window sweep: " + ", ".join(
        f"{w}: {rate:,.0f}" for w, rate in ceiling["window_sweep"].items()))
    profiled = results.get("profile_relay_1_percent")
    if profiled:
        lines.append(f"relay x1 under py-spy, share of the loop's {profiled['samples']:,} samples:")
        lines.extend(f"  {label:36}{share:5.1f} %" for label, share in profiled.items()
                     if label != "samples")
    lines.append("")
    for target in results["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[target["met"]]
        lines.append(f"{mark} {target['target']:48} measured {target['measured']}")
    return "\n".join(lines)


# The long scenarios (--bursts, --outage, --bloat): (name, figure, comparison, bound).
SCENARIO_TARGETS = (
    ("bursts x{n}: worst burst / ceiling", "bursts_{n}_min_ratio", ">=", 0.6),
    ("bursts x{n}: median burst / ceiling", "bursts_{n}_median_ratio", ">=", 0.8),
    ("outage: drain rate / ceiling", "outage_drain_ratio", ">=", 0.6),
    ("bloat: worst p99 by bucket (ms)", "bloat_worst_p99_ms", "<", 50.0),
    ("recovery: worst point's median (s)", "recovery_median_s", "<=", 0.5),
    ("recovery: worst trial (s)", "recovery_max_s", "<=", 1.0),
)


def scenario_figures(results: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    bursts = results.get("bursts", {})
    for n, series in bursts.items():
        if isinstance(series, dict) and "ratio" in series:
            out[f"bursts_{n}_min_ratio"] = series["ratio"]["min"]
            out[f"bursts_{n}_median_ratio"] = series["ratio"]["median"]
    if "outage" in results:
        out["outage_drain_ratio"] = results["outage"]["drain_ratio"]
    if "bloat" in results:
        out["bloat_worst_p99_ms"] = results["bloat"]["worst_p99_ms"]
    if "recovery" in results:
        out.update(recovery_figures(results["recovery"]))
    return out


def check_scenarios(results: dict[str, Any]) -> list[dict[str, Any]]:
    measured = scenario_figures(results)
    # The bursts' series are keyed by relay count; other keys (the server's settings) are not.
    counts = [n for n, v in results.get("bursts", {}).items()
              if isinstance(v, dict) and "ratio" in v]
    targets = [(name.format(n=n), key.format(n=n), op, bound)
               for name, key, op, bound in SCENARIO_TARGETS if "{n}" in key for n in counts]
    targets += [t for t in SCENARIO_TARGETS if "{n}" not in t[1]]
    checked = []
    for name, key, op, bound in targets:
        if key.split("_")[0] not in results:
            continue
        value = measured.get(key)
        met = None if value is None else (value >= bound if op == ">=" else
                                          value <= bound if op == "<=" else value < bound)
        checked.append({"target": f"{name} {op} {bound:g}", "measured": value, "met": met})
    return checked


def without_samples(results: dict[str, Any]) -> dict[str, Any]:
    """The results to print: no settings, no raw time series."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("samples", "settings")}
        return value

    return strip(results)  # type: ignore[no-any-return]
