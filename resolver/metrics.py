"""The resolver's Prometheus metrics, on a registry of its own (docs/operations.md's table is
generated from it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from outbox_relay import ledger
from outbox_relay.model import Decision
from outbox_relay.resolver.compaction import OUTCOMES
from outbox_relay.runtime.metrics import SERVERS, standard_collectors, version

DECISIONS = tuple(Decision)

# Why the resolver ignored a ledger record (outbox_relay/ledger.py).
LEDGER_REJECTIONS = ledger.REJECTIONS

# Why the resolver leaves alone a prepared transaction of its gid prefix that no relay made: gid
# (not a gid a relay makes: another format, an instance of 2^31 or more, a sequence of 2^63 or
# more), owner (prepared by a role that cannot read the ledger key, as every relay's role can).
FOREIGN_REASONS = ("gid", "owner")

# Who keeps the oldest transaction id alive: our prepared batches, anyone else's prepared
# transactions, sessions (running transactions and snapshots), replication slots.
HORIZON_HOLDERS = ("outbox_prepared", "other_prepared", "session", "replication_slot")

# The outbox's parts on disk, and what a compaction after a held snapshot came to
# (outbox_relay/resolver/compaction.py).
TABLE_PARTS = ("heap", "indexes")
COMPACTIONS = OUTCOMES


class ResolverMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        standard_collectors(r)
        self.build_info = Info(
            "outbox_resolver_build", "The resolver's version (value 1)", registry=r)
        self.build_info.info({"version": version()})
        self.lag = Gauge(
            "outbox_lag_seconds",
            "How late the oldest unpublished row of OUTBOX_TABLE is (its age since it was due: "
            "created_at, or a producer's later available_at), from one table-wide query every "
            "OUTBOX_STATS_INTERVAL however many relays run (NaN while the query fails)",
            registry=r)
        self.backlog = Gauge(
            "outbox_backlog_events",
            "Rows waiting in OUTBOX_TABLE (the same query; NaN while it fails)", registry=r)
        self.blocked_keys = Gauge(
            "outbox_blocked_keys",
            "Ordering keys held back behind a dead letter (a row never due, available_at "
            "'infinity', is one too): none of their rows is published until the dead letter is "
            "requeued or discarded (the same schedule; NaN while it fails)", registry=r)
        self.in_doubt = Gauge(
            "outbox_prepared_transactions",
            "Prepared transactions of this gid prefix in this database (in doubt or in flight; "
            "foreign ones included)", registry=r)
        self.oldest_age = Gauge(
            "outbox_prepared_oldest_age_seconds",
            "Age of the oldest prepared transaction of this gid prefix (foreign ones included); "
            "it holds its rows' locks and may hold back VACUUM", registry=r)
        self.foreign_prepared = Gauge(
            "outbox_resolver_foreign_prepared_transactions",
            "Prepared transactions of this gid prefix in this database that no relay made, left "
            "alone, by reason (gid: not a gid a relay makes; owner: prepared by a role that "
            "cannot read the ledger key); they hold their locks and VACUUM until someone "
            "finishes them by hand", ["reason"], registry=r)
        self.server_prepared = Gauge(
            "outbox_server_prepared_transactions",
            "Prepared transactions of the whole PostgreSQL server, of every database, role and "
            "gid (the relays' in flight included): they take the server's "
            "max_prepared_transactions slots, and with every slot taken no relay can PREPARE",
            registry=r)
        self.server_prepared_slots = Gauge(
            "outbox_server_max_prepared_transactions",
            "The server's max_prepared_transactions: its prepared-transaction slots",
            registry=r)
        self.holding_vacuum = Gauge(
            "outbox_prepared_holding_vacuum_age_seconds",
            "Age of our oldest prepared transaction (of this gid prefix, foreign ones included) "
            "while it is what holds back this database's xmin horizon (VACUUM cannot remove rows "
            "deleted after it); 0 while nothing of ours, or something older, holds it",
            registry=r)
        self.session_transaction_age = Gauge(
            "outbox_session_transaction_age_seconds",
            "Age of the oldest open transaction or snapshot of another client session in this "
            "database (from its start, or, where PostgreSQL hides that from this role, from when "
            "the scans first saw it): while it lives VACUUM removes no outbox row deleted after "
            "it began, and the table grows (OutboxVacuumHeldBySession); 0 while there is none",
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
        self.table_bytes = Gauge(
            "outbox_table_bytes",
            "The outbox's size on disk, by part: heap (with its TOAST) and indexes; read every "
            "OUTBOX_STATS_INTERVAL. It grows while a snapshot holds VACUUM back and stays so "
            "after, until compacted", ["part"], registry=r)
        self.compactions = Counter(
            "outbox_resolver_compactions_total",
            "The resolver's compactions after a held snapshot ended, by outcome: compacted, "
            "failed (tried again a minute later, 10 tries), not_allowed (this role may not "
            "rewrite the table), not_needed (below OUTBOX_RESOLVER_COMPACT_ABOVE)",
            ["outcome"], registry=r)
        self.scans = Counter(
            "outbox_resolver_scans_total", "Completed scans of pg_prepared_xacts", registry=r)
        self.scan_errors = Counter(
            "outbox_resolver_scan_errors_total", "Scans that failed (retried with backoff)",
            registry=r)
        self.ledger_rejected = Counter(
            "outbox_resolver_ledger_records_rejected_total",
            "Ledger records the resolver ignored, by reason: naming an in-doubt batch, "
            "unauthenticated (no valid signature of the ledger key: a forgery), other_key (no "
            "valid signature, and the key id of another key: a key replaced since, or relays of "
            "another table) or other_transaction (signed for another xid or database); "
            "malformed (not a ledger record's JSON, or a "
            "record of an in-doubt batch whose fields cannot be checked) or oversized (over "
            f"{ledger.MAX_RECORD_BYTES} bytes, not read); each is counted once",
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
        for part in TABLE_PARTS:
            self.table_bytes.labels(part)
        for compaction in COMPACTIONS:
            self.compactions.labels(compaction)
        for reason in FOREIGN_REASONS:
            self.foreign_prepared.labels(reason)
        for reason in LEDGER_REJECTIONS:
            self.ledger_rejected.labels(reason)
        for server in SERVERS:
            self.reconnects.labels(server)
