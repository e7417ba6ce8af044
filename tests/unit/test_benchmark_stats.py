"""The benchmark's arithmetic: percentiles, latencies, the memory slope, a drained sink's count,
the statements' costs by bucket."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.cli_relays import ProgramsRun
from benchmarks.keys import HEADERS, _series
from benchmarks.latency import latencies_ms, percentile
from benchmarks.profile import phases
from benchmarks.soak import slope_mb_per_hour
from benchmarks.statements import label, top
from benchmarks.workload import SinkDepth


def test_nearest_rank_percentile() -> None:
    ordered = [float(n) for n in range(1, 101)]
    assert percentile(ordered, 0.50) == 50.0
    assert percentile(ordered, 0.99) == 99.0
    assert percentile(ordered, 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_latencies_skip_the_warmup_and_are_in_milliseconds() -> None:
    commit_at = [10.0, 10.0, 11.0, 12.0]
    arrived_at = [10.5, 10.002, 11.004, 12.001]
    assert latencies_ms(commit_at, arrived_at, first=1) == pytest.approx([1.0, 2.0, 4.0])


def test_slope_of_flat_and_growing_memory() -> None:
    flat = [(t, 40.0) for t in range(0, 600, 5)]
    assert slope_mb_per_hour(flat) == 0.0
    growing = [(float(t), 40.0 + t / 3600) for t in range(0, 600, 5)]  # 1 MB an hour
    assert slope_mb_per_hour(growing) == pytest.approx(1.0)
    assert slope_mb_per_hour([(0.0, 1.0)]) == 0.0


def test_profile_phases_are_shares_of_the_relay_loop() -> None:
    collapsed = "\n".join([
        "<module> (a.py:1);Relay.run_batch (worker.py:1);OutboxStore.claim (store.py:1) 30",
        "<module> (a.py:1);Relay.run_batch (worker.py:1);AmqpPublisher.publish_batch (p.py:1);"
        "AmqpPublisher._wait_for_confirms (p.py:2);pump (amqp.py:1) 60",
        "<module> (a.py:1);Relay.run_batch (worker.py:1);OutboxStore.finish (store.py:2) 10",
        "<module> (a.py:1);Relay.run_batch (worker.py:1);AmqpPublisher.publish_batch (p.py:1);"
        "Relay._claim_ahead (worker.py:5);OutboxStore.claim (store.py:1) 100",
        "<module> (a.py:1);Relay.close (worker.py:9) 500",  # outside the loop: not counted
        "not a sample line",
    ])
    shares = phases(collapsed)
    assert shares["samples"] == 200
    assert shares["1 claim (when none was made ahead)"] == 15.0  # the claim ahead is apart
    assert shares["  claim the next batch meanwhile"] == 50.0
    assert shares["3 wait for the confirms"] == 30.0
    assert shares["5 COMMIT PREPARED"] == 5.0
    assert shares["2 PREPARE TRANSACTION"] == 0.0
    # No sample of the loop (a run shorter than py-spy's attach): zero shares, not a failure.
    empty = phases("<module> (a.py:1) 5")
    assert empty["samples"] == 0 and set(empty.values()) == {0}


class _Channel:
    """A sink's channel: queue_purge empties a queue and says how many it held."""

    def __init__(self, held: list[int]) -> None:
        self.held = held

    def queue_purge(self, name: str) -> SimpleNamespace:
        count, self.held[0] = self.held[0], 0
        return SimpleNamespace(method=SimpleNamespace(message_count=count))


def test_a_drained_sink_counts_what_it_purged() -> None:
    depth = SinkDepth.__new__(SinkDepth)  # no connection: a fake channel
    held = [300]
    depth._channel, depth._names, depth.drains, depth.purged = _Channel(held), ["q"], True, 0
    assert depth() == 300 and held == [0]
    held[0] = 200
    assert depth() == 500 and depth() == 500


def test_keys_series_gives_the_ratio_of_medians_and_each_rounds_own() -> None:
    def runs(*rates: float) -> list[ProgramsRun]:
        return [ProgramsRun(rate, {"postgres": 1.0}) for rate in rates]

    series = _series({"none": {1: runs(100, 200, 150)}, HEADERS: {1: runs(90, 100, 300)},
                      "10000": {1: runs(50, 180, 135)}}, top=300)
    keyed = series["10000"]["1"]
    assert keyed["rate"] == 135 and keyed["ratio_to_ceiling"] == 0.45
    assert keyed["ratio_to_keyless"] == 0.9 and keyed["ratio_to_headers"] == 1.35
    assert keyed["round_ratios"] == [0.5, 0.9, 0.9]
    assert "round_ratios" not in series["none"]["1"]


def test_a_statement_is_named_by_its_text_without_comments() -> None:
    query = "-- name: claim\n-- Step 1 /* not this */\nWITH live AS (\n    SELECT 1) /* x */ SELECT *\n"
    assert label(query) == "WITH live AS ( SELECT 1) SELECT *"
    assert label("SELECT " + "x, " * 50, width=20) == "SELECT x, x, x, x..."


def test_the_costliest_statements_between_two_readings() -> None:
    before = {1: ("SELECT a", 10, 100.0, 50), 2: ("SELECT b", 5, 10.0, 5)}
    after = {1: ("SELECT a", 12, 130.0, 70), 2: ("SELECT b", 5, 10.0, 5),
             3: ("SELECT c", 4, 80.0, 8)}
    costs = top(before, after, count=1)
    assert costs["total_ms"] == 110.0  # b was not called: left out
    assert costs["top"] == [{"statement": "SELECT c", "calls": 4, "ms": 80.0,
                             "ms_per_call": 20.0, "buffers": 8}]
