"""The relay's Prometheus metrics, on a registry of its own (docs/operations.md's table is
generated from it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from outbox_relay.model import BatchOutcome, DeadLetterReason, Reason
from outbox_relay.rules import TRACE_HEADERS
from outbox_relay.runtime.metrics import SERVERS, standard_collectors, version

# Why rows of a rolled-back batch failed (each such row got an attempt): the broker refused it
# (unroutable return, nack, no such exchange), closed the channel before confirming it, or
# closed the whole connection for a frame it refused (connection_closed); pika could not encode
# it (unencodable); or the batch lost its connection or its confirms several times in a row
# (connection_lost, confirm_timeout: every unconfirmed row then counts an attempt).
ROW_FAILURE_REASONS = (Reason.UNROUTABLE, Reason.NACKED, Reason.EXCHANGE_NOT_FOUND,
                       Reason.CHANNEL_CLOSED, Reason.CONNECTION_CLOSED, Reason.UNENCODABLE,
                       Reason.CONNECTION_LOST, Reason.CONFIRM_TIMEOUT)

# Why a batch was rolled back: some of its rows failed (above), or the connection, a confirm
# timeout or the ledger record failed the whole batch.
BATCH_FAILURE_REASONS = (Reason.ROW_FAILURES, Reason.CONNECTION_LOST, Reason.CONFIRM_TIMEOUT,
                         Reason.LEDGER)

BATCH_OUTCOMES = tuple(BatchOutcome)

DEAD_LETTER_REASONS = tuple(DeadLetterReason)

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def batch_duration_buckets(confirm_timeout: float) -> tuple[float, ...]:
    """Histogram buckets up to twice the confirm timeout: a batch waits at most that long for
    its confirms and then for its ledger record's, so the slowest batches land in a bucket of
    their own rather than all in +Inf."""
    longest = 2 * confirm_timeout
    return tuple(sorted({b for b in _DURATION_BUCKETS if b < confirm_timeout}
                        | {confirm_timeout, longest}))


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *,
                 confirm_timeout: float = 30.0) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        standard_collectors(r)
        self.build_info = Info(
            "outbox_relay_build", "The relay's version (value 1)", registry=r)
        self.build_info.info({"version": version()})
        self.events_published = Counter(
            "outbox_relay_events_published_total",
            "Events confirmed by the broker in committed batches", registry=r)
        self.claims_ahead_given_up = Counter(
            "outbox_relay_claims_ahead_given_up_total",
            "Claims made ahead (while a batch waits for its confirms) that gave up after 10 ms "
            "waiting behind a request for the whole table (a compaction's rewrite, DDL)", registry=r)
        self.batches = Counter(
            "outbox_relay_batches_total", "Batches by outcome", ["outcome"], registry=r)
        self.batch_duration = Histogram(
            "outbox_relay_batch_duration_seconds",
            "Claim to COMMIT/ROLLBACK PREPARED; buckets reach twice OUTBOX_CONFIRM_TIMEOUT (a "
            "batch's confirms, then its ledger record's)",
            buckets=batch_duration_buckets(confirm_timeout), registry=r)
        self.batch_size = Histogram(
            "outbox_relay_batch_size_events", "Rows per claimed batch",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2500, 5000), registry=r)
        self.row_failures = Counter(
            "outbox_relay_row_failures_total",
            "Rows of rolled-back batches that failed, by reason: refused by the broker, "
            "unconfirmed when it closed the channel or (for a frame it refused) the connection, "
            "not encodable by pika, or unconfirmed in the third batch in a row that lost its "
            "connection or confirms; each got an attempt, so the sum is the attempts counted",
            ["reason"], registry=r)
        self.batch_failures = Counter(
            "outbox_relay_batch_failures_total",
            "Batches rolled back after a failed publish, by reason: some of their rows failed "
            "(row_failures) or the whole batch did; "
            "the sum is the failed batches", ["reason"], registry=r)
        self.dead_lettered = Counter(
            "outbox_relay_dead_lettered_total",
            "Rows moved to the dead-letter table (invalid: never publishable; exhausted: out of "
            "attempts)", ["reason"], registry=r)
        self.reconnects = Counter(
            "outbox_relay_reconnects_total", "Successful reconnections, by server", ["server"],
            registry=r)
        self.ledger_missing = Counter(
            "outbox_relay_ledger_missing_total",
            "Times the ledger stream or its exchange was found deleted; the relay claims nothing "
            "until it has declared it again", registry=r)
        self.connected = Gauge(
            "outbox_relay_connected", "1 while connected to the server", ["server"], registry=r)
        self.lag = Gauge(
            "outbox_relay_lag_seconds",
            "How late the oldest unpublished outbox row is: its age since it was due (created_at, "
            "or a producer's later available_at: a row delayed on purpose is not late before "
            "its time), as this relay sees it (every relay runs the same table-wide query every "
            "OUTBOX_STATS_INTERVAL)", registry=r)
        self.backlog = Gauge(
            "outbox_relay_backlog_events",
            "Rows waiting in the outbox, as this relay sees it (the same query)", registry=r)
        self.waiting_for_standby = Gauge(
            "outbox_relay_waiting_for_standby",
            "1 while this relay publishes nothing because the standby OUTBOX_STANDBY_WAIT names "
            "did not flush its last batch's claim within OUTBOX_STANDBY_WAIT_TIMEOUT (after a "
            "failover: no standby yet); 0 once a batch passed the wait, the outbox is empty, or "
            "the wait is off", registry=r)
        self.standby_wait_timeouts = Counter(
            "outbox_relay_standby_wait_timeouts_total",
            "Batches rolled back, nothing published, because the standby did not flush their "
            "claim within OUTBOX_STANDBY_WAIT_TIMEOUT", registry=r)
        self.trace_context_dropped = Counter(
            "outbox_relay_trace_context_dropped_total",
            "Events published without the trace context their row carried, by header: a "
            "malformed traceparent (its tracestate goes with it) or tracestate (or one without "
            "a traceparent), left out of the message; the event itself is published",
            ["header"], registry=r)
        self.last_loop = Gauge(
            "outbox_relay_last_loop_timestamp_seconds", "When the relay loop last turned",
            registry=r)
        for reason in ROW_FAILURE_REASONS:
            self.row_failures.labels(reason)
        for reason in BATCH_FAILURE_REASONS:
            self.batch_failures.labels(reason)
        for outcome in BATCH_OUTCOMES:
            self.batches.labels(outcome)
        for dead_reason in DEAD_LETTER_REASONS:
            self.dead_lettered.labels(dead_reason)
        for header in TRACE_HEADERS:
            self.trace_context_dropped.labels(header)
        for server in SERVERS:
            self.reconnects.labels(server)
            self.connected.labels(server)
