"""The resolver: commit what the ledger has, roll back what it has not.

One pass: (1) list this database's prepared transactions with our gid prefix; (2) keep those
whose relay is gone (its instance advisory lock is free, so we take it) or that are older than
the hard limit; (3) append a marker to the ledger and read the ledger from a margin before the
oldest of them until the marker comes back; (4) COMMIT PREPARED the gids with an authentic
record in the ledger, ROLLBACK PREPARED the others. "Does not exist" (42704) means someone else
finished it first. The order matters: a relay known dead before step 3 cannot add a record
after our marker.

A record counts only if it is signed with the ledger key (which only the relays' role can read)
and names the prepared transaction's own xid and database (see outbox_relay/ledger.py). Candidates are
decided oldest first, at most LEDGER_WINDOW per ledger read, and only their gids are kept while
reading; a read fails only when the ledger stops delivering, however long it takes.

Between scans the watch (resolver/watch.py) checks every OUTBOX_RESOLVER_WATCH_INTERVAL for a
prepared batch whose relay's lock is gone, and starts the next scan at once when it finds one.

The resolver sees PostgreSQL and RabbitMQ through two seams, ``PreparedStore`` and ``Ledger``
(resolver/store.py and resolver/ledger.py; tests/unit/fakes.py for the unit tests).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Protocol

from outbox_relay import ledger
from outbox_relay.compact import Sizes
from outbox_relay.errors import DatabaseError, DatabaseUnavailable, TransientError, describe
from outbox_relay.gid import Gid, lock_class
from outbox_relay.model import Decision, HorizonHolder, PreparedXact, Server, SessionRole
from outbox_relay.resolver.compaction import Compaction, HoldClock
from outbox_relay.resolver.ledger import AmqpLedger
from outbox_relay.resolver.metrics import FOREIGN_REASONS, HORIZON_HOLDERS, ResolverMetrics
from outbox_relay.resolver.rejections import Reported
from outbox_relay.resolver.settings import ResolverSettings
from outbox_relay.resolver.store import PostgresPreparedStore
from outbox_relay.resolver.watch import orphaned
from outbox_relay.runtime.connections import ConnectionEvents
from outbox_relay.runtime.health import Health, stall_threshold
from outbox_relay.runtime.loop import Loop
from outbox_relay.runtime.signals import Shutdown, Stop
from outbox_relay.runtime.stats import LazySession, StatsFloor, StatsPasses, StatsSource

log = logging.getLogger("resolver")

# In-doubt batches decided per ledger read (oldest first): bounds what one read must find.
LEDGER_WINDOW = 256
# Rejected ledger records logged one line each per scan; the rest of a scan's are counted and
# said in one line (a ledger full of junk must not flood the log).
REJECTIONS_LOGGED_PER_SCAN = 100
# What fails a scan without ending the resolver: it reconnects and scans again.
SCAN_ERRORS: tuple[type[BaseException], ...] = (TransientError, DatabaseUnavailable)
# SQLSTATEs of an outbox the resolver cannot read for its stats: missing, not ours to read.
UNREADABLE_TABLE = frozenset({"42P01", "42501"})


class OutboxStatsSource(StatsSource, Protocol):
    """The resolver's stats session: the outbox's stats, and the keys held back behind a
    dead letter (resolver/store.py, StatsSession)."""

    def blocked_keys(self) -> int: ...
    def sizes(self) -> Sizes: ...
    def compact_if_due(self, compaction: Compaction, sizes: Sizes) -> None:
        """Run ``compaction`` on this session when it is due (resolver/compaction.py)."""
        ...


class PreparedStore(Protocol):
    """The resolver's PostgreSQL session. Errors: TransientError (cannot connect),
    DatabaseUnavailable (the server could not serve a statement), DatabaseError."""

    ledger_key: bytes  # read on connect: verifies the ledger records
    role: SessionRole  # read on connect: who may finish what

    @property
    def connected(self) -> bool: ...
    def connect(self) -> None: ...
    def close(self) -> None: ...
    def prepared(self, prefix: str) -> list[PreparedXact]: ...
    def try_instance_lock(self, lock_class: int, instance: int) -> bool: ...
    def instance_unlock(self, lock_class: int, instance: int) -> None: ...
    def finish(self, gid: str, *, commit: bool) -> bool: ...
    def xmin_horizon(self, prefix: str) -> dict[str, HorizonHolder]: ...
    def prepared_slots(self) -> tuple[int, int]:
        """(prepared transactions of the whole server, max_prepared_transactions)."""
        ...
    def stats_session(self) -> OutboxStatsSource:
        """A new, unconnected session for the stats passes (their thread's own)."""
        ...
    def watch(self, prefix: str, lock_class: int) -> tuple[list[str], list[int]]:
        """The gids of ``prefix`` prepared now, and the instances whose lock is held now."""
        ...


class Ledger(Protocol):
    """The ledger as the resolver reads it. Errors: TransientError."""

    @property
    def connected(self) -> bool: ...
    def connect(self) -> None: ...
    def close(self) -> None: ...
    def committed(self, key: bytes, since: datetime, candidates: Mapping[str, ledger.Expected], *,
                  on_progress: Callable[[], None],
                  on_rejected: Callable[[ledger.Rejected], None]) -> ledger.Found: ...


def resolver_health(settings: ResolverSettings) -> Health:
    """Readiness: both servers connected (PostgreSQL with 2PC on, the ledger stream declared).
    Liveness: the loop turned within 3x its longest legitimate wait (30 s at least); a scan
    waits up to the ledger read timeout for the marker's confirm, and a ledger read beats the
    probe whenever it makes progress, and fails after that timeout without any."""
    return Health(
        tuple(Server),
        stall_after=stall_threshold(2 * settings.ledger_read_timeout, settings.connect_timeout,
                                    settings.reconnect_max_delay, settings.interval))


class Resolver(Loop):
    program = "resolver"
    faults = SCAN_ERRORS

    def __init__(
        self,
        settings: ResolverSettings,
        *,
        metrics: ResolverMetrics | None = None,
        health: Health | None = None,
        shutdown: Stop | None = None,
        store: PreparedStore | None = None,
        ledger: Ledger | None = None,
        background_stats: bool = True,
    ) -> None:
        """``background_stats``: the outbox's stats passes run on a thread of their own,
        started by ``run``; False (the unit tests): each scan runs them when due."""
        self.settings = settings
        self.metrics = metrics or ResolverMetrics()
        super().__init__(log=log, health=health or resolver_health(settings),
                         last_loop=self.metrics.last_loop, shutdown=shutdown or Shutdown(),
                         max_delay=settings.reconnect_max_delay)
        self.lock_class = lock_class(settings.gid_prefix)
        self.store: PreparedStore = store or PostgresPreparedStore(
            settings.database_url, settings.table, connect_timeout=settings.connect_timeout)
        self.ledger: Ledger = ledger or AmqpLedger(
            settings.amqp_url, stream=settings.ledger_stream, max_age=settings.ledger_max_age,
            read_timeout=settings.ledger_read_timeout, connect_timeout=settings.connect_timeout)
        self._not_ours: set[str] = set()  # gids of another relays' role, already warned about
        self._foreign: set[tuple[str, int]] = set()  # (gid, xid) no relay made, said already
        self._reported = Reported()  # rejected ledger records counted and logged already
        self._unlogged: Counter[str] = Counter()  # this scan's, past the logged ones: by reason
        self._logged = 0  # rejected records logged this scan
        self._stats_failing = False
        # The outbox's stats passes (outbox_relay/runtime/stats.py): the stats thread's.
        self._background_stats = background_stats
        self._stats_floor = StatsFloor()
        self._stats_session = LazySession(lambda: self.store.stats_session())  # store read late
        self.stats = StatsPasses(name="outbox-resolver stats", interval=settings.stats_interval,
                                 max_delay=settings.reconnect_max_delay,
                                 run_pass=self._stats_pass, reset=self._stats_session.close,
                                 log=log)
        self._connections = ConnectionEvents(log, self.metrics.reconnects)
        self._hold = HoldClock()  # how long each kind of holder has held the horizon
        self.compaction = Compaction(
            after_hold=settings.compact_after_hold, above_mib=settings.compact_above,
            count=lambda outcome: self.metrics.compactions.labels(outcome).inc(), log=log)

    # -- one pass ---------------------------------------------------------------------------

    def resolve_once(self) -> dict[str, Decision]:
        """One scan; returns {gid: outcome} for every transaction finished in it."""
        self._db()
        prepared = self.store.prepared(self.settings.gid_prefix)
        self.metrics.in_doubt.set(len(prepared))
        self.metrics.oldest_age.set(prepared[0].age_seconds if prepared else 0)
        self._reported.keep(xact.gid for xact in prepared)
        self._logged = 0
        # Decide first, then read the metrics' table-wide queries: a dead relay's batch holds
        # its rows meanwhile. A scan that fails to decide still refreshes them (what holds
        # VACUUM back matters most while batches cannot be finished).
        try:
            outcomes = self._take_over(prepared)
        except BaseException:
            with contextlib.suppress(Exception):
                self._observe()
            raise
        self._observe()
        return outcomes

    def _take_over(self, prepared: list[PreparedXact]) -> dict[str, Decision]:
        """Finish the batches of ``prepared`` whose relay is gone or that passed the limit."""
        locked: list[int] = []
        try:
            candidates = self._candidates(prepared, locked)
            outcomes: dict[str, Decision] = {}
            # Oldest first (the store lists them by prepared time), a window at a time.
            for start in range(0, len(candidates), LEDGER_WINDOW):
                window = candidates[start:start + LEDGER_WINDOW]
                outcomes.update(self._resolve(window))
            return outcomes
        finally:
            self._log_unlogged()
            for instance in locked:
                self.store.instance_unlock(self.lock_class, instance)

    def _observe(self) -> None:
        self._observe_horizon()
        self._observe_slots()
        if not self._background_stats:
            self.stats.run_due()

    def _observe_slots(self) -> None:
        """Export how many of the server's prepared-transaction slots are taken, by anyone:
        with every one taken, no relay can PREPARE (OutboxPreparedTransactionSlotsFull)."""
        used, slots = self.store.prepared_slots()
        self.metrics.server_prepared.set(used)
        self.metrics.server_prepared_slots.set(slots)

    def _resolve(self, candidates: list[PreparedXact]) -> dict[str, Decision]:
        """Read the ledger for ``candidates`` and finish each of them."""
        since = min(x.prepared for x in candidates) - timedelta(
            seconds=self.settings.ledger_margin)
        committed = self._ledger_gids(since, {
            x.gid: ledger.Expected(x.xid, x.database) for x in candidates})
        outcomes: dict[str, Decision] = {}
        for xact in candidates:
            commit = xact.gid in committed
            finished = self.store.finish(xact.gid, commit=commit)
            outcome = (Decision.COMMITTED if commit else Decision.ROLLED_BACK) if finished else (
                Decision.ALREADY_FINISHED)
            outcomes[xact.gid] = outcome
            self.metrics.decisions.labels(outcome).inc()
            extra: dict[str, object] = {"action": f"resolved_{outcome}", "gid": xact.gid,
                                        "age_seconds": round(xact.age_seconds, 3)}
            if commit:  # the ledger record says how many messages the batch published
                extra["batch_size"] = committed[xact.gid]
            log.info("in-doubt batch %s", outcome.value.replace("_", " "), extra=extra)
        return outcomes

    def _observe_horizon(self) -> None:
        """Export what holds back VACUUM, and whether it is one of our prepared batches.

        A tie counts as ours: a snapshot taken while our batch is prepared has our xid as its
        xmin, so it is held back by us, not the other way round.
        """
        holders = self.store.xmin_horizon(self.settings.gid_prefix)
        held = self._hold.held_seconds(holders)
        self.compaction.observe(held)
        for holder in HORIZON_HOLDERS:
            found = holders.get(holder)
            self.metrics.horizon_age.labels(holder).set(found.xid_age if found else 0)
        self.metrics.session_transaction_age.set(held.get("session", 0.0))
        ours = holders.pop("outbox_prepared", None)
        holding = ours is not None and all(ours.xid_age >= h.xid_age for h in holders.values())
        self.metrics.holding_vacuum.set((ours.age_seconds or 0.0) if ours and holding else 0.0)

    def _stats_pass(self) -> None:
        """Export the outbox's backlog, lag and keys held back behind a dead letter: once per
        database every OUTBOX_STATS_INTERVAL instead of once per relay, on the stats thread
        (outbox_relay/runtime/stats.py). A table that is missing (not migrated yet) or not
        readable by this role is said once and exported as NaN, never a false 0."""
        source = self._stats_session.get()
        after, full = self._stats_floor.start()
        try:
            stats = source.stats(after, self._stats_floor.floor)
            blocked = source.blocked_keys()
        except DatabaseError as exc:
            if exc.sqlstate not in UNREADABLE_TABLE:
                raise
            if not self._stats_failing:
                log.warning("cannot read the outbox for its backlog and lag: %s", describe(exc),
                            extra={"action": "outbox_stats_failed", "table": self.settings.table})
            self._stats_failing = True
            self.metrics.backlog.set(math.nan)
            self.metrics.lag.set(math.nan)
            self.metrics.blocked_keys.set(math.nan)
            return
        backlog, lag = self._stats_floor.export(stats, full=full)
        self._stats_failing = False
        self.metrics.backlog.set(backlog)
        self.metrics.lag.set(lag)
        self.metrics.blocked_keys.set(blocked)
        sizes = source.sizes()
        self.metrics.table_bytes.labels("heap").set(sizes.heap_bytes)
        self.metrics.table_bytes.labels("indexes").set(sizes.index_bytes)
        source.compact_if_due(self.compaction, sizes)

    def _candidates(self, prepared: list[PreparedXact], locked: list[int]) -> list[PreparedXact]:
        """Prepared batches whose relay is gone, or that passed the hard limit.

        Any role may PREPARE under a gid of our prefix: one that no relay could have made
        (``foreign``) is left alone, counted and logged once, and never stops the scan.
        """
        alive: set[int] = set()
        candidates = []
        self._not_ours &= {xact.gid for xact in prepared}
        self._foreign &= {(xact.gid, xact.xid) for xact in prepared}
        foreign = dict.fromkeys(FOREIGN_REASONS, 0)
        for xact in prepared:
            gid = Gid.parse(xact.gid)
            reason = self._foreign_reason(gid, xact)
            if reason is not None:
                foreign[reason] += 1
                self._leave_alone(xact, reason)
                continue
            assert gid is not None
            if not self.store.role.may_finish(xact.owner):
                # PostgreSQL would refuse: only the preparing role or a superuser may finish it.
                if xact.gid not in self._not_ours:
                    self._not_ours.add(xact.gid)
                    log.warning(
                        "prepared batch belongs to role %s, the resolver runs as %s and cannot "
                        "finish it: run the resolver as the relays' role", xact.owner,
                        self.store.role.name, extra={"action": "not_owner", "gid": xact.gid,
                                                "owner": xact.owner})
                continue
            if xact.age_seconds >= self.settings.hard_limit:
                log.warning("prepared batch passed the hard limit", extra={
                    "action": "hard_limit_reached", "gid": xact.gid})
                candidates.append(xact)
            elif gid.instance in locked:
                candidates.append(xact)
            elif gid.instance not in alive:
                # Free lock: the relay's session is gone. Holding it also keeps a second
                # resolver off this relay's batches until we are done.
                if self.store.try_instance_lock(self.lock_class, gid.instance):
                    locked.append(gid.instance)
                    candidates.append(xact)
                else:
                    alive.add(gid.instance)
        for reason, count in foreign.items():
            self.metrics.foreign_prepared.labels(reason).set(count)
        return candidates

    def _foreign_reason(self, gid: Gid | None, xact: PreparedXact) -> str | None:
        """Why no relay made ``xact`` (a FOREIGN_REASONS value), or None: it may be a relay's.
        A relay's gid parses (Gid.parse refuses what a relay never makes: an instance that is
        no int4 lock key, a sequence over 63 bits), and its role reads the ledger key."""
        if gid is None or gid.prefix != self.settings.gid_prefix:
            return "gid"
        if not xact.owner_reads_key:
            return "owner"
        return None

    def _leave_alone(self, xact: PreparedXact, reason: str) -> None:
        """Say once per transaction that ``xact`` is left alone; the watch then ignores it."""
        if (xact.gid, xact.xid) in self._foreign:
            return
        self._foreign.add((xact.gid, xact.xid))
        log.warning(
            "prepared transaction %s of our gid prefix is no relay's (%s): left alone; it holds "
            "its locks and VACUUM until someone finishes it by hand", ascii(xact.gid),
            "not a gid a relay makes" if reason == "gid" else
            f"role {xact.owner!r} cannot read the ledger key",
            extra={"action": "foreign_prepared", "gid": xact.gid, "owner": xact.owner,
                   "reason": reason})

    def _ledger_gids(self, since: datetime,
                     candidates: dict[str, ledger.Expected]) -> dict[str, int]:
        if not self.ledger.connected:
            self._connect_amqp()
        found = self.ledger.committed(self.store.ledger_key, since, candidates,
                                      on_progress=self._progress, on_rejected=self._reject)
        self._reported.read(candidates, found.span)
        return found

    def _progress(self) -> None:
        """A long ledger read that is moving: the loop is alive."""
        self.metrics.last_loop.set_to_current_time()
        self.health.beat()

    def _reject(self, rejected: ledger.Rejected) -> None:
        """A record that cannot be read, or names an in-doubt batch and proves nothing: ignored,
        counted and logged once (resolver/rejections.py), whatever scans read it again."""
        if not self._reported.first_time(rejected.gid, rejected.offset):
            return
        self.metrics.ledger_rejected.labels(rejected.reason).inc()
        if self._logged >= REJECTIONS_LOGGED_PER_SCAN:
            self._unlogged[rejected.reason] += 1
            return
        self._logged += 1
        log.warning("ledger record rejected (%s): %s", rejected.reason, rejected.detail, extra={
            "action": "ledger_record_rejected", "gid": rejected.gid, "reason": rejected.reason,
            "offset": rejected.offset})

    def _log_unlogged(self) -> None:
        """One line for the rejected records of this scan past those logged one by one."""
        if not self._unlogged:
            return
        counts = dict(sorted(self._unlogged.items()))
        self._unlogged.clear()
        log.warning(
            "%d more ledger records rejected in this scan, counted but not logged one by one: %s",
            sum(counts.values()), ", ".join(f"{n} {reason}" for reason, n in counts.items()),
            extra={"action": "ledger_records_rejected_unlogged", "count": sum(counts.values()),
                   "reasons": counts})

    # -- connections and the loop -----------------------------------------------------------

    def _db(self) -> None:
        if not self.store.connected:
            try:
                self.store.connect()
            except TransientError as exc:
                self.health.set_check(Server.POSTGRESQL, "cannot connect", exc)
                raise
            self._mark_up(Server.POSTGRESQL)

    def _connect_amqp(self) -> None:
        try:
            self.ledger.connect()
        except TransientError as exc:
            self.health.set_check(Server.RABBITMQ, "cannot connect", exc)
            raise
        self._mark_up(Server.RABBITMQ)

    def _mark_up(self, server: Server) -> None:
        self.health.set_check(server, None)
        self._connections.up(server)

    def connect(self) -> None:
        """Check both servers up front (fail fast on 2PC off or a ledger clash)."""
        self._db()
        self._connect_amqp()

    def run(self) -> None:
        """The loop, with the stats thread beside it (stopped on the way out: close() also
        runs after a failed scan, and the thread keeps its own session meanwhile)."""
        if self._background_stats:
            self.stats.start()
        try:
            super().run()
        finally:
            self.stats.stop()

    def close(self) -> None:
        self.store.close()
        self.ledger.close()

    def turn(self) -> float:
        """One scan; the next comes after OUTBOX_RESOLVER_INTERVAL."""
        if not self.ledger.connected:
            self._connect_amqp()
        self.resolve_once()
        self.metrics.scans.inc()
        self.metrics.last_scan.set_to_current_time()
        return self.settings.interval

    def on_fault(self, exc: BaseException, failures: int) -> None:
        self.metrics.scan_errors.inc()
        if failures == 1:
            log.warning("scan failed: %s; retrying", exc, extra={"action": "scan_failed"})
        # Name the server that failed the scan; close() then drops both connections.
        if isinstance(exc, DatabaseError):
            self.health.set_check(Server.POSTGRESQL, "scan failed", exc)
        elif not self.ledger.connected:
            self.health.set_check(Server.RABBITMQ, "scan failed", exc)
        self.close()

    def on_recovered(self) -> None:
        log.info("resolver recovered", extra={"action": "resolver_recovered"})

    def pause(self, seconds: float) -> None:
        """Wait for the next scan; the wait ends as soon as a relay dies holding a prepared
        batch (resolver/watch.py): takeover in a fraction of a second, not at the next scan.
        Waits to retry after a fault (Loop.sleep) do not watch."""
        interval, prefix = self.settings.watch_interval, self.settings.gid_prefix
        if interval <= 0 or not self.store.connected:
            self.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while not self.shutdown.requested and time.monotonic() < deadline:
            self.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            try:
                prepared, live = self.store.watch(prefix, self.lock_class)
            except DatabaseError:
                return  # the scan that follows meets the same error and handles it
            if orphaned(prepared, set(live), prefix,
                        self._not_ours | {gid for gid, _xid in self._foreign}):
                return
