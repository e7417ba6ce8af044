"""Per-key order's cost: relay x1 and x4 on events with N distinct ordering keys, against the
same relays on events without a key, and on events without a key that carry two headers as
large as those a keyed message gets (x-ordering-key, x-outbox-id; under stand-in names,
benchmarks.workload.KEY_HEADER_STAND_INS): the headers' cost and the order's apart.
Each also as a ratio to the ceiling of its round.

Both as the relay's loop in benchmark processes on a pre-filled outbox (throughput.py) and as
the real ``outbox-relay run`` programs at default settings, timed from the COMMIT of a burst of
the same events in one transaction until the sink holds them (cli_relays.py): the programs are
what a user runs, and they differ where it matters here, since after a claim that finds nothing
the benchmark's loop polls again in 5 ms and the program waits longer each time (from
OUTBOX_POLL_MIN_INTERVAL up to OUTBOX_POLL_MAX_INTERVAL).

Each key's rows wait for its batch in flight (sql/queries.sql), so with few keys a batch holds
every key and the next batch, of the same relay or another, finds nothing to claim until it
commits: the relays take turns instead of overlapping. With many keys a batch holds a few rows
of each and the rest flows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from benchmarks import ceiling, cli_relays, throughput
from benchmarks.workload import Servers, say

RELAYS = (1, 4)
# Rows without a key that carry stand-ins of the two headers the relay adds to a keyed row's
# message: keyed rows against these measure the order alone, these against keyless rows the
# headers alone.
HEADERS = "headers"
TARGET_KEYS = 10_000  # with this many keys, the rate must stay >= TARGET_RATIO of keyless
TARGET_RATIO = 0.9


def _median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


class Run(Protocol):
    """A run of the loop (throughput.RelayRun) or of the programs (cli_relays.ProgramsRun)."""

    @property
    def rate(self) -> float: ...

    # CPU seconds by component (the servers', the relays'): what a label costs where, on a
    # machine whose two cores all of them share.
    @property
    def cpu_seconds(self) -> dict[str, float]: ...


# A label's runs by relay count: "none", HEADERS, then each key count.
Runs = dict[str, dict[int, list[Run]]]


def run(servers: Servers, logdir: Path, *, key_counts: list[int], events: int, batch_size: int,
        rounds: int, window: int, drained: bool = False,
        shuffled: bool = False) -> dict[str, Any]:
    """``drained``: the sink is purged as it fills (workload.SinkDepth) for the ceiling and the
    programs, the shape a sink with consumers that keep up has; the loop's is not.
    ``shuffled``: keys by a hash of the event's number (workload.Servers.shuffled_keys)."""
    labels = ["none", HEADERS, *map(str, key_counts)]
    loop: Runs = {label: {n: [] for n in RELAYS} for label in labels}
    programs: Runs = {label: {n: [] for n in RELAYS} for label in labels}
    ceilings: list[float] = []
    for r in range(rounds):
        # Every other round runs the labels in reverse: a machine that slows down (or speeds
        # up) over a round then does not always favour the same label.
        order = labels if r % 2 == 0 else labels[::-1]
        say(f"keys round {r + 1}/{rounds}: ceiling, then relay x1 x4 (loop, then programs) "
            f"for {', '.join(_shown(label) for label in order)}")
        ceilings.append(ceiling.publish_rate(
            dataclasses.replace(servers, drained_sink=drained), events, window).rate)
        for label in order:
            keyed = dataclasses.replace(servers, keys=int(label) if label.isdigit() else 0,
                                        key_headers=label == HEADERS, shuffled_keys=shuffled)
            for n in RELAYS:
                loop[label][n].append(throughput.relay_run(
                    keyed, events, n, batch_size=batch_size, tag=f"k{label}r{r}x{n}"))
                programs[label][n].append(cli_relays.run(
                    dataclasses.replace(keyed, drained_sink=drained), logdir, n, events,
                    f"k{label}r{r}"))
    top = _median(ceilings)
    return {"ceiling": round(top), "ceiling_rounds": [round(x) for x in ceilings],
            "events": events, "batch_size": batch_size, "drained_sink": drained,
            "shuffled_keys": shuffled,
            "series": _series(loop, top), "programs": _series(programs, top)}


def _shown(label: str) -> str:
    return ("no key" if label == "none" else "no key, key headers" if label == HEADERS
            else f"{int(label):,} keys")


def _series(runs: Runs, top: float) -> dict[str, Any]:
    """Each label's median rate per relay count, as ratios to the ceiling, to the keyless rate
    and (keyed labels) to the rate of keyless rows carrying the same headers; and the median
    CPU seconds of a run by component (the programs': from the COMMIT until the sink holds
    every event, the seconds their rate times); keyed labels also each round's own ratio to
    the keyless run of that round."""
    def rate(label: str, n: int) -> float:
        return _median([run.rate for run in runs[label][n]])

    series: dict[str, dict[str, dict[str, Any]]] = {}
    for label, by_relays in runs.items():
        series[label] = {}
        for n, these in by_relays.items():
            parts = these[0].cpu_seconds if these else {}
            entry: dict[str, Any] = {
                "rate": round(rate(label, n)),
                "ratio_to_ceiling": round(rate(label, n) / top, 3),
                "rounds": [round(run.rate) for run in these],
                "cpu_s": {part: round(_median([run.cpu_seconds[part] for run in these]), 2)
                          for part in parts}}
            if label != "none":
                entry["ratio_to_keyless"] = round(rate(label, n) / rate("none", n), 3)
                # Each round's own ratio: how far one round's figure can be trusted.
                entry["round_ratios"] = [
                    round(run.rate / keyless.rate, 3)
                    for run, keyless in zip(these, runs["none"][n], strict=True)]
            if label.isdigit():  # what the order costs beyond its headers
                entry["ratio_to_headers"] = round(rate(label, n) / rate(HEADERS, n), 3)
            series[label][str(n)] = entry
    return series


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The target on the real programs (what a user gets), and the loop's figure beside it."""
    checked = []
    for source, what in (("programs", "outbox-relay run"), ("series", "benchmark loop")):
        series = results.get(source, {}).get(str(TARGET_KEYS))
        for n, entry in (series or {}).items():
            checked.append({
                "target": f"relay x{n} ({what}) with {TARGET_KEYS:,} keys / without keys "
                          f">= {TARGET_RATIO}",
                "measured": entry["ratio_to_keyless"],
                "met": entry["ratio_to_keyless"] >= TARGET_RATIO})
    return checked
