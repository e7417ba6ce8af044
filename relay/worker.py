"""The relay loop. ``Relay.run_batch`` is the protocol's five steps, top to bottom."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import tenacity

from outbox_relay import ledger, tracing
from outbox_relay.errors import (
    BatchFailed,
    ConnectionLost,
    DatabaseError,
    LedgerMissing,
    StandbyWaitTimeout,
    TransientError,
    describe,
)
from outbox_relay.gid import Gid, lock_class, new_instance_id
from outbox_relay.model import (
    BatchOutcome,
    DeadLetterReason,
    Failure,
    Message,
    OutboxRow,
    PublishResult,
    Reason,
    Server,
    TracedMessage,
    Unpublishable,
)
from outbox_relay.relay.marks import ClaimMarks
from outbox_relay.relay.messages import to_message
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.settings import RelaySettings
from outbox_relay.relay.waves import held_back, waves
from outbox_relay.runtime import backoff
from outbox_relay.runtime.connections import ConnectionEvents
from outbox_relay.runtime.health import Health, stall_threshold
from outbox_relay.runtime.loop import Loop
from outbox_relay.runtime.signals import Shutdown, Stop
from outbox_relay.runtime.stats import LazySession, StatsFloor, StatsPasses, StatsSource

log = logging.getLogger("relay")

# Batches in a row that lost the broker connection (not merely their confirms) before every
# row of the batch counts an attempt: a row that kills the connection in a way we cannot tell
# apart from the network must not be retried forever, and retried alone it names itself.
LOST_STREAK_LIMIT = 3

# A nacked row is charged (counted toward OUTBOX_MAX_ATTEMPTS when nacked alone in its batch)
# only if the broker confirmed some other message in the last NACK_EVIDENCE_SECONDS: a queue
# then refused it (full, with x-overflow reject-publish; or unavailable while the rest of the
# broker works). A broker that confirms nothing at all may be failing as a whole, and an outage
# of any length must not run rows out of attempts: its nacks still count attempts and back
# the rows off, but dead-letter none.
NACK_EVIDENCE_SECONDS = 10.0

# A claim made ahead that finds nothing while the batch in flight holds keyed rows was most
# likely held back by key heads in flight (this batch's, or another relay's): it read up to three
# batches of rows and found none it could take (sql/queries.sql, the look), and the next one
# would too while those batches last. The next claim ahead asks for this share of a batch (its
# look shrinks with it), doubling back to a whole batch as its claims come back full.
AHEAD_RESTART_SHARE = 8

# A claimed row that can never be published goes to the dead-letter table inside its claim
# (dead_letter_claimed), its columns sent back to PostgreSQL: two more copies of it in the
# relay while they are sent (the driver's parameter buffer and libpq's). A row of this many
# bytes or more is moved by PostgreSQL itself instead, after the claim is rolled back
# (_set_aside): no copy at all, for the relay's memory bound (docs/reliability.md#memory).
DEAD_LETTER_COPY_MAX = 1 << 20


class Store(Protocol):
    ledger_key: bytes  # read on connect: signs the ledger records
    database: str  # this database's name, named in every ledger record
    marks: ClaimMarks  # where the claims start (relay/marks.py)
    ahead_gave_up: int  # claims ahead that gave up a table lock wait, so far (relay/store.py)

    @property
    def connected(self) -> bool: ...
    def connect(self, lock_class: int, instance: int) -> None: ...
    def close(self) -> None: ...
    def reset(self) -> None: ...
    def claim(self, limit: int, max_bytes: int, *, max_message_bytes: int = ...,
              one_row_at_least: bool = ...) -> list[OutboxRow]: ...
    def dead_letter_claimed(self, rows: Sequence[tuple[OutboxRow, str]]) -> None: ...
    def dead_letter_rows(self, reasons: Mapping[int, str]) -> list[int]: ...
    def rollback(self) -> None: ...
    def prepare(self, gid: str) -> int: ...
    def finish(self, gid: str, *, commit: bool) -> bool: ...
    def settle_failed(self, delivered: Sequence[int], failures: Mapping[int, str],
                      attributed: Sequence[int], *, max_attempts: int, base_delay: float,
                      max_delay: float) -> list[int]: ...
    def stats_session(self) -> StatsSource:
        """A new, unconnected session for the stats passes (their thread's own)."""
        ...
    def keepalive(self) -> None:
        """A trivial statement on the main session (it must not idle: idle_session_timeout)."""
        ...
    def dead_letter_never_due(self, limit: int) -> list[tuple[int, str, str]]: ...


class Publisher(Protocol):
    @property
    def connected(self) -> bool: ...
    def connect(self) -> None: ...
    def close(self) -> None: ...
    def missing_exchanges(self, names: set[str]) -> dict[str, Failure]: ...
    def publish_batch(self, messages: Sequence[Message],
                      while_waiting: Callable[[], None] | None = None) -> PublishResult: ...
    @property
    def frame_max(self) -> int: ...
    @property
    def user_id(self) -> str | None: ...
    def record_batch(self, gid: str, record: bytes) -> None: ...
    def idle(self, seconds: float) -> None: ...


def relay_health(settings: RelaySettings) -> Health:
    """Readiness: both servers connected (PostgreSQL: 2PC on, schema present, as checked on
    connect). Liveness: the loop turned within 3x its longest legitimate wait (30 s at least):
    a batch waits for its standby (OUTBOX_STANDBY_WAIT), then its confirms and ledger record's."""
    standby = settings.standby_wait_timeout if settings.standby_wait else 0.0
    return Health(
        tuple(Server),
        stall_after=stall_threshold(standby + 2 * settings.confirm_timeout,
                                    settings.connect_timeout, settings.reconnect_max_delay,
                                    settings.poll_max_interval))


@dataclass(frozen=True)
class Unfinished:
    """A prepared batch whose outcome is decided but not applied yet (PostgreSQL went away)."""

    gid: str
    commit: bool
    size: int  # its rows, for the log line when it is finally applied


@dataclass(frozen=True)
class Ahead:
    """The next batch, claimed while the broker confirmed the last one (its claim transaction
    open, not prepared, on the store's claim session), or the error that claim raised."""

    rows: list[OutboxRow]
    error: DatabaseError | None = None
    # Its messages, built while the confirms were on their way too, for the frame_max they
    # were checked against and the user_id they carry (a reconnect may bring others).
    built: tuple[list[Message], list[tuple[OutboxRow, str]]] | None = None
    frame_max: int = 0
    user_id: str | None = None


class Relay(Loop):
    """Moves outbox rows to RabbitMQ, one prepared batch at a time."""

    program = "relay"
    faults = (TransientError, DatabaseError)

    def __init__(
        self,
        settings: RelaySettings,
        store: Store,
        publisher: Publisher,
        *,
        metrics: RelayMetrics | None = None,
        health: Health | None = None,
        fault: Callable[[str], None] = lambda _point: None,
        shutdown: Stop | None = None,
        instance: int | None = None,
        background_stats: bool = True,
    ) -> None:
        """``background_stats``: the stats passes run on a thread of their own, started by
        ``run``; False (the unit tests): the loop runs them itself when due."""
        self.settings = settings
        self.store = store
        self.publisher = publisher
        self.metrics = metrics or RelayMetrics()
        super().__init__(log=log, health=health or relay_health(settings),
                         last_loop=self.metrics.last_loop, shutdown=shutdown or Shutdown(),
                         max_delay=settings.reconnect_max_delay)
        self.fault = fault
        self.instance = new_instance_id() if instance is None else instance
        self.lock_class = lock_class(settings.gid_prefix)
        self._sequence = 0
        self._unfinished: Unfinished | None = None
        # The stats passes (outbox_relay/runtime/stats.py): their floor and session are the
        # stats thread's; what they found that the loop must act on, the loop's.
        self._background_stats = background_stats
        self._stats_floor = StatsFloor()
        self._stats_session = LazySession(lambda: self.store.stats_session())  # store read late
        self._never_due = threading.Event()  # the last pass counted rows never due
        self._next_keepalive = 0.0  # the main session's next trivial statement (monotonic)
        self.stats = StatsPasses(name="outbox-relay stats", interval=settings.stats_interval,
                                 max_delay=settings.reconnect_max_delay,
                                 run_pass=self._stats_pass, reset=self._stats_session.close,
                                 log=log)
        self._connections = ConnectionEvents(log, self.metrics.reconnects)
        self._idle = settings.poll_min_interval  # the next empty poll's wait
        self._ahead: Ahead | None = None
        # Batches in a row whose broker connection was lost (see LOST_STREAK_LIMIT).
        self._lost_streak = 0
        self._batch_bytes = 0  # row data of the batch in flight (claimed ahead: the rest)
        self._batch_keyed = False  # the batch in flight has rows with an ordering key
        self._ahead_rows = settings.batch_size  # what the next claim ahead asks for
        self._confirmed_at = float("-inf")  # when the broker last confirmed a message (monotonic)
        self._standby_waiting = False  # the last batch timed out waiting for the standby

    @property
    def instance_name(self) -> str:
        return f"{self.instance:08x}"

    @property
    def unfinished(self) -> Unfinished | None:
        """The batch whose decision waits for PostgreSQL to come back, if any."""
        return self._unfinished

    @property
    def claimed_ahead(self) -> list[OutboxRow]:
        """The rows of the next batch, claimed while the broker confirmed the last one."""
        return self._ahead.rows if self._ahead is not None else []

    # -- the protocol ---------------------------------------------------------------------

    def run_batch(self) -> int:
        """Claim, prepare, publish, record, commit one batch. Returns the number of rows claimed."""
        s = self.settings
        started = time.monotonic()
        # 1. BEGIN; claim due rows with FOR UPDATE SKIP LOCKED and delete them (unless the
        # previous batch claimed them already, while its confirms were on their way).
        rows, ahead = self.claimed_ahead, self._ahead
        self._ahead = None
        if not rows:
            ahead = None  # what a claim ahead built belongs to its rows, never to these
            rows = self._claim(s.batch_max_bytes)
        if not rows:
            self.store.rollback()
            self._standby_waiting = False  # nothing waits
            self.metrics.waiting_for_standby.set(0)
            return 0
        self.fault("after_claim")
        # Rows too big to fetch were moved to the dead-letter table by the claim itself.
        oversized = [(row, row.dead_reason) for row in rows if row.dead_reason is not None]
        self._batch_bytes = sum(row.row_bytes for row in rows)
        self._batch_keyed = any(row.ordering_key is not None for row in rows)
        if ahead is not None and ahead.built is not None \
                and (ahead.frame_max, ahead.user_id) == (self.publisher.frame_max,
                                                         self.publisher.user_id):
            messages, invalid = ahead.built
        else:
            messages, invalid = self._build(rows)
        # Every claimed row leaves as a message or a dead letter. A batch that would commit a row
        # as neither is a bug: stopped here, before its PREPARE (the claim is rolled back).
        if len(messages) + len(invalid) + len(oversized) != len(rows):
            raise RuntimeError(
                f"bug: {len(rows)} rows claimed, {len(messages)} messages and "
                f"{len(invalid) + len(oversized)} dead letters built; nothing was prepared")
        missing = self.publisher.missing_exchanges({m.exchange for m in messages})
        failed_early = {m.row_id: missing[m.exchange] for m in messages if m.exchange in missing}
        messages = [m for m in messages if m.row_id not in failed_early]
        stopped = [row for row, _ in invalid + oversized] + [
            row for row in rows if row.id in failed_early]
        if held_back(messages, stopped) \
                or any(row.row_bytes >= DEAD_LETTER_COPY_MAX for row, _ in invalid):
            self._set_aside(invalid + oversized, failed_early, rows)
            return len(rows)
        if invalid:
            self.store.dead_letter_claimed(invalid)
        invalid.extend(oversized)

        # 2. PREPARE TRANSACTION: the claim is durable; the rows stay locked until the outcome.
        gid = self._next_gid()
        # Until COMMIT/ROLLBACK PREPARED returns, an exception leaves the decision here for the
        # loop to apply after reconnecting: roll back unless the ledger record is confirmed. Set
        # before PREPARE: its reply can be lost after the server prepared the transaction.
        self._unfinished = Unfinished(gid, commit=False, size=len(rows))
        try:
            xid = self.store.prepare(gid)
        except Exception as exc:
            if not isinstance(exc, ConnectionLost):
                self._unfinished = None  # refused (e.g. out of slots): certainly not prepared
            if isinstance(exc, StandbyWaitTimeout):
                self._waiting_for_standby(exc)  # rolled back by the store: nothing published
            raise
        if s.standby_wait:
            self._standby_caught_up()
        self.fault("after_prepare")

        # 3. Publish every message, persistent + mandatory, all confirms in flight at once;
        # claim the next batch (step 1 only) while the broker works.
        result, sent = self._publish(messages, gid)
        result.failed.update(failed_early)  # so the batch is not complete
        committed = False
        if result.complete(len(messages)):
            self.fault("after_publish")
            # 4. Commit on the broker side first: the ledger record of the batch, signed, naming
            # the prepared transaction (xid, database) it stands for.
            record = ledger.batch_record(self.store.ledger_key, gid=gid, xid=xid,
                                         database=self.store.database, count=len(messages),
                                         relay=self.instance_name)
            try:
                self.publisher.record_batch(gid, record)
                self._confirmed_at = time.monotonic()
                committed = True
                self._unfinished = Unfinished(gid, commit=True, size=len(rows))
            except LedgerMissing as exc:
                result.transient = Failure(Reason.LEDGER, f"ledger: {exc}")
                self._ledger_missing(exc)
            except (BatchFailed, TransientError) as exc:
                result.transient = Failure(Reason.LEDGER, f"ledger: {exc}")
        if committed:
            self.fault("after_ledger")
            # 5. COMMIT PREPARED.
            self._lost_streak = 0
            if self._finish(gid, commit=True, size=len(rows)):
                self.metrics.events_published.inc(len(messages))
                self._count_trace_dropped(messages)
                self._log_dead_lettered(invalid, gid=gid)
            self.fault("after_commit")
        else:
            refused = len(result.failed) + len(result.suspect)
            self._finish(gid, commit=False, size=len(rows), reason=str(result.transient or (
                f"{refused} of {len(messages) + len(failed_early)} messages refused by the broker")))
            self._settle(result, gid=gid, published=sent,
                         message_ids={row.id: row.message_id for row in rows})
        self.metrics.batch_duration.observe(time.monotonic() - started)
        self.metrics.batch_size.observe(len(rows))
        if self._ahead is not None and self._ahead.error is not None:
            claim_error, self._ahead = self._ahead.error, None
            raise claim_error  # this batch is finished; the loop now resets the claim session
        return len(rows)

    def _publish(self, messages: list[Message], gid: str) -> tuple[PublishResult, list[int]]:
        """Step 3, in the batch's publish span when the relay runs with OpenTelemetry
        (outbox_relay.tracing.publishing; nothing otherwise). Returns what the broker said, and
        the rows sent."""
        with tracing.publishing(messages, gid=gid) as span:
            result, sent = self._publish_waves(messages)
            span.result(result, len(sent))
        return result, sent

    def _publish_waves(self, messages: list[Message]) -> tuple[PublishResult, list[int]]:
        """Step 3 in waves (relay/waves.py): a wave goes out once the last one is confirmed.
        A key whose message the broker refused (returned, nacked) sends nothing more; the
        other keys go on. After a closed channel or a lost connection nothing more is sent. The
        next batch is claimed during the first wave."""
        result = PublishResult()
        sent: list[int] = []
        stopped: set[str] = set()  # keys with an unconfirmed message: their rest waits
        for i, wave in enumerate(waves(messages) or [[]]):
            wave = [m for m in wave if m.ordering_key not in stopped]
            if i and not wave:
                break  # every later message belongs to a stopped key
            part = self.publisher.publish_batch(
                wave, while_waiting=self._claim_ahead if i == 0 else None)
            sent.extend(m.row_id for m in wave if m.row_id not in part.held)
            if part.confirmed:
                self._confirmed_at = time.monotonic()
            result.confirmed |= part.confirmed
            result.failed.update(part.failed)
            result.suspect.update(part.suspect)
            result.transient = part.transient
            if part.complete(len(wave)):
                continue
            if part.transient is not None or not self.publisher.connected:
                break  # the batch is rolled back; the rest of each key waits
            stopped.update(m.ordering_key for m in wave
                           if m.ordering_key is not None and m.row_id not in part.confirmed)
        return result, sent

    def _set_aside(self, invalid: list[tuple[OutboxRow, str]], failed_early: dict[int, Failure],
                   rows: list[OutboxRow]) -> None:
        """A keyed row of the batch cannot go (it can never be published, or its exchange is
        missing) and newer rows of its key are in the batch: publishing them would put them
        first. Roll the claim back, publishing nothing, then dead-letter that row or count its
        attempt on its own; the next claim holds its key back (sql/queries.sql). The same for
        a row to dead-letter of DEAD_LETTER_COPY_MAX bytes or more: PostgreSQL moves it."""
        self.store.rollback()
        dead = set(self.store.dead_letter_rows({row.id: reason for row, reason in invalid}))
        self._log_dead_lettered([(row, error) for row, error in invalid if row.id in dead])
        if failed_early:
            self._settle(PublishResult(failed=dict(failed_early)), gid=None, published=[],
                         message_ids={row.id: row.message_id for row in rows})

    def _count_trace_dropped(self, messages: list[Message]) -> None:
        """Messages of a committed batch published without their row's malformed trace
        context (relay/messages.py)."""
        for message in messages:
            if type(message) is TracedMessage and message.trace_dropped is not None:
                self.metrics.trace_context_dropped.labels(message.trace_dropped).inc()

    def _log_dead_lettered(self, rows: list[tuple[OutboxRow, str]], *,
                           gid: str | None = None) -> None:
        """Rows that can never be published, now committed to the dead-letter table."""
        self.metrics.dead_lettered.labels(DeadLetterReason.INVALID).inc(len(rows))
        for row, error in rows:
            extra = {"action": "row_dead_lettered", "reason": DeadLetterReason.INVALID.value,
                     "row_id": row.id, "message_id": row.message_id}
            if gid is not None:
                extra["gid"] = gid
            log.warning("row dead-lettered: %s", error, extra=extra)

    def _claim_ahead(self) -> None:
        """Claim the next batch, and build its messages, while this one is confirmed: PostgreSQL's
        work and the relay's own overlap the broker's.

        The claim stays an open transaction, never prepared, until this batch is finished: a
        crash rolls it back with the session, so at most one batch is ever in doubt and only
        that batch can be duplicated. A failure is raised once this batch is finished.
        """
        if self.shutdown.requested:
            return
        # Both batches are in memory at once: the next one gets what this one left of the
        # byte budget (OUTBOX_BATCH_MAX_BYTES), and none if it used it all.
        budget = self.settings.batch_max_bytes - self._batch_bytes
        if budget <= 0:
            return
        gave_up = self.store.ahead_gave_up
        try:
            # Within what is left, strictly: no row beyond it, not even one (it would be a
            # second batch's worth of memory; the next batch claims it).
            rows = self._claim(budget, self._ahead_rows, one_row_at_least=False)
            if self.store.ahead_gave_up != gave_up:
                self._gave_up_ahead()
                return  # rolled back by the store: this batch finishes and frees the table
            if not rows:
                if self._batch_keyed:
                    self._ahead_rows = max(1, self.settings.batch_size // AHEAD_RESTART_SHARE)
                self.store.rollback()
                return
            if len(rows) >= self._ahead_rows:
                self._ahead_rows = min(2 * self._ahead_rows, self.settings.batch_size)
        except DatabaseError as exc:
            self._ahead = Ahead([], exc)
            return
        # Decoding and checking the rows (about a quarter of a relay's time per batch) done here
        # overlaps the broker's work on this batch instead of coming between two batches.
        try:
            built = self._build(rows)
        except Exception:
            # A bug, not a row (to_message refuses bad rows without raising): kept out of the
            # batch in flight; the next batch builds its rows again before its PREPARE, and
            # raises there.
            built = None
        self._ahead = Ahead(rows, built=built, frame_max=self.publisher.frame_max,
                            user_id=self.publisher.user_id)

    def _gave_up_ahead(self) -> None:
        """Someone asked for the whole table (a compaction's rewrite, DDL): the claim
        ahead did not queue behind that request while this batch holds the table."""
        self.metrics.claims_ahead_given_up.inc()
        log.debug("claim ahead gave up its wait: the table's whole lock is requested",
                  extra={"action": "claim_ahead_gave_up"})

    def _claim(self, max_bytes: int, limit: int | None = None, *,
               one_row_at_least: bool = True) -> list[OutboxRow]:
        s = self.settings
        return self.store.claim(limit or s.batch_size, max_bytes,
                                max_message_bytes=s.max_message_bytes,
                                one_row_at_least=one_row_at_least)

    def _waiting_for_standby(self, exc: StandbyWaitTimeout) -> None:
        """OUTBOX_STANDBY_WAIT's standby did not flush this batch's claim in time: nothing is
        published until it does (after a failover, until a standby is attached). A named state:
        a gauge, a counter, one WARNING when it starts (OutboxWaitingForStandby)."""
        self.metrics.standby_wait_timeouts.inc()
        if not self._standby_waiting:
            log.warning("waiting for a standby, publishing nothing: %s", exc,
                        extra={"action": "standby_wait_timeout"})
        self._standby_waiting = True
        self.metrics.waiting_for_standby.set(1)

    def _standby_caught_up(self) -> None:
        if self._standby_waiting:
            log.info("the standby flushed a batch's claim: publishing again",
                     extra={"action": "standby_caught_up"})
        self._standby_waiting = False
        self.metrics.waiting_for_standby.set(0)

    def _ledger_missing(self, exc: LedgerMissing) -> None:
        """The ledger stream (or its exchange) was deleted under us. Claim nothing more until it
        is declared again: dropping the connection makes the loop reconnect, which declares it,
        before the next batch; a relay never publishes with no ledger to record its batches."""
        log.warning("ledger missing, declaring it again before claiming more: %s", exc,
                    extra={"action": "ledger_missing"})
        self.metrics.ledger_missing.inc()
        self.publisher.close()

    def _build(self, rows: list[OutboxRow]) -> tuple[list[Message], list[tuple[OutboxRow, str]]]:
        """The messages of the rows the claim fetched, and those that can never be published."""
        messages: list[Message] = []
        invalid: list[tuple[OutboxRow, str]] = []
        frame_max, user_id = self.publisher.frame_max, self.publisher.user_id
        for row in rows:
            if row.dead_reason is not None:
                continue  # too big to fetch: the claim moved it to the dead-letter table
            built = to_message(row, max_bytes=self.settings.max_message_bytes,
                               frame_max=frame_max, ledger_stream=self.settings.ledger_stream,
                               user_id=user_id)
            if isinstance(built, Unpublishable):
                # Logged once the batch that moves it to the dead-letter table has committed.
                invalid.append((row, built.reason))
            else:
                messages.append(built)
        return messages, invalid

    def _next_gid(self) -> str:
        self._sequence += 1
        return str(Gid(self.settings.gid_prefix, self.instance, self._sequence))

    def _finish(self, gid: str, *, commit: bool, size: int, reason: str | None = None) -> bool:
        """COMMIT or ROLLBACK PREPARED; if PostgreSQL is gone, the decision waits in _unfinished.

        True when this call finished the transaction, False when it no longer existed. Logs one
        line: the outcome, the gid, the batch size and (for a rollback) why.
        """
        try:
            done = self.store.finish(gid, commit=commit)
        except ConnectionLost as exc:
            raise TransientError(f"PostgreSQL connection lost finishing {gid}") from exc
        self._unfinished = None
        if not done:
            # The resolver (or a race) finished it first, or (rolling back after a lost PREPARE
            # reply) it was never prepared: duplicates are possible, loss is not.
            log.warning("prepared batch already finished by someone else",
                        extra={"action": "batch_finished_elsewhere", "gid": gid, "batch_size": size})
            self.metrics.batches.labels(BatchOutcome.FINISHED_ELSEWHERE).inc()
            return False
        outcome = BatchOutcome.COMMITTED if commit else BatchOutcome.ROLLED_BACK
        self.metrics.batches.labels(outcome).inc()
        extra: dict[str, object] = {"action": f"batch_{outcome}", "gid": gid, "batch_size": size}
        if reason is not None:
            extra["reason"] = reason
        log.log(logging.DEBUG if commit else logging.WARNING, "batch %s",
                outcome.value.replace("_", " "),
                extra=extra)
        return True

    def _settle(self, result: PublishResult, *, gid: str | None, published: list[int],
                message_ids: dict[int, str]) -> None:
        """A failed batch was rolled back: forget what was delivered, count what failed."""
        failures = {**result.suspect, **result.failed}
        batch_size = len(published)
        # A suspect alone in its batch is the culprit; otherwise it is only retried alone. A
        # nacked one only while the broker confirms other messages (NACK_EVIDENCE_SECONDS).
        attributed = list(result.failed)
        if batch_size == 1:
            confirming = time.monotonic() - self._confirmed_at <= NACK_EVIDENCE_SECONDS
            attributed.extend(row_id for row_id, failure in result.suspect.items()
                              if failure.reason is not Reason.NACKED or confirming)
        lost = self._lost(result, published)
        if lost:
            failures.update(lost)
            if batch_size == 1:
                attributed.extend(lost)
        for failure in failures.values():
            self.metrics.row_failures.labels(failure.reason).inc()
        # The batch's reason: what the rollback was logged with.
        self.metrics.batch_failures.labels(
            result.transient.reason if result.transient else Reason.ROW_FAILURES).inc()
        s = self.settings
        dead = self.store.settle_failed(
            sorted(result.confirmed), {row_id: f.detail for row_id, f in failures.items()},
            attributed, max_attempts=s.max_attempts,
            base_delay=s.retry_base_delay, max_delay=s.retry_max_delay)
        for row_id, error in failures.items():
            extra = {"gid": gid, "row_id": row_id, "message_id": message_ids.get(row_id)}
            if row_id in dead:
                log.warning("row dead-lettered: %s", error, extra={
                    "action": "row_dead_lettered", "reason": DeadLetterReason.EXHAUSTED.value,
                    **extra})
            else:
                log.warning("row failed: %s", error, extra={"action": "row_failed", **extra})
        self.metrics.dead_lettered.labels(DeadLetterReason.EXHAUSTED).inc(len(dead))

    def _lost(self, result: PublishResult, published: list[int]) -> dict[int, Failure]:
        """After LOST_STREAK_LIMIT batches in a row lost the broker connection,
        an attempt for every row of this one whose fate is unknown: such rows are then claimed
        alone, and a row that loses the connection on its own runs out of attempts."""
        transient = result.transient
        # Not a confirm timeout: confirms that never come on a live connection are the broker's
        # failure (a quorum queue or the ledger without a majority), like a nack: an outage of
        # any length must not run rows out of attempts.
        if (transient is None or not transient.in_flight_lost
                or transient.reason is Reason.CONFIRM_TIMEOUT):
            return {}
        self._lost_streak += 1
        if self._lost_streak < LOST_STREAK_LIMIT:
            return {}
        reason = Failure(transient.reason,
                         f"{transient.detail} ({self._lost_streak} batches in a row)")
        known = result.confirmed | result.failed.keys() | result.suspect.keys()
        return {row_id: reason for row_id in published if row_id not in known}

    # -- the loop -----------------------------------------------------------------------------

    def log_fields(self) -> dict[str, object]:
        return {"instance": self.instance_name}

    def turn(self) -> float | None:
        """Connect if need be, relay one batch; pause as long as the outbox looks empty."""
        self.ensure_connected()
        if self.shutdown.requested:
            return None
        claimed = self.run_batch()
        self._refresh_stats()
        s = self.settings
        if claimed >= s.batch_size or self.claimed_ahead:
            self._idle = s.poll_min_interval
            return None  # more rows are waiting
        if claimed:
            self._idle = s.poll_min_interval
        else:
            # Doubling from zero stays zero: start empty-poll waits at 1 ms at least.
            self._idle = min(max(self._idle * 2, s.poll_min_interval, 0.001), s.poll_max_interval)
        return self._idle

    def pause(self, seconds: float) -> None:
        self.publisher.idle(seconds)  # answers the broker's heartbeats meanwhile

    def run(self) -> None:
        if self._background_stats:
            self.stats.start()
        super().run()

    def close(self) -> None:
        self.stats.stop()
        self._ahead = None  # closing the claim session rolls its claim back
        self.store.close()
        self.publisher.close()

    def on_fault(self, exc: BaseException, failures: int = 1) -> None:
        """A server failed us mid-loop: reset what is unusable (the loop backs off next)."""
        # Closed or reset below: a claim made ahead is rolled back with its session.
        self._ahead = None
        if isinstance(exc, ConnectionLost):
            self.store.close()
        else:
            self.store.reset()  # roll back an open claim so the rows are free again
        if not self.publisher.connected:
            self.publisher.close()
        # Not ready from now on, not only once the next turn notices (after the backoff below).
        for server, client in ((Server.POSTGRESQL, self.store), (Server.RABBITMQ, self.publisher)):
            if not client.connected:
                self.health.set_check(server, "connection lost; reconnecting")
        if isinstance(exc, DatabaseError) and not isinstance(exc, ConnectionLost):
            log.error("database error: %s", describe(exc), extra={"action": "database_error"})
        else:
            log.debug("connection fault: %s", exc, extra={"action": "connection_fault"})

    def ensure_connected(self) -> None:
        for server, client, connect in (
            (Server.POSTGRESQL, self.store,
             lambda: self.store.connect(self.lock_class, self.instance)),
            (Server.RABBITMQ, self.publisher, self.publisher.connect),
        ):
            if client.connected:
                continue
            if server is Server.RABBITMQ and self._ahead is not None:
                # The rows claimed ahead wait in an open transaction. A broker outage can last
                # minutes, and a transaction open that long holds back VACUUM on every table
                # (and would be the oldest session OutboxVacuumHeldBySession reports): free
                # them now and claim again once connected.
                self._ahead = None
                self.store.rollback()
            self._mark_down(server)
            self._retrying(server)(connect)
            self._mark_up(server)
        if self._unfinished is not None:
            gid, commit, size = self._unfinished.gid, self._unfinished.commit, self._unfinished.size
            self._finish(gid, commit=commit, size=size,
                         reason="decided before the PostgreSQL connection was lost")

    def _retrying(self, server: Server) -> tenacity.Retrying:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self._connections.failed(server, exc)
            self.health.set_check(server, "reconnecting", exc)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientError),
            wait=backoff.wait(self.settings.reconnect_max_delay),
            stop=lambda _state: self.shutdown.requested,
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )

    def _mark_down(self, server: Server) -> None:
        self.metrics.connected.labels(server).set(0)
        self.health.set_check(server, "not connected")
        self._connections.down(server)

    def _mark_up(self, server: Server) -> None:
        self.metrics.connected.labels(server).set(1)
        self.health.set_check(server, None)
        self._connections.up(server)

    def _refresh_stats(self) -> None:
        """The loop's part of the stats: move the rows never due that the last pass counted
        (on the main session, between batches). The passes run on their thread; without one,
        here when due. And every OUTBOX_STATS_INTERVAL a trivial statement on the main
        session, which the stats query kept from idling before it moved to a session of its
        own: an idle relay's main session must not outlive the role's idle_session_timeout
        (it holds the instance lock; docs/operations.md)."""
        now = time.monotonic()
        if now >= self._next_keepalive:
            self._next_keepalive = now + self.settings.stats_interval
            self.store.keepalive()
        if not self._background_stats:
            self.stats.run_due()
        if self._never_due.is_set():
            self._never_due.clear()
            self._dead_letter_never_due()

    def _stats_pass(self) -> None:
        """One stats pass, on the stats thread: the backlog and lag gauges, whether rows never
        due wait, and the claims' safety net: a full pass that sees a row that is not parked
        at or below the claim marks' floor (it came back there after the floor moved, or a
        producer made a parked row due) has the next claim look from below it
        (ClaimMarks.check_floor)."""
        source = self._stats_session.get()
        after, full = self._stats_floor.start()
        stats = source.stats(after, self._stats_floor.floor)
        backlog, lag = self._stats_floor.export(stats, full=full)
        self.metrics.backlog.set(backlog)
        self.metrics.lag.set(lag)
        if stats.never_due:
            self._never_due.set()
        if full:  # a parked row may lie below the floor (relay/marks.py)
            self.store.marks.check_floor(stats)

    def _dead_letter_never_due(self) -> None:
        """Rows a producer delayed to the year 10000 or later ('infinity') are never due: moved
        to the dead-letter table, where they are seen (a keyed one would otherwise hold its key
        forever, unseen) and `dead-letter requeue` makes them due now."""
        moved = self.store.dead_letter_never_due(self.settings.batch_size)
        self.metrics.dead_lettered.labels(DeadLetterReason.INVALID).inc(len(moved))
        for row_id, message_id, reason in moved:
            log.warning("row dead-lettered: %s", reason, extra={
                "action": "row_dead_lettered", "reason": DeadLetterReason.INVALID.value,
                "row_id": row_id, "message_id": message_id})
