"""Prometheus metrics of both programs, each on its own registry (served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from relay.errors import ConfigError

FAILURE_REASONS = (
    "unroutable",
    "nacked",
    "exchange_not_found",
    "channel_closed",
    "connection_lost",
    "confirm_timeout",
    "ledger",
)


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events_published = Counter(
            "outbox_relay_events_published_total",
            "Events confirmed by the broker in committed batches", registry=r)
        self.batches = Counter(
            "outbox_relay_batches_total", "Batches by outcome", ["outcome"], registry=r)
        self.batch_duration = Histogram(
            "outbox_relay_batch_duration_seconds", "Claim to COMMIT/ROLLBACK PREPARED",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.batch_size = Histogram(
            "outbox_relay_batch_size_events", "Rows per claimed batch",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2500, 5000), registry=r)
        self.failures = Counter(
            "outbox_relay_publish_failures_total", "Rows that failed to publish, by reason",
            ["reason"], registry=r)
        self.dead_lettered = Counter(
            "outbox_relay_dead_lettered_total",
            "Rows moved to the dead-letter table (invalid: never publishable; exhausted: out of "
            "attempts)", ["reason"], registry=r)
        self.reconnects = Counter(
            "outbox_relay_reconnects_total", "Successful reconnections", ["server"], registry=r)
        self.connected = Gauge(
            "outbox_relay_connected", "1 while connected to the server", ["server"], registry=r)
        self.lag = Gauge(
            "outbox_relay_lag_seconds", "Age of the oldest unpublished outbox row", registry=r)
        self.backlog = Gauge(
            "outbox_relay_backlog_events", "Rows waiting in the outbox", registry=r)
        self.last_loop = Gauge(
            "outbox_relay_last_loop_timestamp_seconds", "When the relay loop last turned",
            registry=r)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        for outcome in ("committed", "rolled_back", "finished_elsewhere"):
            self.batches.labels(outcome)
        for reason in ("invalid", "exhausted"):
            self.dead_lettered.labels(reason)
        for server in ("postgresql", "rabbitmq"):
            self.reconnects.labels(server)
            self.connected.labels(server)


class ResolverMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.in_doubt = Gauge(
            "outbox_prepared_transactions", "Prepared transactions of this gid prefix", registry=r)
        self.oldest_age = Gauge(
            "outbox_prepared_oldest_age_seconds",
            "Age of the oldest prepared transaction of this gid prefix (holds back VACUUM)",
            registry=r)
        self.decisions = Counter(
            "outbox_resolver_decisions_total", "In-doubt transactions finished, by outcome",
            ["outcome"], registry=r)
        self.scans = Counter(
            "outbox_resolver_scans_total", "Completed scans of pg_prepared_xacts", registry=r)
        self.scan_errors = Counter(
            "outbox_resolver_scan_errors_total", "Scans that failed (and are retried)", registry=r)
        self.reconnects = Counter(
            "outbox_resolver_reconnects_total", "Successful reconnections", ["server"], registry=r)
        self.last_scan = Gauge(
            "outbox_resolver_last_scan_timestamp_seconds", "When the last scan completed",
            registry=r)
        for outcome in ("committed", "rolled_back", "already_finished"):
            self.decisions.labels(outcome)
        for server in ("postgresql", "rabbitmq"):
            self.reconnects.labels(server)


def serve(registry: CollectorRegistry, host: str, port: int) -> None:
    """Serve /metrics in a daemon thread; port 0 disables it."""
    if not port:
        return
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"OUTBOX_METRICS_PORT {port} on {host!r} cannot be served: {exc.strerror}") from exc
