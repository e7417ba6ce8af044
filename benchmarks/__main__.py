"""The benchmark: ``./dev bench`` (the same as ``python -m benchmarks``).

In one run, on a PostgreSQL and a RabbitMQ of its own, it measures:

- ceiling: a bare pika publisher (same messages, persistent, mandatory, confirms), with the
  best in-flight window of a sweep: the rate one Python process gets into this broker at all;
- relay: events/s from a pre-filled outbox with 1, 2 and 4 relay processes, in rounds
  interleaved with the ceiling (medians; the machine is shared, only ratios mean anything);
- 2PC cost: the same loop with a plain COMMIT (a benchmark-only store, never an option);
- batch size sweep (relay x1 and x4) and the ceiling's in-flight window sweep;
- latency, producer COMMIT to consumer, at steady offered loads (the real relay program,
  default settings, polling: no NOTIFY);
- relay x1/x2/x4 as real ``outbox-relay`` processes (default settings): a burst of events
  inserted in one transaction, from its COMMIT until the sink holds them;
- recovery: SIGKILL of a relay at each crash point to its batch finished and delivered
  (defaults; ``--recovery`` runs only this, ``--recovery-points`` picks the points);
- peak RSS of every relay process; ``--soak SECONDS`` instead runs the memory soak.

The long scenarios run only when asked for, alone or together (their own JSON):
``--bursts`` (about 25 minutes), ``--outage`` (about 8), ``--bloat`` (about 12; ``--snapshot
MINUTES`` holds its snapshot that long), ``--recovery`` (about 3: only the recovery trials, 5
with ``--recovery-trials 5``); with
``--smoke`` each takes seconds.

Every relay, latency and recovery run is checked: every event delivered exactly once (a
recovery trial may copy the killed relay's batch, and only where the broker may hold it).
Writes JSON (``--out``) and a PNG chart (``--chart``, needs matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks import (
    bloat,
    bursts,
    ceiling,
    cli_relays,
    keys,
    latency,
    outage,
    profile,
    recovery,
    report,
    soak,
    statements,
    throughput,
)
from benchmarks.workload import Servers, code_version, declare_sink, say
from devenv.servers import PostgresServer, RabbitServer, ServerError, pg_bindir, pg_version
from outbox_relay.relay.faults import CRASH_POINTS
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.schema import migrate

DEFAULT_BATCH = RelaySettings(database_url="postgresql://", amqp_url="amqp://").batch_size


def _points(text: str) -> list[str]:
    points = [part for part in text.split(",") if part]
    unknown = [p for p in points if p not in CRASH_POINTS]
    if unknown or not points:
        raise argparse.ArgumentTypeError(f"crash points are {', '.join(CRASH_POINTS)}")
    return points


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--events", type=int, default=50_000, help="pre-filled events per throughput run")
    add("--rounds", type=int, default=3, help="rounds of ceiling, relay x1/x2/x4, plain")
    add("--batch-size", type=int, default=DEFAULT_BATCH,
        help="relay batch size of the rounds (default: the relay's default)")
    add("--windows", type=_ints, default=[100, 500, 1000, 2000, 5000],
        help="ceiling in-flight windows to sweep")
    add("--batch-sizes", type=_ints, default=[100, 250, 500, 1000, 2000, 4000],
        help="relay batch sizes to sweep")
    add("--sweep-events", type=int, default=20_000, help="events per sweep point")
    add("--latency-rates", type=_ints, default=[500, 2000], help="offered loads, events/s")
    add("--latency-seconds", type=float, default=20.0, help="measured seconds per load")
    add("--latency-warmup", type=float, default=3.0, help="seconds relayed but not counted")
    add("--recovery-trials", type=int, default=3, help="kills at each recovery crash point")
    add("--recovery-points", type=_points, default=None,
        help="crash points of the recovery trials (default: all: " + ",".join(CRASH_POINTS) + ")")
    add("--recovery-rate", type=int, default=recovery.RATE,
        help="events/s offered during the recovery trials")
    add("--recovery", action="store_true",
        help="run only the recovery trials (recovery.py): p50 and max by crash point")
    add("--profile", action="store_true",
        help="also run relay x1 under py-spy and report where its time goes")
    add("--soak", type=float, metavar="SECONDS",
        help="run only the memory soak for SECONDS (e.g. 600)")
    add("--soak-rate", type=int, default=2000, help="offered load of the soak, events/s")
    add("--bursts", action="store_true",
        help="run the bursts scenario (bursts.py) instead of the benchmark")
    add("--burst-relays", type=_ints, default=[1, 4], help="relay counts, one series each")
    add("--burst-count", type=int, default=10, help="bursts per series")
    add("--burst-events", type=int, default=50_000, help="events per burst (one transaction)")
    add("--burst-idle", type=float, default=70.0,
        help="seconds the empty outbox stays idle before each burst (autovacuum naptime: 60)")
    add("--outage", action="store_true",
        help="run the broker outage scenario (outage.py) instead of the benchmark")
    add("--outage-seconds", type=float, default=300.0, help="how long RabbitMQ is stopped")
    add("--bloat", action="store_true",
        help="run the snapshot-held-open scenario (bloat.py) instead of the benchmark")
    add("--bloat-seconds", type=float, default=600.0, help="how long the snapshot is held")
    add("--snapshot", type=float, metavar="MINUTES",
        help="run the snapshot-held-open scenario with the snapshot held MINUTES (--bloat "
        "--bloat-seconds 60*MINUTES): p50/p99 by minute, the table's size before, at the "
        "snapshot's end, once the resolver has compacted it after the release, and at the end")
    add("--delayed-row", action="store_true",
        help="with --bloat/--snapshot: before the snapshot, a producer inserts one event due "
        "in a day (a scheduled reminder, no ordering key), left in the outbox for the whole "
        "run and deleted at its end")
    add("--blocked-key", action="store_true",
        help="with --bloat/--snapshot: before the snapshot, a producer inserts two events of "
        "one ordering key, the first one the relay dead-letters (its routing key is too long), "
        "the second held behind it for the whole run; both deleted at its end")
    add("--delayed-key", dest="delayed_keys", action="store_const", const=1, default=0,
        help="with --bloat/--snapshot: before the snapshot, a producer inserts two events of "
        "one ordering key, the first due in a day, the second due at once and held behind it "
        "for the whole run; both deleted at its end (--delayed-keys 1)")
    add("--delayed-keys", type=int, metavar="N",
        help="with --bloat/--snapshot: the same for N ordering keys (a reminder per customer; "
        "past 100 the relay holds no more of them)")
    add("--statements", action="store_true",
        help="with --bloat/--snapshot: PostgreSQL loads pg_stat_statements, and the run reports "
        "the costliest statements of every bucket (calls, ms, buffers); a diagnosis: the "
        "extension's own cost is in its latencies")
    add("--scenario-rate", type=int, default=500,
        help="offered load of --outage and --bloat, events/s")
    add("--keys", type=_ints, default=[], metavar="N,N",
        help="run the per-key order scenario (keys.py) instead of the benchmark: relay x1 and "
        "x4 (the benchmark's loop and the real programs) on events with each number of "
        "distinct ordering keys, against events without one (e.g. 10000,50)")
    add("--drained-sink", action="store_true",
        help="with --keys: the sink of the ceiling and of the real programs is purged as it "
        "fills (a queue its consumers keep near empty); the programs' messages are counted, "
        "not checked one by one")
    add("--shuffled-keys", action="store_true",
        help="with --keys: event n's key is hash(n) mod N, a key's events at random distances "
        "as an aggregate's are, instead of n mod N (exactly N ids apart: a batch then never "
        "shares a key with the next N ids)")
    add("--sink-queues", type=int, default=1,
        help="spread the events over this many queues by routing key (default: one queue)")
    add("--sink-type", choices=("classic", "quorum"), default="classic",
        help="the sink queues' type (default: classic, one node's queue; quorum: replicated, "
        "RabbitMQ's choice for data that must not be lost)")
    add("--smoke", action="store_true", help="tiny sizes everywhere: seconds, for CI")
    add("--redraw", type=Path, metavar="JSON", help="only draw the chart of an earlier run")
    add("--out", type=Path, help="JSON results (default: results/bench.json or soak.json)")
    add("--chart", type=Path, help="PNG chart (default: next to --out); 'none' for no chart")
    args = parser.parse_args(argv)
    if args.delayed_keys < 0:
        parser.error("--delayed-keys: N must be 0 or more")
    if args.statements and not (args.bloat or args.snapshot is not None):
        parser.error("--statements: only with --bloat or --snapshot")
    if args.snapshot is not None:
        args.bloat, args.bloat_seconds = True, args.snapshot * 60
    if args.smoke:
        args.events, args.rounds, args.sweep_events = 2000, 1, 1000
        args.windows, args.batch_sizes = [100, 1000], [100, 500]
        args.latency_rates, args.latency_seconds, args.latency_warmup = [500, 2000], 1.5, 0.5
        args.recovery_trials = 1
        args.burst_count, args.burst_events, args.burst_idle = 1, 2000, 1.0
        args.outage_seconds = 4.0
        args.bloat_seconds = 6.0 if args.snapshot is None else args.bloat_seconds
    if args.recovery_points is None:  # the smoke run: the demo's point, the likeliest one
        args.recovery_points = ["after_publish"] if args.smoke else list(CRASH_POINTS)
    args.scenarios = [name for name in ("bursts", "bloat", "outage", "keys", "recovery")
                      if getattr(args, name)]
    name = "soak" if args.soak else "-".join(args.scenarios) or "bench"
    default = Path("results") / f"{name}.json"
    args.out = args.out or default
    if args.chart is None:
        args.chart = (args.redraw or args.out).with_suffix(".png")
    elif str(args.chart) == "none":
        args.chart = None
    if args.scenarios:
        args.chart = None  # the scenarios' figures are tables in docs/performance.md
    return args


def machine(load: tuple[float, float, float]) -> dict[str, Any]:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    summary = f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"
    try:  # the PostgreSQL the run's own server runs (OUTBOX_TEST_PG picks it)
        postgresql = str(pg_version(pg_bindir()))
    except ServerError as exc:
        postgresql = f"unknown: {exc}"
    return {"summary": summary, "cores": os.cpu_count(), "cpu": cpu,
            "python": platform.python_version(), "kernel": platform.release(),
            "postgresql": postgresql, "load_average_at_start": [round(x, 2) for x in load]}


def _median_entry(runs: list[Any], python_cpu: str) -> dict[str, Any]:
    """The median round's figures (lower median for an even count), with every round's rate."""
    ordered = sorted(runs, key=lambda r: r.rate)
    mid = ordered[(len(ordered) - 1) // 2]
    entry = {"median": round(mid.rate), "rounds": [round(r.rate) for r in runs],
             "seconds": round(mid.seconds, 3), "cpu_seconds": mid.cpu_seconds}
    if python_cpu == "relay":
        entry["peak_rss_mb"] = max(max(r.peak_rss_mb) for r in runs)
    return entry


def bench(args: argparse.Namespace, servers: Servers, logdir: Path) -> dict[str, Any]:
    say(f"ceiling window sweep {args.windows} ({args.sweep_events:,} messages each)")
    window_sweep = {w: ceiling.publish_rate(servers, args.sweep_events, w).rate
                    for w in args.windows}
    best = max(window_sweep, key=lambda w: window_sweep[w])
    pika_writes = ceiling.publish_rate(servers, args.sweep_events, best, coalesce=False)

    say(f"batch size sweep {args.batch_sizes}, relay x1 and x4")
    batch_sweep = {str(n): {str(size): round(throughput.relay_run(
        servers, args.sweep_events, n, batch_size=size, tag=f"sweep{n}-{size}").rate)
        for size in args.batch_sizes} for n in (1, 4)}

    ceilings: list[ceiling.CeilingRun] = []
    parallel: dict[int, list[ceiling.CeilingRun]] = {2: [], 4: []}
    relays: dict[int, list[throughput.RelayRun]] = {1: [], 2: [], 4: []}
    plains: list[throughput.RelayRun] = []
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}: ceiling x1 x2 x4 (window {best}), relay x1 x2 x4, "
            "plain COMMIT")
        ceilings.append(ceiling.publish_rate(servers, args.events, best))
        for n in parallel:
            parallel[n].append(ceiling.parallel_rate(servers, args.events, best, n))
        for n in relays:
            relays[n].append(throughput.relay_run(servers, args.events, n,
                                                  batch_size=args.batch_size, tag=f"r{r}x{n}"))
        plains.append(throughput.relay_run(servers, args.events, 1, batch_size=args.batch_size,
                                           plain=True, tag=f"r{r}plain"))

    cli: dict[int, list[float]] = {1: [], 2: [], 4: []}
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}: relay x1 x2 x4 as real CLI processes, a burst each")
        for n in cli:
            cli[n].append(cli_relays.rate(servers, logdir, n, args.events, f"r{r}"))

    profiled: dict[str, float] | None = None
    if args.profile:
        say("relay x1 under py-spy")
        recorder = profile.Profiler(logdir / "relay.pyspy")
        throughput.relay_run(servers, args.events, 1, batch_size=args.batch_size, tag="profile",
                             profiler=recorder)
        profiled = profile.phases(recorder.stop())

    latency_runs = []
    for rate in args.latency_rates:
        say(f"latency at {rate:,} events/s for {args.latency_seconds:g} s")
        latency_runs.append(latency.measure(servers, rate, args.latency_seconds,
                                            args.latency_warmup, logdir).as_dict())

    recovered = recovery.run(servers, logdir, points=args.recovery_points,
                             trials=args.recovery_trials,
                             rate=args.recovery_rate, say=say)

    results: dict[str, Any] = {
        "ceiling": {**_median_entry(ceilings, "publisher"), "window": best,
                    "window_sweep": {str(w): round(v) for w, v in window_sweep.items()},
                    "pika_frame_by_frame_at_best_window": round(pika_writes.rate),
                    "publishers": {str(n): _median_entry(runs, "publisher")
                                   for n, runs in parallel.items()}},
        "relay": {str(n): _median_entry(runs, "relay") for n, runs in relays.items()},
        "relay_cli": {str(n): {"median": round(sorted(rates)[(len(rates) - 1) // 2]),
                               "rounds": [round(x) for x in rates]}
                      for n, rates in cli.items()},
        "plain_commit": _median_entry(plains, "relay"),
        "batch_sweep": batch_sweep,
        "latency": latency_runs,
        "recovery": recovered,
        "profile_relay_1_percent": profiled,
        "exactly_once": "checked after every relay and latency run; recovery: copies only of the "
                        "killed relay's batch, at mid_publish and after_publish",
    }
    return results


def scenarios(args: argparse.Namespace, servers: Servers, rabbit: RabbitServer,
              logdir: Path) -> dict[str, Any]:
    """The long scenarios asked for, in an order that leaves the broker running for the next
    one (the outage stops it), with their targets."""
    window = 2000  # the ceiling's best in-flight window on this machine (the default run's sweep)
    rate = args.scenario_rate
    results: dict[str, Any] = {}
    if args.bursts:
        results["bursts"] = bursts.run(
            servers, logdir, counts=args.burst_relays, bursts=args.burst_count,
            idle=args.burst_idle, events=args.burst_events, window=window)
    if args.bloat:
        results["bloat"] = bloat.run(
            servers, logdir, rate=rate, warm=min(30.0, args.bloat_seconds / 2),
            hold=args.bloat_seconds, tail=min(60.0, args.bloat_seconds / 2),
            bucket=60.0 if args.bloat_seconds >= 120 else 2.0, delayed_row=args.delayed_row,
            blocked_key=args.blocked_key, delayed_keys=args.delayed_keys,
            statements=args.statements)
        bloat.print_table(results["bloat"])
    if args.outage:
        results["outage"] = outage.run(
            servers, rabbit, logdir, rate=rate, warm=min(30.0, args.outage_seconds),
            outage=args.outage_seconds, tail=min(60.0, args.outage_seconds * 2),
            events=min(50_000, args.burst_events * 5), window=window)
    if args.keys:
        results["keys"] = keys.run(servers, logdir, key_counts=args.keys, events=args.events,
                                   batch_size=args.batch_size, rounds=args.rounds, window=window,
                                   drained=args.drained_sink, shuffled=args.shuffled_keys)
    if args.recovery:
        results["recovery"] = recovery.run(servers, logdir, points=args.recovery_points,
                                           trials=args.recovery_trials,
                                           rate=args.recovery_rate, say=say)
    results["targets"] = report.check_scenarios(results)
    if args.keys:
        results["targets"] += keys.targets(results["keys"])
    return results


def redraw(json_path: Path, png: Path) -> None:
    """Draw the chart of an earlier run from its JSON (the soak's or the benchmark's)."""
    from benchmarks import chart

    results = json.loads(json_path.read_text())
    (chart.draw_soak if "samples" in results else chart.draw_run)(results, png)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.redraw:
        redraw(args.redraw, args.chart or args.redraw.with_suffix(".png"))
        return 0
    load = os.getloadavg()
    started = time.time()
    with ExitStack() as stack:
        say("starting PostgreSQL and RabbitMQ")
        # fsync on, as in production: PREPARE and COMMIT PREPARED each flush the WAL, and that
        # is part of what the 2PC cost measures.
        conf = {"fsync": "on", **(statements.SERVER_CONF if args.statements else {})}
        pg = stack.enter_context(PostgresServer(max_prepared_transactions=16, extra_conf=conf))
        rabbit = stack.enter_context(RabbitServer())
        migrate(pg.url, "outbox")
        declare_sink(rabbit.url, args.sink_queues, args.sink_type)
        servers = Servers(pg.url, rabbit.url, pg.pids, rabbit.pids, args.sink_queues)
        logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-bench-")))
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "chart")}
        if args.scenarios:
            results = scenarios(args, servers, rabbit, logdir)
        elif args.soak:
            say(f"soak: {args.soak:g} s at {args.soak_rate:,} events/s")
            results = soak.run(servers, args.soak, args.soak_rate, logdir)
        else:
            results = bench(args, servers, logdir)
            results["figures"] = report.figures(results)
            results["targets"] = report.check_targets(results["figures"])
    results = {"command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
               "code": code_version(), "machine": machine(load), "settings": settings,
               "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
               "elapsed_s": round(time.time() - started), **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.scenarios:
        print(json.dumps(report.without_samples(results), indent=2))
        if "recovery" in results:
            print("\n".join(report.recovery_lines(results["recovery"])))
    elif not args.soak:
        print(report.table(results))
    else:
        print(json.dumps({k: v for k, v in results.items() if k not in ("samples", "settings")},
                         indent=2))
    if args.chart is not None:
        from benchmarks import chart

        (chart.draw_soak if args.soak else chart.draw_run)(results, args.chart)
    say(f"wrote {args.out}" + (f" and {args.chart}" if args.chart else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
