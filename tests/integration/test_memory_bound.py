"""A relay's peak memory follows its byte budget and its largest fetched row, whatever the
outbox holds: rows too big to publish are moved by the claim without being fetched (issue 10).
The full-size measurement is ``./dev memory`` (devenv/memory.py); this is its short form."""

from __future__ import annotations

from devenv.memory import measure


def test_peak_memory_is_bounded_by_the_budget_not_by_the_rows() -> None:
    figures = measure(rows=3, row_mb=16, oversized=1, oversized_mb=100, small=200,
                      budget_mb=16, max_message_mb=32)

    assert figures["missing"] == 0 and figures["dead_lettered"] == 1, figures
    # Measured about 3x the largest fetched row (libpq's input buffer, its result, the bytes
    # object); fetching the 100 MiB row would have cost 200 MiB at least.
    assert figures["peak_above_baseline_mib"] < 3.5 * 16 + 16, figures
