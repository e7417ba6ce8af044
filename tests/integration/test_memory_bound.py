"""A relay's peak memory is a function of its settings, whatever the outbox holds
(docs/reliability.md#memory, devenv.memory.bound_bytes): rows too big to publish are moved by the
claim without being fetched (issue 10), and headers that cannot fit frame_max are refused
without being decoded (issue 32: a 10 MiB JSON array took a relay from 43 MB to 835 MB).
The full-size measurement is ``./dev memory`` (devenv/memory.py); these are its short forms."""

from __future__ import annotations

from devenv.memory import HOSTILE, MIB, bound_bytes, measure


def test_peak_memory_is_bounded_by_the_budget_not_by_the_rows() -> None:
    figures = measure(rows=3, row_mb=16, oversized=1, oversized_mb=100, small=200,
                      budget_mb=16, max_message_mb=32, hostile=False)

    assert figures["missing"] == 0 and figures["dead_lettered"] == 1, figures
    assert figures["peak_above_baseline_mib"] <= figures["bound_above_baseline_mib"], figures
    # Measured about 3x the largest fetched row (libpq's input buffer, its result, the bytes
    # object); fetching the 100 MiB row would have cost 200 MiB at least.
    assert figures["peak_above_baseline_mib"] < 3.5 * 16 + 16, figures


def test_peak_memory_with_hostile_rows_stays_within_the_stated_bound() -> None:
    # OUTBOX_MAX_MESSAGE_BYTES of 16 MiB: the rows with 10 MiB of headers are fetched (under
    # the limit, as in issue 32), and must be refused from their text.
    figures = measure(rows=2, row_mb=16, oversized=1, oversized_mb=40, small=200, budget_mb=8,
                      max_message_mb=16, hostile=True, near_frame_max=5)

    assert figures["missing"] == 0, figures
    assert figures["dead_lettered"] == figures["expected_dead_letters"] == 1 + len(HOSTILE)
    assert figures["largest_fetched_row_mib"] > 10, figures  # the 10 MiB headers were fetched
    bound = bound_bytes(batch_max_bytes=8 * MIB, max_message_bytes=16 * MIB, batch_size=2000)
    assert figures["bound_above_baseline_mib"] == round(bound / MIB, 1)
    assert figures["peak_above_baseline_mib"] <= figures["bound_above_baseline_mib"], figures
