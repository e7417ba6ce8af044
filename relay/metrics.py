"""Prometheus metrics of both programs, each on its own registry (served at /metrics)."""

from __future__ import annotations

import gzip
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from relay.errors import ConfigError
from relay.health import Health

FAILURE_REASONS = (
    "unroutable",
    "nacked",
    "exchange_not_found",
    "channel_closed",
    "connection_lost",
    "confirm_timeout",
    "ledger",
)

# Who keeps the oldest transaction id alive: our prepared batches, anyone else's prepared
# transactions, sessions (running transactions and snapshots), replication slots.
HORIZON_HOLDERS = ("outbox_prepared", "other_prepared", "session", "replication_slot")


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
            "outbox_relay_publish_failures_total",
            "Failed rows (unroutable, nacked, exchange_not_found, channel_closed) or batches "
            "(connection_lost, confirm_timeout, ledger), by reason",
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
        self.horizon_age = Gauge(
            "outbox_xmin_horizon_age_transactions",
            "Age in transactions (age(xid)) of the oldest transaction id each kind of holder keeps "
            "alive in this database; the largest is the xmin horizon VACUUM cannot pass",
            ["holder"], registry=r)
        self.holding_vacuum = Gauge(
            "outbox_prepared_holding_vacuum_age_seconds",
            "Age of our oldest prepared transaction while it is what holds back this database's "
            "xmin horizon (VACUUM); 0 while nothing of ours or something older holds it",
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
        self.last_loop = Gauge(
            "outbox_resolver_last_loop_timestamp_seconds",
            "When the resolver loop last turned (a scan, successful or not)", registry=r)
        for holder in HORIZON_HOLDERS:
            self.horizon_age.labels(holder)
        for outcome in ("committed", "rolled_back", "already_finished"):
            self.decisions.labels(outcome)
        for server in ("postgresql", "rabbitmq"):
            self.reconnects.labels(server)


def serve(registry: CollectorRegistry, host: str, port: int,
          health: Health | None = None) -> ThreadingHTTPServer | None:
    """Serve /metrics (and, given ``health``, /healthz and /readyz) in a daemon thread.

    Port 0 disables it. Returns the server (tests shut it down), or None when disabled.
    """
    if not port:
        return None
    try:
        server = _Server(host, port, registry, health)
    except OSError as exc:
        raise ConfigError(
            f"OUTBOX_METRICS_PORT {port} on {host!r} cannot be served: {exc.strerror}") from exc
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 health: Health | None) -> None:
        # IPv4 or IPv6, whichever the host is (as prometheus_client's own server does).
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        self.address_family = infos[0][0]
        self.registry = registry
        self.health = health
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        health = self.server.health
        if url.path == "/metrics":
            self._metrics(parse_qs(url.query))
        elif url.path == "/healthz" and health is not None:
            live, detail = health.liveness()
            self._send(200 if live else 503, "text/plain; charset=utf-8",
                       (detail + "\n").encode())
        elif url.path == "/readyz" and health is not None:
            ready, checks = health.readiness()
            body = json.dumps({"ready": ready, "checks": checks}, sort_keys=True) + "\n"
            self._send(200 if ready else 503, "application/json", body.encode())
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")

    def _metrics(self, params: dict[str, list[str]]) -> None:
        """What prometheus_client's own server answers: content negotiation, name[], gzip."""
        registry = self.server.registry
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        names = params.get("name[]")
        output = encoder(registry.restricted_registry(names) if names else registry)
        headers = {}
        if "gzip" in self.headers.get("Accept-Encoding", ""):
            output = gzip.compress(output)
            headers["Content-Encoding"] = "gzip"
        self._send(200, content_type, output, headers)

    def _send(self, status: int, content_type: str, body: bytes,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes and probes are not worth a log line each."""
