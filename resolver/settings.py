"""The resolver's settings (``outbox-resolver``): its own options, and the settings dataclass
made of them and of the options both programs read (outbox_relay.runtime.options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox_relay.runtime.options import (
    AMQP_URL,
    CONNECT_TIMEOUT,
    DATABASE_URL,
    GID_PREFIX,
    LEDGER_MAX_AGE,
    LEDGER_STREAM,
    LOG_FORMAT,
    LOG_LEVEL,
    METRICS_HOST,
    METRICS_PORT_HELP,
    RECONNECT_MAX_DELAY,
    STATS_INTERVAL,
    TABLE,
    Option,
    non_negative_float,
    options_of,
    port,
    positive_float,
)

RESOLVER_METRICS_PORT = Option(
    "metrics_port", "OUTBOX_METRICS_PORT", port, "9461", METRICS_PORT_HELP)

RESOLVER_INTERVAL = Option(
    "interval", "OUTBOX_RESOLVER_INTERVAL", positive_float, "2",
    "seconds between scans of pg_prepared_xacts",
)

RESOLVER_WATCH_INTERVAL = Option(
    "watch_interval", "OUTBOX_RESOLVER_WATCH_INTERVAL", non_negative_float, "0.1",
    "seconds between the resolver's checks for a relay that died holding a prepared batch "
    "(one query on its own connection; the scan follows at once); 0 turns the check off",
    doc="how fast a dead relay's batch is taken over: [operations.md](operations.md#the-resolver-watch)",
)

RESOLVER_HARD_LIMIT = Option(
    "hard_limit", "OUTBOX_RESOLVER_HARD_LIMIT", positive_float, "300",
    "resolve a prepared batch older than this many seconds even if its relay looks alive",
)

LEDGER_READ_MARGIN = Option(
    "ledger_margin", "OUTBOX_LEDGER_READ_MARGIN", non_negative_float, "5",
    "read the ledger from this many seconds before the oldest in-doubt batch (clock skew)",
    doc="keep it above the clock difference between the PostgreSQL and RabbitMQ hosts; a "
        "margin too small costs duplicates after a crash (a batch the broker has is not found "
        "and rolled back, so published again), never loss; a larger one makes every takeover "
        "read more of the ledger ([operations.md](operations.md#the-resolver-watch))",
)

RESOLVER_COMPACT_AFTER_HOLD = Option(
    "compact_after_hold", "OUTBOX_RESOLVER_COMPACT_AFTER_HOLD", positive_float, "60",
    "compact the outbox once a snapshot or transaction that held VACUUM back this many seconds "
    "or more has ended (as outbox-relay compact does, with its default bounds)",
    doc="[operations.md](operations.md#giving-the-space-back-after-a-held-snapshot)",
)

RESOLVER_COMPACT_ABOVE = Option(
    "compact_above", "OUTBOX_RESOLVER_COMPACT_ABOVE", non_negative_float, "16",
    "compact after such a hold only when the outbox (heap and indexes) is at least this many "
    "MiB; 0 turns the resolver's compaction off",
)

LEDGER_READ_TIMEOUT = Option(
    "ledger_read_timeout", "OUTBOX_LEDGER_READ_TIMEOUT", positive_float, "30",
    "seconds a ledger read may go without receiving a single record before it fails (however "
    "long the read takes while records keep coming), and the wait for its marker's confirm",
)


@dataclass(frozen=True)
class ResolverSettings:
    """What ``outbox-resolver`` reads: each field is one of the options above."""

    database_url: str = DATABASE_URL.field()
    amqp_url: str = AMQP_URL.field()
    gid_prefix: str = GID_PREFIX.field()
    ledger_stream: str = LEDGER_STREAM.field()
    ledger_max_age: str = LEDGER_MAX_AGE.field()
    table: str = TABLE.field()
    stats_interval: float = STATS_INTERVAL.field()
    interval: float = RESOLVER_INTERVAL.field()
    watch_interval: float = RESOLVER_WATCH_INTERVAL.field()
    hard_limit: float = RESOLVER_HARD_LIMIT.field()
    ledger_margin: float = LEDGER_READ_MARGIN.field()
    ledger_read_timeout: float = LEDGER_READ_TIMEOUT.field()
    compact_after_hold: float = RESOLVER_COMPACT_AFTER_HOLD.field()
    compact_above: float = RESOLVER_COMPACT_ABOVE.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_port: int = RESOLVER_METRICS_PORT.field()
    log_level: str = LOG_LEVEL.field()
    log_format: str = LOG_FORMAT.field()
    connect_timeout: float = CONNECT_TIMEOUT.field()
    reconnect_max_delay: float = RECONNECT_MAX_DELAY.field()


RESOLVER_OPTIONS: tuple[Option[Any], ...] = options_of(ResolverSettings)
