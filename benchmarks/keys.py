"""Per-key order's cost: relay x1 and x4 on events with N distinct ordering keys, against the
same relays on events without a key, and on events without a key that carry the two headers a
keyed message gets (x-ordering-key, x-outbox-id): the headers' cost and the order's apart.
Each also as a ratio to the ceiling of its round.

Each key's rows wait for its batch in flight (relay/queries.sql), so with few keys a batch holds
every key and the next batch, of the same relay or another, finds nothing to claim until it
commits: the relays take turns instead of overlapping. With many keys a batch holds a few rows
of each and the rest flows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks import ceiling, throughput
from benchmarks.workload import Servers, say

RELAYS = (1, 4)
# Rows without a key that carry the two headers the relay adds to a keyed row's message: keyed
# rows against these measure the order alone, these against keyless rows the headers alone.
HEADERS = "headers"
TARGET_KEYS = 10_000  # with this many keys, the rate must stay >= TARGET_RATIO of keyless
TARGET_RATIO = 0.9


def _median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def run(servers: Servers, *, key_counts: list[int], events: int, batch_size: int, rounds: int,
        window: int) -> dict[str, Any]:
    rates: dict[str, dict[int, list[float]]] = {
        label: {n: [] for n in RELAYS} for label in ["none", HEADERS, *map(str, key_counts)]}
    ceilings: list[float] = []
    for r in range(rounds):
        say(f"keys round {r + 1}/{rounds}: ceiling, relay x1 x4 without keys, without keys "
            f"but with their headers, and with {', '.join(f'{k:,}' for k in key_counts)} keys")
        ceilings.append(ceiling.publish_rate(servers, events, window).rate)
        for label in rates:
            keyed = dataclasses.replace(servers, keys=int(label) if label.isdigit() else 0,
                                        key_headers=label == HEADERS)
            for n in RELAYS:
                rates[label][n].append(throughput.relay_run(
                    keyed, events, n, batch_size=batch_size, tag=f"k{label}r{r}x{n}").rate)
    top = _median(ceilings)
    keyless = {n: _median(runs) for n, runs in rates["none"].items()}
    with_headers = {n: _median(runs) for n, runs in rates[HEADERS].items()}
    series: dict[str, dict[str, dict[str, Any]]] = {}
    for label, by_relays in rates.items():
        series[label] = {}
        for n, runs in by_relays.items():
            entry: dict[str, Any] = {"rate": round(_median(runs)),
                                     "ratio_to_ceiling": round(_median(runs) / top, 3),
                                     "rounds": [round(x) for x in runs]}
            if label != "none":
                entry["ratio_to_keyless"] = round(_median(runs) / keyless[n], 3)
            if label.isdigit():  # what the order costs beyond its headers
                entry["ratio_to_headers"] = round(_median(runs) / with_headers[n], 3)
            series[label][str(n)] = entry
    return {"ceiling": round(top), "ceiling_rounds": [round(x) for x in ceilings],
            "events": events, "batch_size": batch_size, "series": series}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    series = results["series"].get(str(TARGET_KEYS))
    if series is None:
        return []
    return [{"target": f"relay x{n} with {TARGET_KEYS:,} keys / without keys >= {TARGET_RATIO}",
             "measured": entry["ratio_to_keyless"],
             "met": entry["ratio_to_keyless"] >= TARGET_RATIO}
            for n, entry in series.items()]
