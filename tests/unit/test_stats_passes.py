"""The stats passes (outbox_relay/runtime/stats.py): where each starts (a fake clock), their
error handling, their thread; the relay's and the resolver's passes against the fakes. Against
PostgreSQL: tests/integration/test_stats_floor.py."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from outbox_relay.errors import ConnectionLost, DatabaseError, TransientError
from outbox_relay.model import HorizonHolder, PreparedXact
from outbox_relay.resolver.metrics import ResolverMetrics
from outbox_relay.resolver.settings import ResolverSettings
from outbox_relay.resolver.worker import Resolver
from outbox_relay.runtime import backoff, stats
from outbox_relay.runtime.stats import StatsFloor, StatsPasses
from tests.unit.fakes import FakeCluster, FakeLedger, FakePreparedStore
from tests.unit.relay_rig import make_rig

log = logging.getLogger("test_stats")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def actions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "action", "") for r in caplog.records]


# -- the floor ----------------------------------------------------------------------------------


def test_the_first_pass_is_full_then_bounded_from_the_lowest_id_seen() -> None:
    clock = Clock()
    floor = StatsFloor(clock=clock)
    assert floor.start() == (0, True)
    floor.observe(full=True, lowest=501)
    assert floor.start() == (500, False)
    floor.observe(full=False, lowest=900)  # 501..899 were published meanwhile
    assert floor.start() == (899, False)


def test_the_delayed_rows_below_a_full_passs_floor_stay_in_the_backlog() -> None:
    floor = StatsFloor(clock=Clock())
    floor.start()
    floor.observe(full=True, lowest=501, parked=3)  # 3 rows due tomorrow below 501
    assert floor.backlog(40, full=True) == 40  # the full pass counted them
    assert floor.start() == (500, False)
    floor.observe(full=False, lowest=520)
    assert floor.backlog(20, full=False) == 23
    floor.observe(full=True, lowest=530)
    assert floor.backlog(10, full=False) == 10  # the next full pass found none


def test_the_rows_below_the_floor_keep_their_lag_between_full_passes() -> None:
    clock = Clock()
    floor = StatsFloor(clock=clock)
    floor.start()
    floor.observe(full=True, lowest=501, parked=2, lag_below=30.0)  # waiting behind a key
    assert floor.lag(30.0, full=True) == 30.0
    clock.now += 5.0
    assert floor.lag(1.5, full=False) == 35.0  # 30 s late 5 s ago
    assert floor.lag(90.0, full=False) == 90.0  # a later row may be later still
    # Only scheduled rows below, due in 100 s: claimed at their time, not late before the
    # next full pass sees them still there.
    floor.observe(full=True, lowest=501, parked=1, lag_below=-100.0)
    clock.now += 110.0
    assert floor.lag(2.0, full=False) == 2.0
    floor.observe(full=True, lowest=530)  # none below: the passes' own lag
    assert floor.lag(2.0, full=False) == 2.0


def test_the_floor_moves_only_forward_between_full_passes() -> None:
    clock = Clock()
    floor = StatsFloor(clock=clock)
    floor.start()
    floor.observe(full=True, lowest=501)
    floor.observe(full=False, lowest=None)  # nothing above the floor: it stays
    assert floor.start() == (500, False)
    floor.observe(full=False, lowest=300)  # cannot be: a bounded pass sees nothing below it
    assert floor.start() == (500, False)


def test_a_full_pass_every_interval_resets_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "FULL_STATS_INTERVAL", 60.0)
    clock = Clock()
    floor = StatsFloor(clock=clock)
    floor.start()
    floor.observe(full=True, lowest=501)
    floor.observe(full=False, lowest=900)
    clock.now += 59.9
    assert floor.start() == (899, False)
    clock.now += 0.1
    assert floor.start() == (0, True)
    floor.observe(full=True, lowest=42)  # a late commit of an older id, a requeued dead letter
    assert floor.start() == (41, False)
    clock.now += 60.0
    assert floor.start() == (0, True)
    floor.observe(full=True, lowest=None)  # an empty table: the floor stays
    assert floor.start() == (41, False)


def test_a_full_pass_that_failed_is_tried_again_as_a_full_one() -> None:
    clock = Clock()
    floor = StatsFloor(clock=clock)
    assert floor.start() == (0, True)
    clock.now += 5.0  # the pass failed: no observe
    assert floor.start() == (0, True)


# -- the passes' error handling -----------------------------------------------------------------


class Script:
    """A pass that raises what it is given, in turn, and a reset that counts."""

    def __init__(self, *outcomes: BaseException | None) -> None:
        self.outcomes = list(outcomes)
        self.passes = 0
        self.resets = 0

    def run(self) -> None:
        self.passes += 1
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if outcome is not None:
            raise outcome

    def reset(self) -> None:
        self.resets += 1


def passes(script: Script, *, interval: float = 5.0, clock: Clock | None = None) -> StatsPasses:
    return StatsPasses(name="test stats", interval=interval, max_delay=30.0, run_pass=script.run,
                       reset=script.reset, log=log, clock=clock or Clock())


def test_a_failing_pass_is_said_once_reset_and_retried_with_backoff(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backoff, "INITIAL_DELAY", 100.0)  # the backoff beats the interval
    lost = ConnectionLost("server closed the connection unexpectedly")
    script = Script(lost, TransientError("connection refused"), lost, None, lost)
    runner = passes(script)
    with caplog.at_level(logging.INFO, logger="test_stats"):
        delays = [runner.step() for _ in range(5)]
    assert all(5.0 <= delay <= 30.0 for delay in delays)
    assert delays[3] == 5.0  # a good pass: the interval
    assert script.resets == 4  # each failure closes the session (the next pass reconnects)
    assert actions(caplog) == ["stats_failed", "stats_failed"]  # a run of failures: once
    assert "server closed the connection" in caplog.records[0].getMessage()
    assert not caplog.records[0].exc_info


def test_a_bug_in_a_pass_is_logged_with_its_traceback_and_the_passes_go_on(
        caplog: pytest.LogCaptureFixture) -> None:
    script = Script(KeyError("bug"), None)
    runner = passes(script)
    with caplog.at_level(logging.WARNING, logger="test_stats"):
        runner.step()
        runner.step()
    assert actions(caplog) == ["stats_failed"] and caplog.records[0].exc_info is not None
    assert script.passes == 2 and runner.failures == 0


def test_run_due_runs_a_pass_every_interval() -> None:
    clock = Clock()
    script = Script()
    runner = passes(script, clock=clock)
    runner.run_due()
    runner.run_due()
    assert script.passes == 1
    clock.now += 5.0
    runner.run_due()
    assert script.passes == 2


def test_the_thread_runs_passes_and_stops_with_its_session_closed() -> None:
    ran = threading.Event()
    script = Script()

    def run() -> None:
        script.run()
        ran.set()

    runner = StatsPasses(name="test stats", interval=0.01, max_delay=1.0, run_pass=run,
                         reset=script.reset, log=log)
    runner.start()
    assert ran.wait(5.0)
    assert runner.running
    runner.stop(timeout=5.0)
    assert not runner.running and script.resets == 1
    runner.stop()  # twice: the programs' close paths may both stop it


def test_a_pass_still_running_at_shutdown_is_left_to_the_process(
        caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    started = threading.Event()

    def run() -> None:
        started.set()
        release.wait(10.0)

    runner = StatsPasses(name="test stats", interval=60.0, max_delay=1.0, run_pass=run,
                         reset=lambda: None, log=log)
    runner.start()
    assert started.wait(5.0)
    with caplog.at_level(logging.WARNING, logger="test_stats"):
        runner.stop(timeout=0.05)
    assert actions(caplog) == ["stats_failed"]
    release.set()


# -- the relay's passes -----------------------------------------------------------------------


def test_the_relays_passes_walk_from_the_floor_and_every_minute_the_whole_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "FULL_STATS_INTERVAL", 3600.0)
    rig = make_rig(monkeypatch, batch_size=2, stats_interval=0.000001)
    rig.store.add_many(5)  # 1..5
    rig.relay.turn()  # publishes 1, 2; a full pass counts 3..5
    assert rig.store.stats_source.called("stats") == [{"after": 0}]
    assert rig.metric("outbox_relay_backlog_events") == 3
    rig.relay.turn()  # publishes 3, 4; a pass from the floor, 2
    assert rig.store.stats_source.called("stats")[-1] == {"after": 2}
    assert rig.metric("outbox_relay_backlog_events") == 1
    rig.relay.turn()  # publishes 5
    assert rig.store.stats_source.called("stats")[-1] == {"after": 4}
    monkeypatch.setattr(stats, "FULL_STATS_INTERVAL", 0.0)  # read before each pass
    rig.relay.turn()
    assert rig.store.stats_source.called("stats")[-1] == {"after": 0}


def test_a_full_pass_below_the_claim_floor_lowers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row appeared at or below the claims' floor (a late commit of an older id, a requeued
    dead letter's old id): the full pass has the next claim look from below it."""
    monkeypatch.setattr(stats, "FULL_STATS_INTERVAL", 0.0)  # every pass a full one
    rig = make_rig(monkeypatch, stats_interval=0.000001)
    rig.store.add_many(3)
    rig.store.marks.observe(after=0, full=True, writers=[], writers_after=[],
                            claimed=[(11, True)], waiting=None, first=None)
    assert rig.store.marks.floor == 10  # as if the claims had seen rows from 11 on
    rig.relay._refresh_stats()
    assert rig.store.marks.start() == (0, True)  # rows 1..3: from 0, a full look


def test_a_full_pass_above_the_claim_floor_leaves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "FULL_STATS_INTERVAL", 0.0)
    rig = make_rig(monkeypatch, stats_interval=0.000001)
    rig.store.add_many(3)
    rig.relay._refresh_stats()
    rig.store.marks.start()
    assert rig.store.marks.start() == (0, False)  # no look asked for: the interval's


def test_a_stats_session_lost_never_stops_the_batches(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig(monkeypatch, batch_size=2, stats_interval=0.000001)
    rig.store.add_many(6)
    source = rig.store.stats_source
    rig.relay.turn()
    source.fail("stats", ConnectionLost("server closed the connection unexpectedly"))
    source.unreachable = TransientError("connection refused")
    with caplog.at_level(logging.WARNING, logger="relay"):
        rig.relay.turn()
        rig.relay.stats.next_at = 0.0
        rig.relay.turn()
    assert rig.metric("outbox_relay_events_published_total") == 6  # every batch went on
    assert actions(caplog) == ["stats_failed"]
    source.unreachable = None
    rig.relay.stats.next_at = 0.0
    rig.relay.turn()
    assert source.connected and source.connects == 3
    assert rig.metric("outbox_relay_backlog_events") == 0


def test_the_pass_only_flags_rows_never_due_the_loop_moves_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch)
    never = rig.store.add(available_at=float("inf"))
    rig.relay._stats_pass()  # as on the stats thread: counted, not moved
    assert never in rig.store.rows and rig.store.called("dead_letter_never_due") == []
    rig.relay.stats.next_at = float("inf")  # no pass due: the loop acts on the flag
    rig.relay.turn()
    assert list(rig.store.dead_letter) == [never]
    rig.relay.turn()
    assert len(rig.store.called("dead_letter_never_due")) == 1  # once per flag


def test_run_starts_the_stats_thread_and_close_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(monkeypatch)
    rig.relay._background_stats = True
    seen: list[bool] = []
    rig.shutdown.predicate = lambda: bool(seen.append(rig.relay.stats.running)) or len(seen) > 2
    rig.relay.run()
    assert seen[0] and not rig.relay.stats.running


# -- the resolver's passes ----------------------------------------------------------------------


class QuietStore(FakePreparedStore):
    def prepared(self, prefix: str) -> list[PreparedXact]:
        return []

    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]:
        return {}


def resolver(**settings: Any) -> tuple[Resolver, QuietStore]:
    store = QuietStore(FakeCluster())
    built = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                      amqp_url="amqp://x@h/%2F", **settings),
                     metrics=ResolverMetrics(), store=store, ledger=FakeLedger(store.cluster),
                     background_stats=False)
    return built, store


def test_the_resolvers_stats_session_lost_is_said_once_and_reconnected(
        caplog: pytest.LogCaptureFixture) -> None:
    built, store = resolver(stats_interval=0.000001)
    store.cluster.stats = (7, 1.5)
    built.resolve_once()
    session = built._stats_session.current
    assert session is not None and session.connected
    store.cluster.stats = DatabaseError("terminating connection", sqlstate="57P01")
    with caplog.at_level(logging.WARNING, logger="resolver"):
        built.resolve_once()  # the scan itself goes on
        built.stats.next_at = 0.0
        built.resolve_once()
    assert actions(caplog) == ["stats_failed"] and not session.connected
    store.cluster.stats = (3, 0.5)
    built.stats.next_at = 0.0
    built.resolve_once()
    assert session.connected and session.connects == 3
    assert built.metrics.registry.get_sample_value("outbox_backlog_events") == 3


def test_the_resolvers_loop_runs_no_stats_pass_itself_with_the_thread() -> None:
    store = QuietStore(FakeCluster())
    built = Resolver(ResolverSettings(database_url="postgresql://x@h/db",
                                      amqp_url="amqp://x@h/%2F"),
                     metrics=ResolverMetrics(), store=store, ledger=FakeLedger(store.cluster))
    built.connect()
    built.resolve_once()
    assert built._stats_session.current is None  # the thread's, started by run()


def test_the_main_session_gets_a_statement_every_interval_while_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stats query kept an idle relay's main session from idling (idle_session_timeout
    would end it, and its instance lock): a trivial statement does now."""
    rig = make_rig(monkeypatch, stats_interval=3600)
    for _ in range(3):
        rig.relay.turn()
    assert len(rig.store.called("keepalive")) == 1
    rig.relay._next_keepalive = 0.0
    rig.relay.turn()
    assert len(rig.store.called("keepalive")) == 2
