"""Rows that can never be published (outbox_relay.relay.worker.Relay on the fakes): bad headers,
too large, nested too deep, addressed to the ledger, a header frame over frame_max. They are
dead-lettered inside the claim's transaction and the rest of the batch is published."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.fakes import Outcome
from tests.unit.relay_rig import Rig, deep

# -- rows that can never be published ---------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"headers": ["not", "an", "object"]}, "headers must be a JSON object, got list"),
    ({"payload": '"' + "x" * 1000 + '"'}, "payload of 1002 bytes exceeds OUTBOX_MAX_MESSAGE_BYTES=1000"),
    ({"payload_bytes": b"\0" * 1001}, "payload of 1001 bytes exceeds OUTBOX_MAX_MESSAGE_BYTES=1000"),
])
def test_invalid_row_is_dead_lettered_inside_the_claim_transaction(
        rig: Rig, kwargs: dict[str, Any], error: str) -> None:
    good = rig.store.add()
    bad = rig.store.add(**kwargs)

    rig.relay.run_batch()

    assert rig.journal.index("dead_letter_claimed") < rig.journal.index("prepare")
    assert rig.store.called("dead_letter_claimed") == [{"rows": [(bad, error)]}]
    assert rig.publisher.published_ids() == [good]
    assert rig.store.dead_letter[bad].reason == "invalid"
    assert rig.store.dead_letter[bad].error == error
    assert rig.dead_lettered("invalid") == 1


def test_ledger_count_excludes_invalid_rows(rig: Rig) -> None:
    rig.store.add()
    rig.store.add(headers="text")

    rig.relay.run_batch()

    assert rig.publisher.ledger[0].count == 1
    assert rig.metric("outbox_relay_events_published_total") == 1


def test_invalid_row_of_a_rolled_back_batch_returns_and_is_dead_lettered_later(rig: Rig) -> None:
    refused = rig.store.add()
    invalid = rig.store.add(headers=[1])
    rig.publisher.script(refused, Outcome.RETURN, times=1)

    rig.step()
    assert invalid in rig.store.rows
    assert rig.store.dead_letter == {}
    rig.step()
    rig.step()

    assert rig.store.rows == {}
    assert list(rig.store.dead_letter) == [invalid]


def test_invalid_rows_of_a_rolled_back_batch_are_not_counted_as_dead_lettered(rig: Rig) -> None:
    refused = rig.store.add()
    rig.store.add(headers=[1])
    rig.publisher.script(refused, Outcome.RETURN, times=1)

    for _ in range(3):
        rig.step()

    assert len(rig.store.dead_letter) == 1
    assert rig.dead_lettered("invalid") == 1


# -- hostile rows (issue 10) ------------------------------------------------------------------


def test_deeply_nested_headers_are_dead_lettered_and_the_rest_published(rig: Rig) -> None:
    good = rig.store.add()
    bad = rig.store.add(headers=deep(5000))
    after = rig.store.add()

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [good, after]
    assert "nested" in rig.store.dead_letter[bad].error
    assert rig.batches("committed") == 1


def test_rows_addressed_to_the_ledger_are_dead_lettered(rig: Rig) -> None:
    stream = rig.relay.settings.ledger_stream
    via_default = rig.store.add(exchange="", routing_key=stream)
    via_exchange = rig.store.add(exchange=stream, routing_key="x")
    fine = rig.store.add(exchange="", routing_key="some.queue")

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [fine]
    assert {via_default, via_exchange} == set(rig.store.dead_letter)
    assert all(d.error.startswith("addressed to the ledger stream")
               for d in rig.store.dead_letter.values())


def test_header_frame_over_the_negotiated_frame_max_is_dead_lettered(rig: Rig) -> None:
    rig.publisher.negotiated_frame_max = 4096
    bad = rig.store.add(headers={"big": "x" * 5000})
    fine = rig.store.add(headers={"small": "x"})

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [fine]
    assert "frame_max of 4096" in rig.store.dead_letter[bad].error
