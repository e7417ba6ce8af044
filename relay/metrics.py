"""Prometheus metrics of both programs, each on its own registry, and the HTTP server that
serves them at /metrics next to the /healthz and /readyz probes."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    make_wsgi_app,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from relay import __version__
from relay.errors import ConfigError
from relay.health import Health
from relay.model import BatchOutcome, DeadLetterReason, Decision, Reason, Server

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment
    from _typeshed.wsgi import WSGIApplication as WSGIApp

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
SERVERS = tuple(Server)
DECISIONS = tuple(Decision)
# Why the resolver ignored a ledger record naming an in-doubt batch.
LEDGER_REJECTIONS = ("unauthenticated", "other_transaction")

# Who keeps the oldest transaction id alive: our prepared batches, anyone else's prepared
# transactions, sessions (running transactions and snapshots), replication slots.
HORIZON_HOLDERS = ("outbox_prepared", "other_prepared", "session", "replication_slot")

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def batch_duration_buckets(confirm_timeout: float) -> tuple[float, ...]:
    """Histogram buckets up to twice the confirm timeout: a batch waits at most that long for
    its confirms and then for its ledger record's, so the slowest batches land in a bucket of
    their own rather than all in +Inf."""
    longest = 2 * confirm_timeout
    return tuple(sorted({b for b in _DURATION_BUCKETS if b < confirm_timeout}
                        | {confirm_timeout, longest}))


def version() -> str:
    """The version the build_info metrics report: relay.__version__, written in one place."""
    return __version__


def _standard_collectors(registry: CollectorRegistry) -> None:
    """What every Prometheus client exports by default (process_* RSS, CPU, open files;
    python_info; python_gc_*), on this program's own registry."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


@dataclass(frozen=True)
class Described:
    """One metric family as the docs show it (docs/operations.md is generated from these)."""

    name: str  # as exposed: counters with _total, info with _info
    type: str
    help: str
    labels: tuple[str, ...]
    label_values: dict[str, tuple[str, ...]]  # the values the code pre-declares


def describe(registry: CollectorRegistry) -> list[Described]:
    """The outbox_* metric families of a registry, in the order they were created."""
    found = []
    for family in registry.collect():
        if not family.name.startswith("outbox_"):
            continue  # the standard process_*, python_* collectors
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        labels: dict[str, list[str]] = {}
        for sample in family.samples:
            for label, value in sample.labels.items():
                if label != "le" and value not in labels.setdefault(label, []):
                    labels[label].append(value)
        values = {} if family.type == "info" else {k: tuple(v) for k, v in labels.items() if v}
        found.append(Described(family.name + suffix, family.type, family.documentation,
                               tuple(labels), values))
    return found


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *,
                 confirm_timeout: float = 30.0) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        _standard_collectors(r)
        self.build_info = Info(
            "outbox_relay_build", "The relay's version (value 1)", registry=r)
        self.build_info.info({"version": version()})
        self.events_published = Counter(
            "outbox_relay_events_published_total",
            "Events confirmed by the broker in committed batches", registry=r)
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
            "Age of the oldest unpublished outbox row, as this relay sees it (every relay runs "
            "the same table-wide query every OUTBOX_STATS_INTERVAL)", registry=r)
        self.backlog = Gauge(
            "outbox_relay_backlog_events",
            "Rows waiting in the outbox, as this relay sees it (the same query)", registry=r)
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
        for server in SERVERS:
            self.reconnects.labels(server)
            self.connected.labels(server)


class ResolverMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        _standard_collectors(r)
        self.build_info = Info(
            "outbox_resolver_build", "The resolver's version (value 1)", registry=r)
        self.build_info.info({"version": version()})
        self.lag = Gauge(
            "outbox_lag_seconds",
            "Age of the oldest unpublished row of OUTBOX_TABLE, from one table-wide query every "
            "OUTBOX_STATS_INTERVAL however many relays run (NaN while the query fails)",
            registry=r)
        self.backlog = Gauge(
            "outbox_backlog_events",
            "Rows waiting in OUTBOX_TABLE (the same query; NaN while it fails)", registry=r)
        self.blocked_keys = Gauge(
            "outbox_blocked_keys",
            "Ordering keys held back behind a dead letter: none of their rows is published "
            "until the dead letter is requeued or discarded (the same schedule; NaN while it "
            "fails)", registry=r)
        self.in_doubt = Gauge(
            "outbox_prepared_transactions",
            "Prepared transactions of this gid prefix (in doubt or in flight)", registry=r)
        self.oldest_age = Gauge(
            "outbox_prepared_oldest_age_seconds",
            "Age of the oldest prepared transaction of this gid prefix; it holds its rows' locks "
            "and may hold back VACUUM", registry=r)
        self.holding_vacuum = Gauge(
            "outbox_prepared_holding_vacuum_age_seconds",
            "Age of our oldest prepared transaction while it is what holds back this database's "
            "xmin horizon (VACUUM cannot remove rows deleted after it); 0 while nothing of ours, "
            "or something older, holds it", registry=r)
        self.session_transaction_age = Gauge(
            "outbox_session_transaction_age_seconds",
            "Age of the oldest open transaction or snapshot of another client session in this "
            "database: while it lives VACUUM removes no outbox row deleted after it began, and "
            "each claim walks the dead rows (OutboxVacuumHeldBySession); 0 while there is none",
            registry=r)
        self.horizon_age = Gauge(
            "outbox_xmin_horizon_age_transactions",
            "Age in transactions (age(xid)) of the oldest transaction id each kind of holder keeps "
            "alive in this database: outbox_prepared (our gid prefix), other_prepared, session "
            "(open transactions and snapshots; other databases' sessions only hold back shared "
            "catalogs and are left out), replication_slot; the largest is the xmin horizon",
            ["holder"], registry=r)
        self.decisions = Counter(
            "outbox_resolver_decisions_total", "In-doubt transactions finished, by outcome",
            ["outcome"], registry=r)
        self.scans = Counter(
            "outbox_resolver_scans_total", "Completed scans of pg_prepared_xacts", registry=r)
        self.scan_errors = Counter(
            "outbox_resolver_scan_errors_total", "Scans that failed (retried with backoff)",
            registry=r)
        self.ledger_rejected = Counter(
            "outbox_resolver_ledger_records_rejected_total",
            "Ledger records naming an in-doubt batch that prove nothing about it, by reason "
            "(unauthenticated: not signed with the ledger key, a forgery; other_transaction: "
            "signed for another xid or database); each is ignored and counted once",
            ["reason"], registry=r)
        self.reconnects = Counter(
            "outbox_resolver_reconnects_total", "Successful reconnections, by server", ["server"],
            registry=r)
        self.last_scan = Gauge(
            "outbox_resolver_last_scan_timestamp_seconds", "When the last scan completed",
            registry=r)
        self.last_loop = Gauge(
            "outbox_resolver_last_loop_timestamp_seconds",
            "When the resolver loop last turned (a scan, successful or not)", registry=r)
        for holder in HORIZON_HOLDERS:
            self.horizon_age.labels(holder)
        for outcome in DECISIONS:
            self.decisions.labels(outcome)
        for reason in LEDGER_REJECTIONS:
            self.ledger_rejected.labels(reason)
        for server in SERVERS:
            self.reconnects.labels(server)


# Seconds a client of the metrics port may take to send its request or read the answer: a
# stuck or malicious client holds one thread for at most this long, never the port.
CONNECTION_TIMEOUT = 10.0


def serve(registry: CollectorRegistry, host: str, port: int,
          health: Health | None = None) -> WSGIServer | None:
    """Serve /metrics (prometheus_client's own WSGI app: content negotiation, ``name[]``, gzip)
    and, given ``health``, /healthz and /readyz, from a daemon thread.

    Port 0 disables it. Returns the server (tests shut it down), or None when disabled.
    """
    if not port:
        return None
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]

        class Server(_Server):
            address_family = family  # IPv4 or IPv6, whichever the host is

        server: WSGIServer = make_server(host, port, app(registry, health), Server, _Handler)
    except OSError as exc:
        raise ConfigError(
            f"OUTBOX_METRICS_PORT {port} on {host!r} cannot be served: {exc.strerror}") from exc
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server


def app(registry: CollectorRegistry, health: Health | None) -> WSGIApp:
    """The WSGI application: /metrics, /healthz and /readyz, 404 elsewhere."""
    metrics_app = make_wsgi_app(registry)

    def application(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if health is not None and path in ("/healthz", "/readyz"):
            if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
                return _answer(start_response, "405 Method Not Allowed", "text/plain; charset=utf-8",
                               b"use GET\n", [("Allow", "GET, HEAD")])
            if path == "/healthz":
                live, detail = health.liveness()
                return _answer(start_response, "200 OK" if live else "503 Service Unavailable",
                               "text/plain; charset=utf-8", (detail + "\n").encode())
            ready, checks = health.readiness()
            body = json.dumps({"ready": ready, "checks": checks}, sort_keys=True) + "\n"
            return _answer(start_response, "200 OK" if ready else "503 Service Unavailable",
                           "application/json", body.encode())
        return _answer(start_response, "404 Not Found", "text/plain; charset=utf-8",
                       b"not found: try /metrics\n")

    return application


def _answer(start_response: StartResponse, status: str, content_type: str, body: bytes,
            headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))),
                            *(headers or [])])
    return [body]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck client never keeps the program from exiting

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is not worth a traceback on stderr."""


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not worth a log line each."""
