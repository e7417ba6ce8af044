"""The relay loop (``outbox_relay.relay.worker.Relay``) against the in-memory fakes: the protocol, step by step."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from outbox_relay import ledger
from outbox_relay.errors import BatchFailed, ConnectionLost, DatabaseError, LedgerMissing, TransientError
from outbox_relay.gid import Gid, lock_class
from outbox_relay.relay import worker
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.relay.worker import Relay
from tests.unit.fakes import (
    CHANNEL_CLOSED,
    FakePublisher,
    FakeStore,
    LedgerRecord,
    Outcome,
    RawHeaders,
    StopWhen,
)

INSTANCE = 0xABC


class Crash(Exception):
    """Stands in for the process dying at a crash point."""


@dataclass
class Rig:
    relay: Relay
    store: FakeStore
    publisher: FakePublisher
    journal: list[str]
    faults: list[str] = field(default_factory=list)
    shutdown: StopWhen = field(default_factory=StopWhen)

    @property
    def sleeps(self) -> list[float]:
        """The loop's backoff waits."""
        return self.shutdown.waits

    def step(self) -> int:
        """One turn of the loop without its error handling: reconnect, then one batch."""
        self.relay.ensure_connected()
        return self.relay.run_batch()

    def metric(self, name: str, **labels: str) -> float:
        value = self.relay.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def batches(self, outcome: str) -> float:
        return self.metric("outbox_relay_batches_total", outcome=outcome)

    def row_failures(self, reason: str) -> float:
        return self.metric("outbox_relay_row_failures_total", reason=reason)

    def batch_failures(self, reason: str) -> float:
        return self.metric("outbox_relay_batch_failures_total", reason=reason)

    def dead_lettered(self, reason: str) -> float:
        return self.metric("outbox_relay_dead_lettered_total", reason=reason)

    @property
    def decision(self) -> tuple[str, bool] | None:
        """(gid, commit) of the batch whose decision waits for PostgreSQL, if any."""
        unfinished = self.relay.unfinished
        return None if unfinished is None else (unfinished.gid, unfinished.commit)

    def gid(self, sequence: int) -> str:
        return str(Gid(self.relay.settings.gid_prefix, INSTANCE, sequence))


def make_rig(monkeypatch: pytest.MonkeyPatch, *, missing: set[str] | None = None,
             crash_at: str | None = None, connect: bool = True, **overrides: Any) -> Rig:
    values: dict[str, Any] = dict(
        database_url="postgresql://relay:secret@db/app", amqp_url="amqp://relay:secret@mq/",
        batch_size=10, max_attempts=3, retry_base_delay=0.0, retry_max_delay=0.0,
        poll_min_interval=0.01, poll_max_interval=0.08, max_message_bytes=1000,
    )
    values.update(overrides)
    journal: list[str] = []
    store = FakeStore(journal)
    publisher = FakePublisher(journal, missing=missing)
    faults: list[str] = []

    def fault(point: str) -> None:
        journal.append(f"@{point}")
        faults.append(point)
        if point == crash_at:
            raise Crash(point)

    shutdown = StopWhen()
    relay = Relay(RelaySettings(**values), store, publisher, metrics=RelayMetrics(), fault=fault,
                  shutdown=shutdown, instance=INSTANCE)
    rig = Rig(relay, store, publisher, journal, faults, shutdown)
    if connect:
        relay.ensure_connected()
        journal.clear()
    return rig


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    return make_rig(monkeypatch)


def strip_faults(journal: list[str]) -> list[str]:
    return [entry for entry in journal if not entry.startswith("@")]


# -- a clean batch ----------------------------------------------------------------------------


def test_clean_batch_commits_after_the_ledger_record_in_protocol_order(rig: Rig) -> None:
    rig.store.add_many(3)

    assert rig.relay.run_batch() == 3

    # The second claim is the next batch's, made while the broker confirms: it found nothing.
    assert strip_faults(rig.journal) == [
        "claim", "missing_exchanges", "prepare", "publish", "claim", "rollback", "ledger",
        "commit_prepared"]


def test_clean_batch_empties_the_outbox_and_leaves_no_prepared_transaction(rig: Rig) -> None:
    rig.store.add_many(3)

    rig.relay.run_batch()

    assert rig.store.rows == {}
    assert rig.store.prepared == {}
    assert rig.store.open is None
    assert rig.relay.unfinished is None


def test_clean_batch_publishes_rows_in_id_order_with_their_message_ids(rig: Rig) -> None:
    ids = [rig.store.add(message_id=f"evt-{n}") for n in range(3)]

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == ids
    assert [m.message_id for m in rig.publisher.published] == ["evt-0", "evt-1", "evt-2"]
    assert [m.properties.message_id for m in rig.publisher.published] == ["evt-0", "evt-1", "evt-2"]


def test_ledger_record_names_the_prepared_gid_the_count_and_the_instance(rig: Rig) -> None:
    rig.store.add_many(2)

    rig.relay.run_batch()

    prepared_gid = rig.store.called("prepare")[0]["gid"]
    assert prepared_gid == "outbox:00000abc:1"
    xid = rig.store.xids[prepared_gid]
    assert rig.publisher.ledger == [LedgerRecord(prepared_gid, 2, "00000abc", xid)]
    assert rig.store.called("finish") == [{"gid": prepared_gid, "commit": True}]


def test_ledger_record_is_signed_with_the_key_and_names_xid_and_database(rig: Rig) -> None:
    rig.store.add()

    rig.relay.run_batch()

    (record,) = rig.publisher.records
    gid = rig.gid(1)
    assert (record["xid"], record["database"]) == (rig.store.xids[gid], "fake")
    expected = ledger.batch_record(rig.store.ledger_key, gid=gid, xid=record["xid"],
                                   database="fake", count=1, relay="00000abc")
    assert record == json.loads(expected)
    forged = ledger.batch_record(b"x" * 32, gid=gid, xid=record["xid"], database="fake",
                                 count=1, relay="00000abc")
    assert json.loads(forged)["mac"] != record["mac"]


def test_each_batch_gets_a_new_gid_with_the_next_sequence(rig: Rig) -> None:
    rig.store.add_many(3)

    for _ in range(3):
        rig.step()
        rig.store.add()

    assert [c["gid"] for c in rig.store.called("prepare")] == [rig.gid(1), rig.gid(2), rig.gid(3)]


def test_claim_asks_for_the_configured_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(5)

    assert rig.relay.run_batch() == 2

    # This batch, and the next with what this one left of the byte budget.
    assert [c["limit"] for c in rig.store.called("claim")] == [2, 2]
    assert sorted(rig.store.rows) == [5]


def test_missing_exchanges_is_asked_once_with_the_batch_exchanges(rig: Rig) -> None:
    rig.store.add(exchange="a")
    rig.store.add(exchange="b")
    rig.store.add(exchange="a")

    rig.relay.run_batch()

    assert rig.publisher.exchange_checks == [{"a", "b"}]


def test_clean_batch_moves_the_metrics(rig: Rig) -> None:
    rig.store.add_many(4)

    rig.relay.run_batch()

    assert rig.metric("outbox_relay_events_published_total") == 4
    assert rig.batches("committed") == 1
    assert rig.batches("rolled_back") == 0
    assert rig.metric("outbox_relay_batch_size_events_count") == 1
    assert rig.metric("outbox_relay_batch_size_events_sum") == 4
    assert rig.metric("outbox_relay_batch_duration_seconds_count") == 1


# -- an empty claim ---------------------------------------------------------------------------


def test_empty_claim_rolls_back_and_prepares_nothing(rig: Rig) -> None:
    assert rig.relay.run_batch() == 0

    assert rig.journal == ["claim", "rollback"]
    assert rig.store.prepared == {}
    assert rig.store.open is None
    assert rig.publisher.batches == []
    assert rig.faults == []


def test_empty_claim_counts_no_batch(rig: Rig) -> None:
    rig.relay.run_batch()

    assert rig.batches("committed") == rig.batches("rolled_back") == 0
    assert rig.metric("outbox_relay_batch_size_events_count") == 0


def test_rows_not_yet_due_are_not_claimed(rig: Rig) -> None:
    rig.store.add(available_at=10.0)

    assert rig.relay.run_batch() == 0

    assert list(rig.store.rows) == [1]


# -- rows the broker refuses ------------------------------------------------------------------


def test_returned_message_fails_only_its_row(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.RETURN)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert "ledger" not in rig.journal
    assert rig.journal[-2:] == ["rollback_prepared", "settle_failed"]
    assert list(rig.store.rows) == [ids[1]]
    row = rig.store.rows[ids[1]]
    assert row.attempts == 1
    assert row.last_error is not None and row.last_error.startswith("unroutable: 312 NO_ROUTE")


def test_returned_message_settles_confirmed_rows_as_delivered(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.RETURN)

    rig.relay.run_batch()

    settled = rig.store.called("settle_failed")[0]
    assert settled["delivered"] == [ids[0], ids[2]]
    assert list(settled["failures"]) == [ids[1]]
    assert settled["attributed"] == [ids[1]]


def test_confirmed_rows_of_a_failed_batch_are_not_republished_on_retry(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.RETURN, times=1)

    rig.step()
    rig.step()

    assert rig.publisher.published_ids() == [ids[0], ids[1], ids[2], ids[1]]
    assert rig.store.rows == {}
    assert rig.batches("rolled_back") == 1
    assert rig.batches("committed") == 1


def test_nacks_never_dead_letter_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.NACK, times=5)

    for _ in range(6):
        rig.step()

    assert rig.store.dead_letter == {}
    assert rig.store.rows == {}  # published once the broker stopped nacking
    assert rig.batches("committed") == 1


def test_refused_row_is_dead_lettered_after_max_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    rig.step()
    assert rig.store.dead_letter == {}
    rig.step()

    assert rig.store.rows == {}
    assert rig.store.dead_letter[row_id].reason == "exhausted"
    assert rig.store.dead_letter[row_id].error.startswith("unroutable")
    assert rig.dead_lettered("exhausted") == 1


def test_failures_back_off_with_the_configured_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, retry_base_delay=1.5, retry_max_delay=60.0, max_attempts=7)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    rig.relay.run_batch()

    settled = rig.store.called("settle_failed")[0]
    assert (settled["base_delay"], settled["max_delay"], settled["max_attempts"]) == (1.5, 60.0, 7)
    assert rig.store.rows[row_id].available_at == 1.5
    assert rig.relay.run_batch() == 0  # not due yet


# -- a channel closed by the broker -----------------------------------------------------------


def test_channel_closed_makes_unconfirmed_rows_suspect(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=1)
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.CLOSE_CHANNEL)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert sorted(rig.store.rows) == [ids[1], ids[2]]
    for row_id in ids[1:]:
        assert rig.store.rows[row_id].attempts == 1
        assert rig.store.rows[row_id].last_error == CHANNEL_CLOSED


def test_suspects_in_a_batch_of_several_are_never_dead_lettered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=1)
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.CLOSE_CHANNEL)

    rig.relay.run_batch()

    assert rig.store.called("settle_failed")[0]["attributed"] == []
    assert rig.store.dead_letter == {}
    assert rig.dead_lettered("exhausted") == 0
    assert rig.row_failures("channel_closed") == 2
    assert rig.batch_failures("row_failures") == 1


def test_suspect_alone_in_its_batch_is_dead_lettered_after_max_attempts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=3)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.CLOSE_CHANNEL)

    rig.step()
    rig.step()
    assert rig.store.rows[row_id].attempts == 2
    assert rig.store.dead_letter == {}
    rig.step()

    assert rig.store.rows == {}
    assert rig.store.dead_letter[row_id].reason == "exhausted"
    assert rig.store.dead_letter[row_id].attempts == 3
    assert rig.dead_lettered("exhausted") == 1


def test_channel_close_culprit_is_isolated_and_the_rest_delivered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    ids = rig.store.add_many(4)
    rig.publisher.script(ids[1], Outcome.CLOSE_CHANNEL)

    for _ in range(6):
        rig.step()

    assert rig.store.rows == {}
    assert list(rig.store.dead_letter) == [ids[1]]
    assert sorted(m.row_id for m in rig.publisher.confirmed) == [ids[0], ids[2], ids[3]]
    assert len(rig.publisher.confirmed) == 3  # every healthy row confirmed exactly once


def test_closed_channel_is_reopened_before_the_next_batch(rig: Rig) -> None:
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.CLOSE_CHANNEL, times=1)
    rig.step()
    assert not rig.publisher.connected

    rig.step()

    assert rig.journal.count("amqp_connect") == 1
    assert rig.store.rows == {}
    assert rig.batches("committed") == 1


# -- connection loss and other transient results --------------------------------------------


def test_connection_loss_rolls_back_and_counts_no_attempts(rig: Rig) -> None:
    ids = rig.store.add_many(3)
    rig.publisher.script(ids[1], Outcome.LOSE_CONNECTION, times=1)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert "rollback_prepared" in rig.journal
    assert sorted(rig.store.rows) == [ids[1], ids[2]]
    assert all(r.attempts == 0 and r.last_error is None for r in rig.store.rows.values())
    assert rig.store.called("settle_failed")[0]["failures"] == {}
    assert rig.batch_failures("connection_lost") == 1
    assert rig.batch_failures("row_failures") == 0
    assert sum(rig.row_failures(r) for r in ("unroutable", "nacked", "channel_closed")) == 0
    assert rig.batches("rolled_back") == 1


def test_confirm_timeout_rolls_back_and_counts_no_attempts(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[0], Outcome.TIMEOUT, times=1)

    rig.relay.run_batch()

    assert rig.store.rows[ids[0]].attempts == 0
    assert ids[1] not in rig.store.rows  # confirmed: delivered, forgotten
    assert rig.batch_failures("confirm_timeout") == 1
    assert rig.store.dead_letter == {}


def test_rows_of_a_lost_connection_go_out_after_reconnecting(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[0], Outcome.LOSE_CONNECTION, times=1)

    rig.step()
    rig.step()

    assert rig.store.rows == {}
    assert [m.row_id for m in rig.publisher.confirmed] == ids
    assert rig.journal.count("amqp_connect") == 1


# -- the ledger record ------------------------------------------------------------------------


@pytest.mark.parametrize("error", [BatchFailed("ledger record not confirmed: nacked"),
                                   TransientError("RabbitMQ connection lost")])
def test_ledger_failure_rolls_back_and_never_commits(rig: Rig, error: Exception) -> None:
    rig.store.add_many(2)
    rig.publisher.fail("record_batch", error)

    rig.relay.run_batch()

    assert "commit_prepared" not in rig.journal
    assert rig.journal[rig.journal.index("ledger") + 1] == "rollback_prepared"
    assert rig.batches("rolled_back") == 1
    assert rig.batch_failures("ledger") == 1
    assert rig.metric("outbox_relay_events_published_total") == 0


def test_ledger_failure_counts_no_attempts_and_forgets_confirmed_rows(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.fail("record_batch", BatchFailed("ledger record not confirmed"))

    rig.relay.run_batch()

    settled = rig.store.called("settle_failed")[0]
    assert settled["delivered"] == ids
    assert settled["failures"] == {}


def test_unexpected_ledger_error_leaves_the_rollback_decision(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.publisher.fail("record_batch", RuntimeError("bug"))

    with pytest.raises(RuntimeError):
        rig.relay.run_batch()
    assert rig.decision == (rig.gid(1), False)
    rig.relay.ensure_connected()

    assert "commit_prepared" not in rig.journal
    assert rig.journal[-1] == "rollback_prepared"
    assert sorted(rig.store.rows) == [1, 2]


# -- exchanges that do not exist ----------------------------------------------------------------


def test_missing_exchange_fails_only_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, missing={"gone"})
    ok1 = rig.store.add(exchange="events")
    bad = rig.store.add(exchange="gone")
    ok2 = rig.store.add(exchange="events")

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [ok1, ok2]
    assert "commit_prepared" not in rig.journal
    assert list(rig.store.rows) == [bad]
    failed = rig.store.rows[bad]
    assert failed.attempts == 1
    assert failed.last_error is not None
    assert failed.last_error.startswith("exchange 'gone' not found")
    assert rig.row_failures("exchange_not_found") == 1


def test_rows_of_a_missing_exchange_are_attributed(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, missing={"gone"}, max_attempts=1)
    rig.store.add(exchange="events")
    bad = rig.store.add(exchange="gone")

    rig.relay.run_batch()

    assert rig.store.called("settle_failed")[0]["attributed"] == [bad]
    assert list(rig.store.dead_letter) == [bad]


def test_suspect_alone_among_published_rows_is_attributed(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, missing={"gone"})
    rig.store.add(exchange="gone")
    culprit = rig.store.add(exchange="events")
    rig.publisher.script(culprit, Outcome.CLOSE_CHANNEL)

    rig.relay.run_batch()

    assert culprit in rig.store.called("settle_failed")[0]["attributed"]


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


# -- finishing the prepared transaction -------------------------------------------------------


def test_postgres_lost_during_commit_prepared_keeps_the_commit_decision(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("finish", psycopg.OperationalError("server closed the connection unexpectedly"))

    with pytest.raises(TransientError, match="PostgreSQL connection lost finishing outbox:00000abc:1"):
        rig.relay.run_batch()

    assert rig.decision == (rig.gid(1), True)
    assert list(rig.store.prepared) == [rig.gid(1)]
    assert rig.batches("committed") == 0


def test_commit_decision_is_applied_after_reconnecting(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("finish", psycopg.OperationalError("server closed the connection unexpectedly"))
    with pytest.raises(TransientError):
        rig.relay.run_batch()
    rig.journal.clear()

    rig.relay.ensure_connected()

    assert rig.journal == ["pg_connect", "commit_prepared"]
    assert rig.store.prepared == {}
    assert rig.store.rows == {}
    assert rig.relay.unfinished is None
    assert rig.batches("committed") == 1


def test_postgres_lost_during_rollback_prepared_applies_the_rollback_later(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[0], Outcome.RETURN, times=1)
    rig.store.fail("finish", psycopg.OperationalError("terminating connection"))

    with pytest.raises(TransientError):
        rig.relay.run_batch()
    assert rig.decision == (rig.gid(1), False)
    rig.relay.ensure_connected()

    assert rig.store.called("finish")[-1] == {"gid": rig.gid(1), "commit": False}
    assert sorted(rig.store.rows) == ids
    assert rig.store.prepared == {}


def test_commit_whose_reply_was_lost_counts_as_finished_elsewhere(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("finish", psycopg.OperationalError("connection lost"), apply=True)
    with pytest.raises(TransientError):
        rig.relay.run_batch()

    rig.relay.ensure_connected()

    assert rig.store.rows == {}
    assert rig.relay.unfinished is None
    assert rig.batches("finished_elsewhere") == 1


def test_non_connection_database_error_in_finish_is_raised_as_is(rig: Rig) -> None:
    rig.store.add()
    rig.store.fail("finish", psycopg.errors.InsufficientPrivilege("permission denied"))

    with pytest.raises(DatabaseError, match="permission denied"):
        rig.relay.run_batch()

    assert rig.decision == (rig.gid(1), True)


def test_finish_returning_false_is_counted_as_finished_elsewhere(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.before("finish", lambda: rig.store.resolve_elsewhere(commit=True))

    rig.relay.run_batch()

    assert rig.batches("finished_elsewhere") == 1
    assert rig.batches("committed") == 0
    assert rig.relay.unfinished is None
    assert rig.store.rows == {}


def test_rollback_finished_elsewhere_still_settles_the_failures(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    rig.publisher.script(ids[1], Outcome.RETURN)
    rig.store.before("finish", lambda: rig.store.resolve_elsewhere(commit=False))

    rig.relay.run_batch()

    assert rig.batches("finished_elsewhere") == 1
    assert list(rig.store.rows) == [ids[1]]
    assert rig.store.rows[ids[1]].attempts == 1


def test_batch_prepared_when_the_connection_dropped_is_finished_after_reconnecting(rig: Rig) -> None:
    rig.store.add_many(2)
    rig.store.fail("prepare", psycopg.OperationalError("connection lost"), apply=True)
    with pytest.raises(ConnectionLost):
        rig.relay.run_batch()

    rig.relay.ensure_connected()

    assert rig.store.prepared == {}
    assert sorted(rig.store.rows) == [1, 2]


def test_prepare_refused_by_the_server_leaves_nothing_to_finish(rig: Rig) -> None:
    """E.g. max_prepared_transactions reached: nothing was prepared, so no ROLLBACK PREPARED
    (and no "finished elsewhere") follows; the open claim is rolled back and the rows stay."""
    rig.store.add_many(2)
    rig.store.fail("prepare", psycopg.errors.OutOfMemory("maximum number of prepared "
                                                         "transactions reached"), disconnect=False)
    with pytest.raises(DatabaseError, match="maximum number"):
        rig.relay.run_batch()

    assert rig.relay.unfinished is None
    rig.relay.on_fault(DatabaseError("again", sqlstate="53200"))
    rig.relay.ensure_connected()

    assert rig.store.called("finish") == []
    assert rig.batches("finished_elsewhere") == 0
    assert sorted(rig.store.rows) == [1, 2]


# -- crash points -----------------------------------------------------------------------------


def test_crash_points_are_passed_in_protocol_order(rig: Rig) -> None:
    rig.store.add()

    rig.relay.run_batch()

    assert rig.journal == [
        "claim", "@after_claim", "missing_exchanges", "prepare", "@after_prepare", "publish",
        "claim", "rollback", "@after_publish", "ledger", "@after_ledger", "commit_prepared",
        "@after_commit"]


def test_failed_batch_passes_only_the_crash_points_before_publishing(rig: Rig) -> None:
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    rig.relay.run_batch()

    assert rig.faults == ["after_claim", "after_prepare"]


@pytest.mark.parametrize(("point", "commit"), [
    ("after_prepare", False), ("after_publish", False), ("after_ledger", True)])
def test_interruption_at_a_crash_point_leaves_the_right_decision(
        monkeypatch: pytest.MonkeyPatch, point: str, commit: bool) -> None:
    rig = make_rig(monkeypatch, crash_at=point)
    rig.store.add_many(2)

    with pytest.raises(Crash):
        rig.relay.run_batch()
    assert rig.decision == (rig.gid(1), commit)
    rig.relay.ensure_connected()

    assert rig.store.called("finish")[-1] == {"gid": rig.gid(1), "commit": commit}
    assert (rig.store.rows == {}) is commit


def test_interruption_after_claim_leaves_no_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, crash_at="after_claim")
    rig.store.add()

    with pytest.raises(Crash):
        rig.relay.run_batch()

    assert rig.relay.unfinished is None
    assert rig.store.prepared == {}


# -- failure reasons and logs -----------------------------------------------------------------


def test_failed_and_dead_lettered_rows_are_logged_with_their_action(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig(monkeypatch, max_attempts=2)
    row_id = rig.store.add()
    rig.publisher.script(row_id, Outcome.RETURN)

    with caplog.at_level(logging.WARNING, logger="relay"):
        rig.step()
        rig.step()

    actions = [getattr(r, "action", None) for r in caplog.records if getattr(r, "row_id", None)]
    assert actions == ["row_failed", "row_dead_lettered"]


# -- the loop -----------------------------------------------------------------------------------


def run_loop(rig: Rig, claims: int) -> None:
    """Run ``Relay.run`` until the store has seen ``claims`` claims."""
    rig.shutdown.predicate = lambda: len(rig.store.called("claim")) >= claims
    rig.relay.run()


def test_run_connects_both_servers_with_the_instance_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, connect=False)

    run_loop(rig, 1)

    assert rig.journal[:3] == ["pg_connect", "amqp_connect", "claim"]
    assert rig.store.called("connect") == [{"lock_class": lock_class("outbox"), "instance": INSTANCE}]
    assert rig.metric("outbox_relay_connected", server="postgresql") == 1


def test_run_closes_both_connections_when_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, connect=False)

    run_loop(rig, 1)

    assert rig.journal[-2:] == ["pg_close", "amqp_close"]
    assert not rig.store.connected and not rig.publisher.connected


def test_empty_polls_double_the_wait_up_to_the_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, poll_min_interval=0.01, poll_max_interval=0.08)

    run_loop(rig, 5)

    assert rig.publisher.idles == pytest.approx([0.02, 0.04, 0.08, 0.08, 0.08])


def test_full_batches_run_back_to_back_and_a_partial_one_waits_the_minimum(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2, poll_min_interval=0.01, poll_max_interval=0.08)
    rig.store.add_many(5)

    run_loop(rig, 5)

    # Each batch claims the next while it is confirmed; the third finds the last row, the
    # fourth nothing: only then does the loop wait.
    assert [e for e in rig.journal if e in ("claim", "idle")] == [
        "claim", "claim", "claim", "claim", "idle", "claim", "idle"]
    assert rig.publisher.idles == pytest.approx([0.01, 0.02])


def test_work_after_idling_resets_the_wait_to_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, poll_min_interval=0.01, poll_max_interval=0.08)
    for _ in range(4):
        rig.store.before("claim", lambda: None)
    rig.store.before("claim", rig.store.add)  # the 5th claim finds a row

    run_loop(rig, 7)  # the 6th claim is made ahead, while the row is confirmed

    assert rig.publisher.idles == pytest.approx([0.02, 0.04, 0.08, 0.08, 0.01, 0.02])


def test_empty_polls_back_off_even_when_the_minimum_wait_is_zero(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, poll_min_interval=0.0, poll_max_interval=0.08)

    run_loop(rig, 5)

    assert rig.publisher.idles[-1] > 0


def test_run_refreshes_backlog_and_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(3)
    rig.store.lag = 4.5

    run_loop(rig, 1)

    assert rig.store.called("stats") == [{}]
    assert rig.metric("outbox_relay_backlog_events") == 1
    assert rig.metric("outbox_relay_lag_seconds") == 4.5


def test_stats_are_not_refreshed_before_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, stats_interval=3600)

    run_loop(rig, 4)

    assert len(rig.store.called("stats")) == 1


def test_lost_database_connection_does_not_end_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, connect=False)
    rig.store.add_many(2)
    rig.store.fail("claim", psycopg.OperationalError("server closed the connection unexpectedly"))

    run_loop(rig, 2)

    assert rig.store.rows == {}
    assert rig.journal.count("pg_connect") == 2
    assert rig.metric("outbox_relay_reconnects_total", server="postgresql") == 1
    assert len(rig.sleeps) == 1 and 0 < rig.sleeps[0] <= 0.2


def test_database_error_resets_the_session_instead_of_closing_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch)
    rig.store.add()
    rig.store.fail("prepare", psycopg.errors.FeatureNotSupported("prepared transactions are disabled"))

    run_loop(rig, 2)

    assert "reset" in rig.journal
    assert rig.journal.count("pg_close") == 1  # only the final close
    assert rig.store.rows == {}


def test_broker_lost_before_prepare_releases_the_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch)
    rig.store.add_many(2)
    rig.publisher.fail("missing_exchanges", TransientError("RabbitMQ connection lost"))

    run_loop(rig, 1)

    assert rig.store.prepared == {}
    assert sorted(rig.store.rows) == [1, 2]
    assert "reset" in rig.journal


def test_reconnect_retries_a_failing_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, connect=False)
    rig.store.fail("connect", TransientError("cannot connect to PostgreSQL: refused"))
    rig.store.fail("connect", TransientError("cannot connect to PostgreSQL: refused"))

    run_loop(rig, 1)

    assert rig.journal.count("pg_connect") == 3
    assert len(rig.sleeps) == 2
    assert [c["limit"] for c in rig.store.called("claim")] == [10]


def test_fault_streak_backoff_grows_and_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("outbox_relay.runtime.backoff.INITIAL_DELAY", 1.0)
    monkeypatch.setattr("random.uniform", lambda _low, high: high)  # the top of full jitter
    rig = make_rig(monkeypatch, reconnect_max_delay=3.0)
    for _ in range(4):
        rig.store.fail("claim", psycopg.OperationalError("connection lost"))

    run_loop(rig, 5)

    assert rig.sleeps == [1.0, 2.0, 3.0, 3.0]


# -- the next batch claimed while this one is confirmed -----------------------------------------


def test_next_batch_is_claimed_during_the_confirms_and_published_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)

    assert rig.relay.run_batch() == 2
    # Claimed, not prepared: only this batch was ever in doubt.
    assert rig.store.open is not None and sorted(rig.store.open.claimed) == [3, 4]
    assert rig.store.prepared == {}
    rig.journal.clear()
    assert rig.relay.run_batch() == 2

    assert strip_faults(rig.journal) == [
        "missing_exchanges", "prepare", "publish", "claim", "rollback", "ledger",
        "commit_prepared"]
    assert rig.publisher.published_ids() == [1, 2, 3, 4]
    assert rig.store.rows == {} and rig.store.open is None


def test_a_crash_during_the_confirms_leaves_one_batch_in_doubt_and_the_next_unprepared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2, crash_at="after_publish")
    rig.store.add_many(4)

    with pytest.raises(Crash):
        rig.relay.run_batch()

    assert list(rig.store.prepared) == [rig.gid(1)]
    assert rig.decision == (rig.gid(1), False)
    # The claim made ahead is an open transaction: the dying session rolls it back.
    assert rig.store.open is not None and sorted(rig.store.open.claimed) == [3, 4]


def test_a_failed_claim_ahead_is_raised_once_this_batch_is_committed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)
    rig.store.before("claim", lambda: None)
    rig.store.before("claim", lambda: rig.store.fail(
        "claim", psycopg.DatabaseError("canceling statement"), disconnect=False))

    with pytest.raises(DatabaseError, match="canceling statement"):
        rig.relay.run_batch()

    assert rig.store.called("finish") == [{"gid": rig.gid(1), "commit": True}]
    assert rig.store.prepared == {} and rig.relay.unfinished is None
    assert rig.relay.claimed_ahead == []
    assert sorted(rig.store.rows) == [3, 4]


def test_a_failed_batch_keeps_the_claim_made_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    rig.publisher.script(ids[0], Outcome.RETURN, times=1)

    rig.relay.run_batch()
    rig.relay.run_batch()

    assert rig.batches("rolled_back") == 1 and rig.batches("committed") == 1
    assert rig.publisher.published_ids() == [1, 2, 3, 4]
    # The returned row came back with an attempt counted; the second batch claimed it ahead, alone.
    assert rig.store.rows == {}
    assert rig.store.open is not None and list(rig.store.open.claimed) == [ids[0]]
    assert rig.store.open.claimed[ids[0]].attempts == 1


def test_no_claim_ahead_once_asked_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)
    rig.shutdown.predicate = lambda: True

    rig.relay.run_batch()

    assert len(rig.store.called("claim")) == 1
    assert rig.store.open is None


def test_a_connection_fault_forgets_the_claim_made_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(4)
    rig.relay.run_batch()
    assert rig.relay.claimed_ahead

    rig.relay.on_fault(ConnectionLost("server closed the connection"))

    assert rig.relay.claimed_ahead == []
    assert rig.store.open is None  # closed with the session: the rows are free again
    assert sorted(rig.store.rows) == [3, 4]


def test_a_lost_broker_frees_the_claim_made_ahead_before_reconnecting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    # The broker goes away while the first batch waits for its confirms, the next one claimed.
    rig.publisher.script(ids[0], Outcome.TIMEOUT, times=1)
    rig.relay.run_batch()
    assert rig.batches("rolled_back") == 1 and rig.relay.claimed_ahead
    assert not rig.publisher.connected
    open_while_reconnecting: list[object] = []
    rig.publisher.before("connect", lambda: open_while_reconnecting.append(rig.store.open))

    rig.relay.ensure_connected()

    # Nothing stays claimed in an open transaction while the relay waits for the broker.
    assert open_while_reconnecting == [None]
    # Back in the outbox: the unconfirmed row and the two claimed ahead (row 2 was confirmed).
    assert rig.relay.claimed_ahead == [] and sorted(rig.store.rows) == [ids[0], *ids[2:]]


# -- hostile rows (issue 10) ------------------------------------------------------------------


def deep(depth: int) -> RawHeaders:
    return RawHeaders('{"a":' * depth + "1" + "}" * depth)


def test_deeply_nested_headers_are_dead_lettered_and_the_rest_published(rig: Rig) -> None:
    good = rig.store.add()
    bad = rig.store.add(headers=deep(5000))
    after = rig.store.add()

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [good, after]
    assert "nested" in rig.store.dead_letter[bad].error
    assert rig.batches("committed") == 1


def test_a_bad_row_in_the_batch_claimed_ahead_is_handled_in_its_own_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    first = rig.store.add_many(2)
    bad = rig.store.add(headers=deep(100_000))
    last = rig.store.add()

    rig.relay.run_batch()  # claims [bad, last] ahead, after this batch's PREPARE
    assert [r.id for r in rig.relay.claimed_ahead] == [bad, last]
    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [*first, last]
    assert list(rig.store.dead_letter) == [bad]
    assert rig.batches("committed") == 2


def test_a_claim_ahead_held_back_by_keys_in_flight_asks_for_less_then_doubles_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=8)
    for _ in range(2):  # the second row of each key waits for the first one's batch
        for key in range(8):
            rig.store.add(ordering_key=f"k{key}")
    rig.relay.run_batch()  # the claim ahead finds every key's head in flight: nothing
    rig.relay.run_batch()  # the second rows; the claim ahead finds an empty outbox
    rig.store.add_many(20)  # rows without a key
    for _ in range(4):
        rig.relay.run_batch()

    limits = [c["limit"] for c in rig.store.called("claim")]
    # (batch, then its claim ahead): a claim that is not made ahead always asks for a batch.
    assert limits == [8, 8, 8, 1, 8, 1, 2, 4, 8]
    published = rig.publisher.published_ids()
    assert len(published) == 31 and len(rig.relay.claimed_ahead) == 5  # the last 5 rows


def test_an_empty_claim_ahead_behind_rows_without_a_key_still_asks_for_a_batch(
        rig: Rig) -> None:
    rig.store.add_many(3)

    rig.relay.run_batch()  # the claim ahead finds nothing: the outbox is empty
    rig.store.add_many(15)
    rig.relay.run_batch()
    rig.relay.run_batch()

    assert [c["limit"] for c in rig.store.called("claim")] == [10, 10, 10, 10, 10]


def test_the_batch_claimed_ahead_is_built_while_the_confirms_are_awaited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    built: list[tuple[int, bool]] = []  # (row, built while the last batch was prepared)
    real = worker.to_message
    monkeypatch.setattr(worker, "to_message", lambda row, **kw: (
        built.append((row.id, bool(rig.store.prepared))), real(row, **kw))[1])

    rig.relay.run_batch()
    rig.relay.run_batch()

    assert built == [(ids[0], False), (ids[1], False), (ids[2], True), (ids[3], True)]
    assert rig.publisher.published_ids() == ids and rig.batches("committed") == 2


def test_an_error_building_ahead_fails_the_next_batch_not_the_one_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    ids = rig.store.add_many(4)
    real = worker.to_message

    def broken_for_later_rows(row: Any, **kw: Any) -> Any:
        if row.id > ids[1]:
            raise RuntimeError("a bug in building")
        return real(row, **kw)

    monkeypatch.setattr(worker, "to_message", broken_for_later_rows)
    rig.relay.run_batch()
    assert rig.batches("committed") == 1 and rig.publisher.published_ids() == ids[:2]

    with pytest.raises(RuntimeError, match="a bug in building"):
        rig.relay.run_batch()  # built again before its PREPARE: nothing prepared, nothing sent
    assert rig.store.prepared == {} and rig.publisher.published_ids() == ids[:2]


def test_a_batch_built_ahead_is_built_again_for_another_frame_max(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    first = rig.store.add_many(2)
    big = rig.store.add(headers={"big": "x" * 5000})
    last = rig.store.add()
    rig.relay.run_batch()  # claims [big, last] ahead and builds them for frame_max 131072
    assert [r.id for r in rig.relay.claimed_ahead] == [big, last]

    rig.publisher.negotiated_frame_max = 4096  # a reconnect to a broker with a smaller one
    rig.relay.run_batch()

    assert rig.publisher.published_ids() == [*first, last]
    assert "frame_max of 4096" in rig.store.dead_letter[big].error


def test_a_batch_that_would_lose_a_row_is_stopped_before_its_prepare(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=3)
    ids = rig.store.add_many(3)
    real = rig.relay._build
    monkeypatch.setattr(rig.relay, "_build", lambda rows: real(rows[1:]))  # a bug drops a row

    with pytest.raises(RuntimeError, match="3 rows claimed, 2 messages"):
        rig.relay.run_batch()
    assert rig.store.prepared == {} and rig.publisher.published_ids() == []
    rig.relay.store.rollback()  # what the loop's reset does
    assert sorted(rig.store.rows) == ids


def test_an_empty_claim_ahead_lends_nothing_to_the_next_batch(rig: Rig) -> None:
    ids = rig.store.add_many(2)
    # A claim ahead that found nothing, its (empty) build for the frame_max in force.
    rig.relay._ahead = worker.Ahead([], built=([], []), frame_max=rig.publisher.frame_max)

    rig.relay.run_batch()

    assert rig.publisher.published_ids() == ids and rig.batches("committed") == 1


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


def test_deleted_ledger_pauses_claiming_until_it_is_declared_again(rig: Rig) -> None:
    rig.store.add_many(3)
    rig.publisher.fail("record_batch", LedgerMissing("ledger stream 'outbox.ledger' is gone"))

    rig.step()

    assert rig.batches("rolled_back") == 1
    assert rig.metric("outbox_relay_ledger_missing_total") == 1
    assert not rig.publisher.connected  # dropped: the next turn declares the ledger first
    later = rig.store.add_many(2)
    rig.journal.clear()
    rig.step()
    assert rig.journal.index("amqp_connect") < rig.journal.index("claim")
    assert rig.batches("committed") == 1
    assert {m.row_id for m in rig.publisher.confirmed} >= set(later)


def test_lost_connections_in_a_row_count_an_attempt_for_every_unconfirmed_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=5, max_attempts=3)
    ids = rig.store.add_many(5)
    poison = ids[2]
    rig.publisher.script(poison, Outcome.LOSE_CONNECTION)  # always

    for _ in range(2):
        rig.step()
    assert all(r.attempts == 0 for r in rig.store.rows.values())  # twice: maybe the network
    rig.step()
    third = rig.store.called("settle_failed")[-1]
    assert set(third["failures"]) == {poison, ids[3], ids[4]}  # unconfirmed ones
    assert third["attributed"] == []  # not yet anyone's own fault

    for _ in range(40):
        if not rig.store.rows and not rig.relay.claimed_ahead:
            break
        rig.step()

    assert rig.store.rows == {}
    assert list(rig.store.dead_letter) == [poison]
    assert rig.store.dead_letter[poison].reason == "exhausted"
    assert "batches in a row" in rig.store.dead_letter[poison].error
    assert {m.row_id for m in rig.publisher.confirmed} == set(ids) - {poison}


def test_confirm_timeouts_in_a_row_never_count_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker without a majority neither confirms nor nacks: however long that lasts, no
    row runs out of attempts."""
    rig = make_rig(monkeypatch, batch_size=5, max_attempts=2)
    ids = rig.store.add_many(5)
    rig.publisher.script(ids[2], Outcome.TIMEOUT, times=8)

    for _ in range(12):
        rig.step()

    assert rig.store.dead_letter == {}
    assert all(r.attempts == 0 for r in rig.store.rows.values())


def test_a_committed_batch_resets_the_lost_connection_streak(rig: Rig) -> None:
    flaky = rig.store.add()
    rig.publisher.script(flaky, Outcome.LOSE_CONNECTION, times=2)
    rig.step()
    rig.step()
    rig.step()  # commits, and so ends the streak
    other = rig.store.add()
    rig.publisher.script(other, Outcome.LOSE_CONNECTION, times=1)

    rig.step()

    assert rig.store.rows[other].attempts == 0


# -- the byte budget (issue 10) ---------------------------------------------------------------


def test_a_batch_stops_at_its_byte_budget_but_takes_one_row_at_least(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=10, batch_max_bytes=2500, max_message_bytes=5000)
    big = rig.store.add(payload_bytes=b"x" * 4000)  # alone over the budget: taken alone
    rest = rig.store.add_many(4, payload_bytes=b"y" * 1000)

    rig.relay.run_batch()

    assert rig.publisher.batches[0] == [m for m in rig.publisher.batches[0] if m.row_id == big]
    claims = rig.store.called("claim")
    assert claims[0]["max_bytes"] == 2500
    assert len(claims) == 1  # the batch used up the budget: nothing claimed ahead
    rig.relay.run_batch()
    assert [m.row_id for m in rig.publisher.batches[1]] == rest[:2]


def test_the_batch_claimed_ahead_gets_what_is_left_of_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2, batch_max_bytes=10_000, max_message_bytes=5000)
    ids = rig.store.add_many(4, payload_bytes=b"z" * 1000)
    first_batch_bytes = sum(rig.store.rows[i].claimed().row_bytes for i in ids[:2])

    rig.relay.run_batch()

    _first, ahead = rig.store.called("claim")
    assert first_batch_bytes > 2000
    assert ahead["max_bytes"] == 10_000 - first_batch_bytes
