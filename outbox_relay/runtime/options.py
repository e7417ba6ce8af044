"""The options of both programs: every setting is a command-line flag and an environment variable.

Each setting is declared once as an ``Option``; the options both programs read are declared
here, each program's own in its settings module (outbox_relay.relay.settings,
outbox_relay.resolver.settings), which also holds its settings dataclass. Values are checked
here, before anything connects, so a bad setting ends the program with one line that names it.
Connection URLs are kept whole for connecting and shown only redacted.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast
from urllib.parse import urlsplit

import pika
import psycopg
import psycopg.conninfo

from outbox_relay.errors import ConfigError, first_line
from outbox_relay.gid import PREFIX_RE
from outbox_relay.rabbitmq import amqp_urls
from outbox_relay.rules import DEFAULT_LEDGER_STREAM
from outbox_relay.runtime.logs import redact
from outbox_relay.tables import table_name

_STREAM_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
_MAX_AGE_RE = re.compile(r"^[1-9][0-9]*(Y|M|D|h|m|s)$")


T = TypeVar("T")

# The key of a settings dataclass field's metadata that holds the Option declaring it.
_OPTION = "outbox_option"

# Largest *_FILE secret read: a URL, not a file system.
_MAX_SECRET_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Option(Generic[T]):
    """One setting, declared once: its name (``dest``, the flag is derived from it), its
    environment variable, its parser (which gives it its type), its default (as the text an
    environment variable would hold; None: required) and its help.

    ``secret``: the value is never shown, and may come from a file named by ``<env>_FILE``
    (a mounted secret). ``doc``: Markdown added after the help in docs/configuration.md.
    A settings dataclass declares a field with ``name: type = OPTION.field()``.
    """

    dest: str
    env: str
    parse: Callable[[str], T]
    default: str | None
    help: str
    secret: bool = False
    doc: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def file_env(self) -> str | None:
        """``<env>_FILE`` for a secret: the path of a file holding the value."""
        return self.env + "_FILE" if self.secret else None

    def field(self) -> T:
        """A dataclass field holding this setting: the default parsed, the Option in metadata.

        Typed as the value (as ``dataclasses.field`` itself is), so a field annotated with
        another type than the parser returns fails mypy.
        """
        metadata = {_OPTION: self}
        if self.default is None:
            return cast(T, dataclasses.field(metadata=metadata))
        return dataclasses.field(default=self.parse(self.default), metadata=metadata)


def options_of(settings: type) -> tuple[Option[Any], ...]:
    """The options a settings dataclass is made of, in field order."""
    found = []
    for item in dataclasses.fields(settings):
        option = item.metadata.get(_OPTION)
        if not isinstance(option, Option) or option.dest != item.name:
            raise TypeError(f"{settings.__name__}.{item.name} is not declared as OPTION.field()")
        found.append(option)
    return tuple(found)


def env_names(options: Sequence[Option[Any]]) -> set[str]:
    """Every environment variable these options read (``*_FILE`` forms included)."""
    return {name for o in options for name in (o.env, o.file_env) if name}


# Upper bounds: a value beyond them is a typo (or "inf", "1e309", 20 digits) that would
# overflow a timer, a SQL integer or the broker's own limits later, far from the setting.
SECONDS_MAX = 7 * 24 * 3600  # one week, for every timeout, delay and interval
COUNT_MAX = 1_000_000  # rows per batch, attempts
MESSAGE_BYTES_MAX = 512 * 1024 * 1024  # RabbitMQ refuses a max_message_size above 512 MiB
BATCH_BYTES_MAX = 16 * 1024**3


def bounded_int(low: int, high: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError(f"must be {what} from {low} to {high}")
        return value

    return parse


positive_int = bounded_int(1, COUNT_MAX, "a positive integer")
message_bytes = bounded_int(1, MESSAGE_BYTES_MAX, "a number of bytes")
batch_bytes = bounded_int(1, BATCH_BYTES_MAX, "a number of bytes")


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port (0 disables)")
    return value


def _seconds(text: str, *, zero: bool) -> float:
    value = float(text)
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0) and value <= SECONDS_MAX):
        low = "zero or more" if zero else "above zero"
        raise ValueError(f"must be a number of seconds, {low} and at most {SECONDS_MAX} (a week)")
    return value


def positive_float(text: str) -> float:
    return _seconds(text, zero=False)


def non_negative_float(text: str) -> float:
    return _seconds(text, zero=True)


def _url(*schemes: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if urlsplit(text).scheme not in schemes:
            raise ValueError("must be a URL starting with " + " or ".join(s + "://" for s in schemes))
        return text

    return parse


class _SafeValueError(ValueError):
    """A refusal whose text never contains the value: shown even for a secret setting."""


_AT_HINT = ("has an '@' after its host part: percent-encode '/', '?', '#' and '@' in the user "
            "name and password (%2F, %3F, %23, %40) and write any other '@' as %40")


def _check_authority(text: str, delimiters: str) -> None:
    """Refuse a URL whose user info seems to hold an unencoded delimiter.

    ``user:pa/ss@host`` parses as host ``user``, port ``pa`` and a path ``/ss@host``: the
    connection error (or a parser's message) would then show a piece of the password. Such a
    URL has no ``@`` in its authority (which ends at the first of ``delimiters``) but one later.
    """
    rest = text.partition("://")[2]
    end = min((i for i in (rest.find(d) for d in delimiters) if i >= 0), default=len(rest))
    if "@" not in rest[:end] and "@" in rest[end:]:
        raise _SafeValueError(_AT_HINT)


def _database_url(text: str) -> str:
    _url("postgresql", "postgres")(text)
    # libpq looks for the user info up to the first "/" only ("?" and "#" pass through).
    _check_authority(text, "/")
    try:
        psycopg.conninfo.conninfo_to_dict(text)
    except psycopg.Error:
        # libpq's reason may quote a piece of the password: say only that it does not parse.
        raise _SafeValueError("is not a PostgreSQL URL libpq can parse (percent-encode special "
                              "characters in the user name and password)") from None
    return text


def _amqp_url(text: str) -> str:
    """One URL, or a comma-separated list of them (a cluster's nodes), each checked alone."""
    parts = amqp_urls(text)
    for n, part in enumerate(parts, 1):
        try:
            _one_amqp_url(part)
        except ValueError as exc:  # each text is safe: a parser's own never quotes the value
            if len(parts) == 1:
                raise
            raise _SafeValueError(f"URL {n} of {len(parts)} {exc}") from None
    return text


def _one_amqp_url(text: str) -> str:
    """amqp:// or amqps://, and query options pika accepts (ssl_options, heartbeat...): a bad
    one stops the program here, not with a traceback at its first connection attempt."""
    if not text:
        raise _SafeValueError("is empty (two commas in a row, or a trailing comma)")
    _url("amqp", "amqps")(text)
    _check_authority(text, "/?#")
    # The URL without its query first: pika's reason for refusing the host, port or vhost part
    # may quote it (a piece of a password with an unencoded ":"), so none of it is shown.
    try:
        pika.URLParameters(urlsplit(text)._replace(query="", fragment="").geturl())
    except Exception:
        raise _SafeValueError("is not a URL pika can parse (check the port, and percent-encode "
                              "special characters in the user name and password)") from None
    try:
        pika.URLParameters(text)
    except Exception as exc:  # ValueError, TypeError, SyntaxError, OSError (a missing CA file)
        reason = first_line(str(exc))[:200]
        raise _SafeValueError(
            f"has options pika cannot use ({type(exc).__name__}: {redact(reason)})") from None
    return text


def _gid_prefix(text: str) -> str:
    if not PREFIX_RE.fullmatch(text):
        raise ValueError("must be 1-32 characters: a lowercase letter, then a-z, 0-9, _ or -")
    return text


def _stream(text: str) -> str:
    if not _STREAM_RE.fullmatch(text):
        raise ValueError("must be a queue name of letters, digits and _.:-")
    if text.startswith("amq."):
        raise ValueError("must not start with amq. (RabbitMQ reserves those names)")
    return text


def _max_age(text: str) -> str:
    if not _MAX_AGE_RE.fullmatch(text):
        raise ValueError("must be a RabbitMQ max-age such as 7D, 12h or 90m")
    return text


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError("must be one of " + ", ".join(choices))
        return text

    return parse


# -- the settings both programs read, each declared once ---------------------------------------
# A new setting: one Option here (or in the settings module of the one program that reads it),
# then one ``name: type = OPTION.field()`` line in each settings class that reads it. The
# option lists, --help and docs/configuration.md (``./dev docs``) follow from that.

DATABASE_URL = Option(
    "database_url", "OUTBOX_DATABASE_URL", _database_url, None,
    "PostgreSQL URL; needs a session-mode connection (no transaction-mode pooler)", secret=True,
    doc="libpq parameters such as `sslmode` pass through (TLS: [operations.md](operations.md#tls))",
)
AMQP_URL = Option(
    "amqp_url", "OUTBOX_AMQP_URL", _amqp_url, None,
    "RabbitMQ URL (amqp:// or amqps://; TLS options in ssl_options), or a comma-separated list "
    "of a cluster's nodes' URLs: each connection tries them in a random order", secret=True,
    doc="TLS: [operations.md](operations.md#tls); a cluster: "
        "[operations.md](operations.md#clusters-and-failover)",
)
TABLE = Option(
    "table", "OUTBOX_TABLE", table_name, "outbox",
    "outbox table ([schema.]name); the dead-letter table is <name>_dead_letter and the ledger "
    "key <name>_ledger_key; the resolver exports its backlog and lag and checks ledger records "
    "with that key (set the relays' value)",
)
GID_PREFIX = Option(
    "gid_prefix", "OUTBOX_GID_PREFIX", _gid_prefix, "outbox",
    "prefix of this deployment's prepared-transaction ids; the resolver touches only these",
)
LEDGER_STREAM = Option(
    "ledger_stream", "OUTBOX_LEDGER_STREAM", _stream, DEFAULT_LEDGER_STREAM,
    "RabbitMQ stream that records every fully confirmed batch, and the name of the ledger's own "
    "exchange (bound to it); not amq.* (reserved)",
    doc="a name the broker refuses (403) stops both programs at start (exit 3)",
)
LEDGER_MAX_AGE = Option(
    "ledger_max_age", "OUTBOX_LEDGER_MAX_AGE", _max_age, "7D",
    "retention of the ledger stream (x-max-age); keep it longer than any in-doubt window",
)
STATS_INTERVAL = Option(
    "stats_interval", "OUTBOX_STATS_INTERVAL", positive_float, "5",
    "seconds between refreshes of the backlog and lag metrics (a pass over the outbox rows "
    "above the last pass's lowest id, on a session and thread of its own; once a minute over "
    "the whole table)",
    doc="its cost: [operations.md](operations.md#what-the-backlog-and-lag-query-costs)",
)
METRICS_HOST = Option(
    "metrics_host", "OUTBOX_METRICS_HOST", str, "127.0.0.1",
    "address of the /metrics, /healthz and /readyz endpoints (loopback unless set: 0.0.0.0, or "
    "the pod's address, for a Prometheus or a probe from elsewhere; the image sets 0.0.0.0)",
)
METRICS_PORT_HELP = (
    "port of /metrics, /healthz and /readyz (0 disables all three; a port in use is a "
    "configuration error)"
)
LOG_LEVEL = Option(
    "log_level", "OUTBOX_LOG_LEVEL", choice("DEBUG", "INFO", "WARNING", "ERROR"), "INFO",
    "log level: DEBUG, INFO, WARNING or ERROR",
)
LOG_FORMAT = Option(
    "log_format", "OUTBOX_LOG_FORMAT", choice("text", "json"), "text",
    "log line format: text, or json (one object a line, with a stable action key)",
)
CONNECT_TIMEOUT = Option(
    "connect_timeout", "OUTBOX_CONNECT_TIMEOUT", positive_float, "10",
    "seconds to wait for a PostgreSQL or RabbitMQ connection",
)
RECONNECT_MAX_DELAY = Option(
    "reconnect_max_delay", "OUTBOX_RECONNECT_MAX_DELAY", positive_float, "5",
    "longest wait between reconnection attempts (exponential backoff with full jitter): a "
    "server back after a long outage is found again within this many seconds",
)


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option[Any]]) -> None:
    """Add every option as a flag whose help names its environment variable and default."""
    for option in options:
        shown = "required" if option.default is None else f"default: {option.default}"
        names = option.env if option.file_env is None else f"{option.env} or {option.file_env}"
        parser.add_argument(
            option.flag,
            dest=option.dest,
            metavar=option.env,
            default=None,
            help=f"{option.help} [env {names}; {shown}]",
        )


def resolve(
    namespace: argparse.Namespace, options: Sequence[Option[Any]],
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Flag, else environment variable (or, for a secret, the file its ``*_FILE`` variable
    names), else default; parsed and checked. Raises ConfigError with one line naming the
    setting, never showing a secret's value."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for option in options:
        raw = getattr(namespace, option.dest, None)
        source = option.flag
        if raw is None:
            raw = environ.get(option.env) or None
            source = option.env
            file_env = option.file_env
            path = environ.get(file_env) or None if file_env else None
            if file_env and path is not None:
                if raw is not None:
                    raise ConfigError(f"{option.env} and {file_env} are both set: set only one")
                raw, source = read_secret_file(file_env, path), file_env
        if raw is None:
            raw = option.default
            source = f"{option.env} (default)"
        if raw is None:
            also = f", {option.file_env}" if option.file_env else ""
            raise ConfigError(f"{option.env} (or {option.flag}{also}) is required")
        try:
            values[option.dest] = option.parse(raw)
        except ValueError as exc:
            shown = "<hidden>" if option.secret else repr(raw)
            safe = not option.secret or isinstance(exc, _SafeValueError)
            detail = str(exc) if safe else _url_hint(option)
            raise ConfigError(f"{source} {detail} (got {shown})") from None
    return values


def read_secret_file(variable: str, path: str) -> str:
    """The value a mounted secret file holds, without the line end an editor or ``echo`` adds.

    Every failure is one line naming the variable and the path, never a byte of the content.
    """
    try:
        with open(path, "rb") as secret:
            data = secret.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"{variable} names a file that cannot be read: {path!r} ({reason})") from None
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{variable} names a file larger than 64 KiB: {path!r}")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{variable} names a file that is not UTF-8 text: {path!r}") from None
    if not text:
        raise ConfigError(f"{variable} names an empty file: {path!r}")
    return text


def _url_hint(option: Option[Any]) -> str:
    return "is not a valid URL" if option is not AMQP_URL else "must start with amqp:// or amqps://"
