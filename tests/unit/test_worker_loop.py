"""Relay.run, the loop around the batches (outbox_relay.relay.worker.Relay on the fakes):
connecting with the instance lock and closing, the polling waits, the backlog and lag
metrics, and reconnecting after faults with a growing, capped backoff."""

from __future__ import annotations

import psycopg
import pytest

from outbox_relay.errors import TransientError
from outbox_relay.gid import lock_class
from tests.unit.relay_rig import INSTANCE, Rig, make_rig


def run_loop(rig: Rig, claims: int) -> None:
    """Run ``Relay.run`` until the store has seen ``claims`` claims."""
    rig.shutdown.predicate = lambda: len(rig.store.called("claim")) >= claims
    rig.relay.run()


# -- connecting and closing -------------------------------------------------------------------


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


# -- polling ----------------------------------------------------------------------------------


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


# -- backlog and lag --------------------------------------------------------------------------


def test_run_refreshes_backlog_and_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, batch_size=2)
    rig.store.add_many(3)
    rig.store.lag = 4.5

    run_loop(rig, 1)

    assert rig.store.stats_source.called("stats") == [{"after": 0}]  # the first pass: full
    assert rig.metric("outbox_relay_backlog_events") == 1
    assert rig.metric("outbox_relay_lag_seconds") == 4.5


def test_stats_are_not_refreshed_before_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch, stats_interval=3600)

    run_loop(rig, 4)

    assert len(rig.store.stats_source.called("stats")) == 1


# -- faults and reconnects --------------------------------------------------------------------


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
