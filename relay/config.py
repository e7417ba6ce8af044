"""Settings of both programs: every one is a command-line flag and an environment variable.

Values are checked here, before anything connects, so a bad setting ends the program with one
line that names it. Connection URLs are kept whole for connecting and shown only redacted.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pika
import psycopg
import psycopg.conninfo

from relay.errors import ConfigError, first_line
from relay.gid import PREFIX_RE
from relay.logs import redact

# One unquoted-style identifier part; a name with quotes, dots inside a part, spaces or
# semicolons is refused rather than escaped, so logs, metrics and psql all show the same name.
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")
_STREAM_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
_MAX_AGE_RE = re.compile(r"^[1-9][0-9]*(Y|M|D|h|m|s)$")


@dataclass(frozen=True)
class Option:
    """One setting: its flag, its environment variable, its parser and its help."""

    dest: str
    env: str
    parse: Callable[[str], Any]
    default: str | None
    help: str
    secret: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port (0 disables)")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be zero or a positive number of seconds")
    return value


def _url(*schemes: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if urlsplit(text).scheme not in schemes:
            raise ValueError("must be a URL starting with " + " or ".join(s + "://" for s in schemes))
        return text

    return parse


class _SafeValueError(ValueError):
    """A refusal whose text never contains the value: shown even for a secret setting."""


def _database_url(text: str) -> str:
    _url("postgresql", "postgres")(text)
    try:
        psycopg.conninfo.conninfo_to_dict(text)
    except psycopg.Error:
        # libpq's reason may quote a piece of the password: say only that it does not parse.
        raise _SafeValueError("is not a PostgreSQL URL libpq can parse") from None
    return text


def _amqp_url(text: str) -> str:
    """amqp:// or amqps://, and query options pika accepts (ssl_options, heartbeat...): a bad
    one stops the program here, not with a traceback at its first connection attempt."""
    _url("amqp", "amqps")(text)
    try:
        pika.URLParameters(text)
    except Exception as exc:  # ValueError, TypeError, SyntaxError, OSError (a missing CA file)
        reason = first_line(str(exc))[:200]
        raise _SafeValueError(
            f"has options pika cannot use ({type(exc).__name__}: {redact(reason)})") from None
    return text


def table_name(text: str) -> str:
    """``table`` or ``schema.table``, each part a plain identifier of at most 40 characters."""
    parts = text.split(".")
    if len(parts) > 2 or not all(_IDENT_RE.fullmatch(part) for part in parts):
        raise ValueError(
            "must be a table name like outbox or myschema.outbox "
            "(letters, digits and _, at most 40 characters a part)"
        )
    return text


def _gid_prefix(text: str) -> str:
    if not PREFIX_RE.fullmatch(text):
        raise ValueError("must be 1-32 characters: a lowercase letter, then a-z, 0-9, _ or -")
    return text


def _stream(text: str) -> str:
    if not _STREAM_RE.fullmatch(text):
        raise ValueError("must be a queue name of letters, digits and _.:-")
    return text


def _max_age(text: str) -> str:
    if not _MAX_AGE_RE.fullmatch(text):
        raise ValueError("must be a RabbitMQ max-age such as 7D, 12h or 90m")
    return text


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError("must be one of " + ", ".join(choices))
        return text

    return parse


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***``: the only form a URL is ever shown in.

    Split by hand, not with urlsplit: libpq accepts an unencoded ``#`` or ``?`` in a password,
    where urlsplit would end the host part early and miss the password.
    """
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


DATABASE_URL = Option(
    "database_url", "OUTBOX_DATABASE_URL", _database_url, None,
    "PostgreSQL URL; needs a session-mode connection (no transaction-mode pooler)", secret=True,
)
AMQP_URL = Option(
    "amqp_url", "OUTBOX_AMQP_URL", _amqp_url, None,
    "RabbitMQ URL (amqp:// or amqps://; TLS options in ssl_options, see the README)", secret=True,
)
TABLE = Option("table", "OUTBOX_TABLE", table_name, "outbox", "outbox table ([schema.]name)")
GID_PREFIX = Option(
    "gid_prefix", "OUTBOX_GID_PREFIX", _gid_prefix, "outbox",
    "prefix of this deployment's prepared-transaction ids; the resolver touches only these",
)
LEDGER_STREAM = Option(
    "ledger_stream", "OUTBOX_LEDGER_STREAM", _stream, "outbox.ledger",
    "RabbitMQ stream that records every fully confirmed batch",
)
LEDGER_MAX_AGE = Option(
    "ledger_max_age", "OUTBOX_LEDGER_MAX_AGE", _max_age, "7D",
    "retention of the ledger stream (x-max-age); keep it longer than any in-doubt window",
)
METRICS_HOST = Option(
    "metrics_host", "OUTBOX_METRICS_HOST", str, "0.0.0.0",  # noqa: S104
    "address of the /metrics, /healthz and /readyz endpoints",
)
LOG_LEVEL = Option(
    "log_level", "OUTBOX_LOG_LEVEL", _choice("DEBUG", "INFO", "WARNING", "ERROR"), "INFO", "log level",
)
LOG_FORMAT = Option(
    "log_format", "OUTBOX_LOG_FORMAT", _choice("text", "json"), "text", "log line format",
)
CONNECT_TIMEOUT = Option(
    "connect_timeout", "OUTBOX_CONNECT_TIMEOUT", _positive_float, "10",
    "seconds to wait for a PostgreSQL or RabbitMQ connection",
)
RECONNECT_MAX_DELAY = Option(
    "reconnect_max_delay", "OUTBOX_RECONNECT_MAX_DELAY", _positive_float, "30",
    "longest wait between reconnection attempts (exponential backoff with jitter)",
)

RELAY_OPTIONS: tuple[Option, ...] = (
    DATABASE_URL,
    AMQP_URL,
    TABLE,
    GID_PREFIX,
    LEDGER_STREAM,
    LEDGER_MAX_AGE,
    Option("batch_size", "OUTBOX_BATCH_SIZE", _positive_int, "2000", "rows claimed per batch"),
    Option(
        "confirm_timeout", "OUTBOX_CONFIRM_TIMEOUT", _positive_float, "30",
        "seconds to wait for the broker's confirms of a batch before failing it",
    ),
    Option(
        "max_attempts", "OUTBOX_MAX_ATTEMPTS", _positive_int, "10",
        "failed publishes of a row before it moves to the dead-letter table",
    ),
    Option(
        "retry_base_delay", "OUTBOX_RETRY_BASE_DELAY", _non_negative_float, "1",
        "delay before a failed row is retried; doubles with each attempt",
    ),
    Option(
        "retry_max_delay", "OUTBOX_RETRY_MAX_DELAY", _non_negative_float, "300",
        "longest delay before a failed row is retried",
    ),
    Option(
        "poll_min_interval", "OUTBOX_POLL_MIN_INTERVAL", _non_negative_float, "0.005",
        "wait after a partial batch; idle waits double from here",
    ),
    Option(
        "poll_max_interval", "OUTBOX_POLL_MAX_INTERVAL", _positive_float, "0.25",
        "longest wait between polls of an empty outbox",
    ),
    Option(
        "max_message_bytes", "OUTBOX_MAX_MESSAGE_BYTES", _positive_int, "134217728",
        "largest body published; larger rows are dead-lettered (match the broker's max_message_size)",
    ),
    Option(
        "stats_interval", "OUTBOX_STATS_INTERVAL", _positive_float, "5",
        "seconds between refreshes of the lag and backlog metrics",
    ),
    METRICS_HOST,
    Option("metrics_port", "OUTBOX_METRICS_PORT", _port, "9460",
           "port of /metrics, /healthz and /readyz (0 disables)"),
    LOG_LEVEL,
    LOG_FORMAT,
    CONNECT_TIMEOUT,
    RECONNECT_MAX_DELAY,
)

RESOLVER_OPTIONS: tuple[Option, ...] = (
    DATABASE_URL,
    AMQP_URL,
    GID_PREFIX,
    LEDGER_STREAM,
    LEDGER_MAX_AGE,
    Option(
        "interval", "OUTBOX_RESOLVER_INTERVAL", _positive_float, "2",
        "seconds between scans of pg_prepared_xacts",
    ),
    Option(
        "hard_limit", "OUTBOX_RESOLVER_HARD_LIMIT", _positive_float, "300",
        "resolve a prepared batch older than this many seconds even if its relay looks alive",
    ),
    Option(
        "ledger_margin", "OUTBOX_LEDGER_READ_MARGIN", _non_negative_float, "60",
        "read the ledger from this many seconds before the oldest in-doubt batch (clock skew)",
    ),
    Option(
        "ledger_read_timeout", "OUTBOX_LEDGER_READ_TIMEOUT", _positive_float, "30",
        "seconds to wait for the resolver's own marker to come back from the ledger",
    ),
    METRICS_HOST,
    Option("metrics_port", "OUTBOX_METRICS_PORT", _port, "9461",
           "port of /metrics, /healthz and /readyz (0 disables)"),
    LOG_LEVEL,
    LOG_FORMAT,
    CONNECT_TIMEOUT,
    RECONNECT_MAX_DELAY,
)


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Add every option as a flag whose help names its environment variable and default."""
    for option in options:
        shown = "required" if option.default is None else f"default: {option.default}"
        parser.add_argument(
            option.flag,
            dest=option.dest,
            metavar=option.env,
            default=None,
            help=f"{option.help} [env {option.env}; {shown}]",
        )


def resolve(
    namespace: argparse.Namespace, options: Sequence[Option], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Flag, else environment variable, else default; parsed and checked. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for option in options:
        raw = getattr(namespace, option.dest, None)
        source = option.flag
        if raw is None:
            raw = environ.get(option.env) or None
            source = option.env
        if raw is None:
            raw = option.default
            source = f"{option.env} (default)"
        if raw is None:
            raise ConfigError(f"{option.env} (or {option.flag}) is required")
        try:
            values[option.dest] = option.parse(raw)
        except ValueError as exc:
            shown = "<hidden>" if option.secret else repr(raw)
            safe = not option.secret or isinstance(exc, _SafeValueError)
            detail = str(exc) if safe else _url_hint(option)
            raise ConfigError(f"{source} {detail} (got {shown})") from None
    return values


def _url_hint(option: Option) -> str:
    return "is not a valid URL" if option is not AMQP_URL else "must start with amqp:// or amqps://"


@dataclass(frozen=True)
class RelaySettings:
    database_url: str
    amqp_url: str
    table: str = "outbox"
    gid_prefix: str = "outbox"
    ledger_stream: str = "outbox.ledger"
    ledger_max_age: str = "7D"
    batch_size: int = 2000
    confirm_timeout: float = 30.0
    max_attempts: int = 10
    retry_base_delay: float = 1.0
    retry_max_delay: float = 300.0
    poll_min_interval: float = 0.005
    poll_max_interval: float = 0.25
    max_message_bytes: int = 134217728
    stats_interval: float = 5.0
    metrics_host: str = "0.0.0.0"  # noqa: S104 - a sidecar's metrics are scraped from outside
    metrics_port: int = 9460
    log_level: str = "INFO"
    log_format: str = "text"
    connect_timeout: float = 10.0
    reconnect_max_delay: float = 30.0

    def __post_init__(self) -> None:
        if self.poll_min_interval > self.poll_max_interval:
            raise ConfigError("OUTBOX_POLL_MIN_INTERVAL must not exceed OUTBOX_POLL_MAX_INTERVAL")
        if self.retry_base_delay > self.retry_max_delay:
            raise ConfigError("OUTBOX_RETRY_BASE_DELAY must not exceed OUTBOX_RETRY_MAX_DELAY")


@dataclass(frozen=True)
class ResolverSettings:
    database_url: str
    amqp_url: str
    gid_prefix: str = "outbox"
    ledger_stream: str = "outbox.ledger"
    ledger_max_age: str = "7D"
    interval: float = 2.0
    hard_limit: float = 300.0
    ledger_margin: float = 60.0
    ledger_read_timeout: float = 30.0
    metrics_host: str = "0.0.0.0"  # noqa: S104
    metrics_port: int = 9461
    log_level: str = "INFO"
    log_format: str = "text"
    connect_timeout: float = 10.0
    reconnect_max_delay: float = 30.0
