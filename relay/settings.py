"""The relay's settings (``outbox-relay run``): its own options, and the settings dataclass
made of them and of the options both programs read (outbox_relay.runtime.options)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from outbox_relay.errors import ConfigError
from outbox_relay.rules import DEFAULT_MAX_MESSAGE_BYTES
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
    batch_bytes,
    message_bytes,
    non_negative_float,
    options_of,
    port,
    positive_float,
    positive_int,
)

BATCH_SIZE = Option(
    "batch_size", "OUTBOX_BATCH_SIZE", positive_int, "2000",
    "rows claimed per batch (the most a crash can duplicate)",
    doc="2000 from the benchmark's sweep ([performance.md](performance.md))",
)

CONFIRM_TIMEOUT = Option(
    "confirm_timeout", "OUTBOX_CONFIRM_TIMEOUT", positive_float, "30",
    "seconds to wait for the broker's confirms of a batch before failing it",
)

MAX_ATTEMPTS = Option(
    "max_attempts", "OUTBOX_MAX_ATTEMPTS", positive_int, "10",
    "failed publishes of a row before it moves to the dead-letter table",
)

RETRY_BASE_DELAY = Option(
    "retry_base_delay", "OUTBOX_RETRY_BASE_DELAY", non_negative_float, "1",
    "delay before a failed row is retried; doubles with each attempt",
)

RETRY_MAX_DELAY = Option(
    "retry_max_delay", "OUTBOX_RETRY_MAX_DELAY", non_negative_float, "300",
    "longest delay before a failed row is retried",
)

POLL_MIN_INTERVAL = Option(
    "poll_min_interval", "OUTBOX_POLL_MIN_INTERVAL", non_negative_float, "0.005",
    "wait after a partial batch; idle waits double from here",
)

POLL_MAX_INTERVAL = Option(
    "poll_max_interval", "OUTBOX_POLL_MAX_INTERVAL", positive_float, "0.25",
    "longest wait between polls of an empty outbox",
)

MAX_MESSAGE_BYTES = Option(
    "max_message_bytes", "OUTBOX_MAX_MESSAGE_BYTES", message_bytes, str(DEFAULT_MAX_MESSAGE_BYTES),
    "largest body published; larger rows are dead-lettered (match the broker's max_message_size)",
    doc="a row whose `row_bytes` exceed it by more than 1 MiB is moved to the dead-letter table "
        "by the claim itself, never fetched into the relay; with OUTBOX_BATCH_MAX_BYTES, bounds "
        "the relay's memory: [reliability.md](reliability.md#memory)",
)

BATCH_MAX_BYTES = Option(
    "batch_max_bytes", "OUTBOX_BATCH_MAX_BYTES", batch_bytes, "8388608",
    "bytes of row data claimed per batch besides OUTBOX_BATCH_SIZE (the row_bytes column: "
    "payload, headers, text columns); a batch takes one row at least",
    doc="the next batch, claimed while this one is confirmed, gets what this one left; bounds "
        "the relay's memory: [reliability.md](reliability.md#memory)",
)

RELAY_METRICS_PORT = Option("metrics_port", "OUTBOX_METRICS_PORT", port, "9460", METRICS_PORT_HELP)


def _standby(text: str) -> str:
    if text and not re.fullmatch(r"[A-Za-z0-9_.-]{1,63}", text):
        raise ValueError("must be empty (off), any, sync, or a standby's application_name "
                         "(letters, digits, _ . -)")
    return text

STANDBY_WAIT = Option(
    "standby_wait", "OUTBOX_STANDBY_WAIT", _standby, "",
    "publish a batch only once this standby has flushed the WAL past its claim: a standby's "
    "application_name, sync (a synchronous one) or any; empty: off",
    doc="no ghost events after an asynchronous failover; needs pg_read_all_stats (pg_monitor) "
        "for pg_stat_replication; its cost: [operations.md](operations.md#clusters-and-failover)",
)

STANDBY_WAIT_TIMEOUT = Option(
    "standby_wait_timeout", "OUTBOX_STANDBY_WAIT_TIMEOUT", positive_float, "10",
    "seconds to wait for OUTBOX_STANDBY_WAIT before rolling the batch back and retrying it",
)


def _user_id(text: str) -> str:
    try:
        size = len(text.encode())
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 text") from None
    if size > 255:
        raise ValueError("must be at most 255 bytes (an AMQP short string)")
    return text


AMQP_USER_ID = Option(
    "amqp_user_id", "OUTBOX_AMQP_USER_ID", _user_id, "",
    "the user_id property of every message: the user RabbitMQ authenticates the relay's "
    "connection as; empty: the user name of OUTBOX_AMQP_URL (guest if it names none)",
    doc="RabbitMQ refuses a `user_id` other than the connection's user, so a consumer can tell "
        "a relay's messages from another publisher's: the inbox's per-key check trusts only "
        "those ([python-api.md](python-api.md#per-key-order-opt-in)). Set it where the broker "
        "names the user otherwise (OAuth 2 tokens, x509 certificates with EXTERNAL). Checked "
        "on every connection: a value RabbitMQ refuses stops the relay (exit 3)",
)


@dataclass(frozen=True)
class RelaySettings:
    """What ``outbox-relay run`` reads: each field is one of the options above."""

    database_url: str = DATABASE_URL.field()
    amqp_url: str = AMQP_URL.field()
    amqp_user_id: str = AMQP_USER_ID.field()
    table: str = TABLE.field()
    gid_prefix: str = GID_PREFIX.field()
    ledger_stream: str = LEDGER_STREAM.field()
    ledger_max_age: str = LEDGER_MAX_AGE.field()
    batch_size: int = BATCH_SIZE.field()
    confirm_timeout: float = CONFIRM_TIMEOUT.field()
    max_attempts: int = MAX_ATTEMPTS.field()
    retry_base_delay: float = RETRY_BASE_DELAY.field()
    retry_max_delay: float = RETRY_MAX_DELAY.field()
    poll_min_interval: float = POLL_MIN_INTERVAL.field()
    poll_max_interval: float = POLL_MAX_INTERVAL.field()
    max_message_bytes: int = MAX_MESSAGE_BYTES.field()
    batch_max_bytes: int = BATCH_MAX_BYTES.field()
    stats_interval: float = STATS_INTERVAL.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_port: int = RELAY_METRICS_PORT.field()
    log_level: str = LOG_LEVEL.field()
    log_format: str = LOG_FORMAT.field()
    connect_timeout: float = CONNECT_TIMEOUT.field()
    reconnect_max_delay: float = RECONNECT_MAX_DELAY.field()
    standby_wait: str = STANDBY_WAIT.field()
    standby_wait_timeout: float = STANDBY_WAIT_TIMEOUT.field()

    def __post_init__(self) -> None:
        if self.poll_min_interval > self.poll_max_interval:
            raise ConfigError("OUTBOX_POLL_MIN_INTERVAL must not exceed OUTBOX_POLL_MAX_INTERVAL")
        if self.retry_base_delay > self.retry_max_delay:
            raise ConfigError("OUTBOX_RETRY_BASE_DELAY must not exceed OUTBOX_RETRY_MAX_DELAY")


RELAY_OPTIONS: tuple[Option[Any], ...] = options_of(RelaySettings)
