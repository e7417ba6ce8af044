"""What the relay refuses to publish, and why: the one set of rules of the relay and the
producer API.

Every column of a row is the producer's: ``publish_problem`` decides from plain values whether
the relay would dead-letter a row and why (the producer API calls it before its INSERT);
``field_problem`` and ``encoding_problem`` are the same checks as the relay runs them on a
claimed row (outbox_relay.relay.messages). pika is not imported here: struct encodes the usual
header tables (outbox_relay.properties), and pika's own encoder is loaded only to measure a
table of another shape (nested, floats, lists).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from outbox_relay import properties

# AMQP short strings: exchange, routing key, message id, content type, type, correlation id.
SHORTSTR_MAX = 255
# Deeper header tables are refused before anything recursive (JSON decoding, conversion,
# pika's encoder) meets them: jsonb accepts nesting thousands of levels deep.
HEADERS_DEPTH_MAX = 64
# The AMQP timestamp is an unsigned 64-bit count of seconds; consumers read it as a date, so
# it must be a date of years 1970 to 9999.
TIMESTAMP_MIN = 0
TIMESTAMP_END = 253402300800  # 10000-01-01T00:00:00Z
REASON_MAX = 500  # characters of a library's text kept in a reason
# pika's (and RabbitMQ's) default frame_max, until a connection negotiated its own.
DEFAULT_FRAME_MAX = 131072
# The relay's defaults of OUTBOX_MAX_MESSAGE_BYTES and OUTBOX_LEDGER_STREAM: the producer API
# checks events against them unless told the relay's own settings. 4 MiB: with
# OUTBOX_BATCH_MAX_BYTES' 8 MiB, a relay's memory stays within the 128 MiB the shipped
# manifests give it, whatever the rows hold (docs/reliability.md#memory).
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DEFAULT_LEDGER_STREAM = "outbox.ledger"

# Headers the relay sets on the message of a row that has an ordering_key: the key itself, and
# the row's id, the event's position among the events of its key (ids grow in commit order for
# producers that serialize their transactions per key). Consumers read them (the inbox's
# per-key check does), so only the relay may set them: a row whose own headers name one is
# refused (relay_headers_problem), with an ordering_key or without. Refused rather than
# overwritten or removed: a keyless row carrying them is a producer's bug or a forgery, and a
# dead letter shows it (reason, metric, `dead-letter list`) where a silent fix would hide it;
# and the producer API refuses the same rows, so both apply one rule.
ORDERING_KEY_HEADER = "x-ordering-key"
POSITION_HEADER = "x-outbox-id"
RELAY_HEADERS = (ORDERING_KEY_HEADER, POSITION_HEADER)
# The largest id an outbox row can have (bigint): the producer API measures a keyed event's
# header table with the position at its longest encoding, and every event's header frame with
# the longest user_id a relay's connection can set (its user's name, unknown to a producer).
LARGEST_POSITION = 2**63 - 1
LONGEST_USER_ID = "u" * SHORTSTR_MAX
# A trace context (W3C Trace Context), carried from the producer's span to the consumer's as
# two headers of the event (the producer API writes them from the current OpenTelemetry span;
# a producer in another language writes them itself). The relay publishes them as they are,
# except a malformed one: that is removed from the message, which goes without it, and counted
# (trace_context_problem, relay/messages.py). Never a dead letter: a trace is the producer's
# observability, not its event.
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
TRACE_HEADERS = (TRACEPARENT_HEADER, TRACESTATE_HEADER)
# The headers column as the claim returns it when a producer sets none (its default).
EMPTY_HEADERS = "{}"
# A header frame around its properties: frame type, channel and size, class, weight and body
# size, frame end.
HEADER_FRAME_OVERHEAD = 20


@dataclass(frozen=True)
class Problem:
    """Why a message can never be published: the field at fault and the dead-letter reason."""

    field: str
    reason: str

    def __str__(self) -> str:
        return self.reason


def _shortstr(name: str, value: str) -> Problem | None:
    # An ASCII string is as long in bytes as in characters: most need no encoding to measure.
    if not (value.isascii() and len(value) <= SHORTSTR_MAX) and len(value.encode()) > SHORTSTR_MAX:
        return Problem(name, f"{name} is longer than {SHORTSTR_MAX} bytes")
    return None


# C0 and C1 control characters and DEL: AMQP short strings could carry them, but a type or a
# correlation id is a name consumers route, match and log by; one holding a line break, an
# escape sequence or a NUL-like byte is a producer's bug or an attack on those logs and matches.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _property_text(name: str, value: str | None) -> Problem | None:
    """A row's message_type or correlation_id (AMQP type, correlation_id): a short string
    without control characters, or None (the property is not set)."""
    if value is None:
        return None
    found = _shortstr(name, value)
    # isprintable (C, a fraction of the regex's cost) is False for every control character,
    # and for a few characters allowed here (U+2028, U+00A0, ...): the regex then decides.
    if found is None and not value.isprintable() \
            and (bad := _CONTROL.search(value)) is not None:
        found = Problem(name, f"{name} holds the control character U+{ord(bad[0]):04X} at "
                              f"position {bad.start()}")
    return found


def amqp_value(value: Any) -> Any:
    """JSON to AMQP table values: pika encodes no floats, so a fractional number is a decimal."""
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, dict):
        return {k: amqp_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [amqp_value(v) for v in value]
    return value


def relay_headers_problem(headers: Any) -> Problem | None:
    """A row's own headers that name one of RELAY_HEADERS: only the relay sets those."""
    # Two lookups, no loop: to_message runs this for every row with headers of its own.
    if type(headers) is dict and (ORDERING_KEY_HEADER in headers or POSITION_HEADER in headers):
        name = ORDERING_KEY_HEADER if ORDERING_KEY_HEADER in headers else POSITION_HEADER
        return Problem("headers", f"header {name} is set by the relay (from ordering_key and "
                                  "the row's id); a row may not set it")
    return None


def message_headers(headers: Any, ordering_key: str | None, position: int) -> Any:
    """The headers published for a row: its own, plus ORDERING_KEY_HEADER and POSITION_HEADER
    when it has an ordering key. Anything but a JSON object is returned as it is (the checks
    refuse it), and so are own headers that name the relay's (relay_headers_problem refuses
    them first)."""
    if ordering_key is None or not isinstance(headers, dict):
        return headers
    return {**headers, ORDERING_KEY_HEADER: ordering_key, POSITION_HEADER: position}


# W3C Trace Context (https://www.w3.org/TR/trace-context/), as OpenTelemetry reads it. A
# traceparent is version-traceid-parentid-flags in lowercase hex, neither id all zeros, version
# ff invalid; a later version than 00 may add fields after a dash. A tracestate is a list of up
# to 32 key=value members, separated by commas with optional blanks (an empty member allowed).
# One regular expression each: to_message runs them on every row that carries the headers.
_HEX_IDS = r"-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
_TRACEPARENT = re.compile(rf"00{_HEX_IDS}|(?!00|ff)[0-9a-f]{{2}}{_HEX_IDS}(?:-[\x21-\x7e]*)?")
_TRACESTATE_KEY = (r"(?:[a-z][_0-9a-z\-*/]{0,255}"
                   r"|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})")
# Neither a key nor a value holds "=": a tracestate has as many members as "=" signs.
_TRACESTATE_MEMBER = (_TRACESTATE_KEY
                      + r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
# Written so that every text has one way to match at most (blanks before a member, or after
# one; the key ends at "=", the value at its last non-blank, a member at ","): a failed match
# costs time linear in the text, whatever a producer wrote (a pattern with two ways, such as
# blanks, an optional member, blanks, took minutes on 8 KB of blanks and commas).
_TRACESTATE = re.compile(rf"[ \t]*(?:{_TRACESTATE_MEMBER}[ \t]*)?"
                         rf"(?:,[ \t]*(?:{_TRACESTATE_MEMBER}[ \t]*)?)*")
TRACEPARENT_MAX = 512
TRACESTATE_MAX = 8192
TRACESTATE_MEMBERS_MAX = 32
# Empty members are allowed, but not thousands of them: a match's time grows with the commas.
TRACESTATE_COMMAS_MAX = 2 * TRACESTATE_MEMBERS_MAX


def _traceparent_problem(value: Any) -> str | None:
    if type(value) is str and len(value) <= TRACEPARENT_MAX and _TRACEPARENT.fullmatch(value):
        return None
    # Malformed: say how.
    if not isinstance(value, str):
        return f"is not a string but {type(value).__name__}"
    if len(value) > TRACEPARENT_MAX:
        return f"is longer than {TRACEPARENT_MAX} characters"
    if re.fullmatch(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(?:-.*)?", value) is None:
        return "is not version-traceid-parentid-flags in lowercase hex"
    if value[3:35] == "0" * 32 or value[36:52] == "0" * 16:
        return "has an all-zero trace id or parent id"
    return f"is not valid for version {value[:2]}"


def _tracestate_problem(value: Any) -> str | None:
    if type(value) is str and len(value) <= TRACESTATE_MAX \
            and value.count("=") <= TRACESTATE_MEMBERS_MAX \
            and value.count(",") < TRACESTATE_COMMAS_MAX and _TRACESTATE.fullmatch(value):
        return None
    # Malformed: say how.
    if not isinstance(value, str):
        return f"is not a string but {type(value).__name__}"
    if len(value) > TRACESTATE_MAX:
        return f"is longer than {TRACESTATE_MAX} characters"
    if value.count(",") >= TRACESTATE_COMMAS_MAX:
        return f"has {TRACESTATE_COMMAS_MAX} commas or more"
    if _TRACESTATE.fullmatch(value) is None:
        return "holds a member that is not key=value"
    return f"has more than {TRACESTATE_MEMBERS_MAX} members"


def trace_context_problem(headers: Mapping[str, Any]) -> Problem | None:
    """Why a row's trace context headers cannot go out as they are, or None (also when it has
    none): the header at fault as ``field`` (traceparent, or tracestate), and why. A malformed
    traceparent takes the tracestate with it (W3C: a tracestate means nothing without its
    traceparent), and so does a tracestate without a traceparent."""
    if TRACEPARENT_HEADER in headers:
        why = _traceparent_problem(headers[TRACEPARENT_HEADER])
        if why is not None:
            return Problem(TRACEPARENT_HEADER, f"header {TRACEPARENT_HEADER} {why} (W3C Trace "
                                               "Context: 00-<32 hex>-<16 hex>-<2 hex>)")
    elif TRACESTATE_HEADER in headers:
        return Problem(TRACESTATE_HEADER, f"header {TRACESTATE_HEADER} comes without a "
                                          f"{TRACEPARENT_HEADER}")
    if TRACESTATE_HEADER in headers:
        why = _tracestate_problem(headers[TRACESTATE_HEADER])
        if why is not None:
            return Problem(TRACESTATE_HEADER, f"header {TRACESTATE_HEADER} {why} (W3C Trace "
                                              "Context)")
    return None


def without_trace_context(headers: dict[str, Any], problem: Problem) -> dict[str, Any]:
    """``headers`` without what ``problem`` (trace_context_problem's) finds malformed: the
    tracestate, or both trace headers when the traceparent is at fault."""
    dropped = TRACE_HEADERS if problem.field == TRACEPARENT_HEADER else (TRACESTATE_HEADER,)
    return {name: value for name, value in headers.items() if name not in dropped}


def _depth_over(value: Any, limit: int) -> bool:
    """True if ``value`` nests more than ``limit`` objects or arrays deep (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def short_reason(exc: BaseException) -> str:
    """A library error as a dead-letter reason: its first line, at most REASON_MAX characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:REASON_MAX]


def ledger_address_problem(exchange: str, routing_key: str,
                           ledger_stream: str | None) -> Problem | None:
    """A row addressed to the ledger: the default exchange with the stream's name as routing key,
    or the ledger's own exchange. The relay would otherwise append it to the ledger itself."""
    if ledger_stream is None:
        return None
    if (exchange == "" and routing_key == ledger_stream) or exchange == ledger_stream:
        return Problem("exchange" if exchange else "routing_key", (
            f"addressed to the ledger stream {ledger_stream!r} (exchange {exchange!r}, "
            f"routing key {routing_key[:SHORTSTR_MAX]!r}): no row may write to the ledger"))
    return None


def timestamp_problem(created_at: float, shown: Any) -> Problem | None:
    if not (math.isfinite(created_at) and TIMESTAMP_MIN <= created_at < TIMESTAMP_END):
        return Problem("created_at", f"created_at {shown} cannot be an AMQP timestamp (a date "
                                     "from 1970 to 9999 is required)")
    return None


# A row whose available_at is in the year 10000 or later ('infinity' included) is never due:
# never published, and with an ordering key it would hold every later row of its key forever.
# The relay moves such rows to the dead-letter table (sql/queries.sql, dead_letter_never_due);
# the producer API refuses them.


def available_at_problem(available_at: datetime) -> Problem | None:
    """An aware ``available_at`` the relay would dead-letter as never due (a Python datetime
    reaches the year 10000 only in UTC, from 9999-12-31 with a negative offset)."""
    if available_at.timestamp() >= TIMESTAMP_END:
        return Problem("available_at", f"available_at {available_at.isoformat()} is never due "
                                       "(a date before the year 10000 is required)")
    return None


def _epoch(created_at: float | datetime) -> float:
    if isinstance(created_at, datetime):
        if created_at.tzinfo is None:
            created_at = created_at.replace(tzinfo=timezone.utc)
        return created_at.timestamp()
    return float(created_at)


def field_problem(*, message_id: str, exchange: str, routing_key: str, body_size: int,
                  headers: Any, content_type: str, created_at: float, created_shown: Any,
                  max_message_bytes: int, ledger_stream: str | None,
                  flat: bool = False, message_type: str | None = None,
                  correlation_id: str | None = None) -> Problem | None:
    """Why a message with these fields can never be published, or None, before its properties
    are encoded. ``flat``: headers known to be a dict of str and int values (no depth to check)."""
    error = (
        _shortstr("exchange", exchange)
        or _shortstr("routing_key", routing_key)
        or _shortstr("message_id", message_id)
        or _shortstr("content_type", content_type)
        or ledger_address_problem(exchange, routing_key, ledger_stream)
    )
    if error is None and (message_type is not None or correlation_id is not None):
        error = (_property_text("message_type", message_type)
                 or _property_text("correlation_id", correlation_id))
    if error is None and not isinstance(headers, dict):
        error = Problem("headers", f"headers must be a JSON object, got {type(headers).__name__}")
    if error is None and not flat and _depth_over(headers, HEADERS_DEPTH_MAX):
        error = Problem("headers", f"headers are nested deeper than {HEADERS_DEPTH_MAX} levels")
    error = error or timestamp_problem(created_at, created_shown)
    if error is None and body_size > max_message_bytes:
        error = Problem("payload", f"payload of {body_size} bytes exceeds "
                                   f"OUTBOX_MAX_MESSAGE_BYTES={max_message_bytes}")
    return error


def property_fields(message_id: str, content_type: str, table: Mapping[str, Any] | None,
                    created_at: float, user_id: str | None = None,
                    message_type: str | None = None,
                    correlation_id: str | None = None) -> dict[str, Any]:
    """The AMQP properties of a message (persistent), by pika's names. ``user_id``: the user
    of the relay's connection, which RabbitMQ checks (none from the producer API). The type
    and correlation_id properties are in the dict only when set (most rows set neither)."""
    fields = {"delivery_mode": 2, "message_id": message_id, "content_type": content_type,
              "headers": table or None, "timestamp": int(created_at), "user_id": user_id}
    if message_type is not None:
        fields["type"] = message_type
    if correlation_id is not None:
        fields["correlation_id"] = correlation_id
    return fields


def encoding_problem(fields: Mapping[str, Any], *, body_size: int,
                     frame_max: int) -> tuple[Problem | None, bytes | None]:
    """(why these properties cannot go out, or None; their wire form when struct encodes them).

    The header frame (properties, headers included) cannot be split: over frame_max, the broker
    closes the whole connection (FRAME_ERROR) and fails every batch in it.
    """
    try:
        wire = properties.wire(**fields)
        if not fields["headers"]:
            return None, wire
        if wire is None:
            wire = _pika_wire(fields)
    except Exception as exc:  # pika's encoder: struct.error, TypeError, ValueError, ...
        return Problem("headers", f"headers cannot be encoded as an AMQP table: {short_reason(exc)}"), None
    size = HEADER_FRAME_OVERHEAD + len(wire)
    if size > frame_max:
        return Problem("headers", f"headers make a header frame of {size} bytes, over "
                                  f"the broker's frame_max of {frame_max} bytes"), None
    return None, wire


def _pika_wire(fields: Mapping[str, Any]) -> bytes:
    """The properties as pika encodes them, for a shape struct does not encode (imported here
    only: most tables never need it, and the producer API loads no pika for them). The header
    frame is these bytes and HEADER_FRAME_OVERHEAD."""
    import pika.spec

    return b"".join(pika.spec.BasicProperties(**fields).encode())


def publish_problem(
    *,
    message_id: str,
    exchange: str,
    routing_key: str,
    body_size: int,
    headers: Any = None,
    ordering_key: str | None = None,
    content_type: str | None = None,
    json_payload: bool = True,
    created_at: float | datetime | None = None,
    max_message_bytes: int,
    frame_max: int = DEFAULT_FRAME_MAX,
    ledger_stream: str | None = None,
    headers_text: str | None = None,
    message_type: str | None = None,
    correlation_id: str | None = None,
) -> Problem | None:
    """Why the relay would dead-letter a row with these values (the field at fault and the
    reason it would dead-letter the row with), or None if it would publish it.

    ``headers`` is the decoded JSON value of the headers column (None: empty), the row's own:
    the relay's are added to it for an ``ordering_key`` (with the largest position, since the
    row's id is not known yet), and the header frame is measured with the longest user_id
    (the relay's user is not known either). ``body_size`` is the payload's size in bytes (a
    JSON payload's UTF-8 text), ``created_at`` a datetime or epoch seconds (None: now).
    ``frame_max`` is the broker's (the relay uses the value its connection negotiated),
    ``ledger_stream`` the relay's OUTBOX_LEDGER_STREAM, ``headers_text`` the headers' JSON text
    as it will be stored (measured first, as the relay does). The broker's verdicts
    (unroutable, no such exchange, refused) are not foreseen here.
    """
    if headers_text is not None:
        undecodable = headers_text_problem(headers_text, frame_max)
        if undecodable is not None:
            return Problem("headers", undecodable)
    stamp = datetime.now(timezone.utc).timestamp() if created_at is None else _epoch(created_at)
    headers = {} if headers is None else headers
    forged = relay_headers_problem(headers)
    if forged is not None:
        return forged
    headers = message_headers(headers, ordering_key, LARGEST_POSITION)
    content_type = content_type or default_content_type(json_payload)
    error = field_problem(
        message_id=message_id, exchange=exchange, routing_key=routing_key, body_size=body_size,
        headers=headers, content_type=content_type, created_at=stamp, created_shown=created_at,
        max_message_bytes=max_message_bytes, ledger_stream=ledger_stream,
        message_type=message_type, correlation_id=correlation_id)
    if error is not None:
        return error
    fields = property_fields(message_id, content_type, amqp_value(headers), stamp,
                             LONGEST_USER_ID, message_type, correlation_id)
    return encoding_problem(fields, body_size=body_size, frame_max=frame_max)[0]


def default_content_type(json_payload: bool) -> str:
    """The content type of a row that sets none: JSON for ``payload``, bytes for
    ``payload_bytes``."""
    return "application/json" if json_payload else "application/octet-stream"


# The headers' JSON text longer than this is measured before it is decoded: json.loads of it
# may take tens of times its size (an array of small integers or of empty objects), and a
# table it would make may be far over frame_max. Shorter texts decode within a few MiB.
HEADERS_TEXT_MEASURED_ABOVE = 4096
# The header frame besides its table: HEADER_FRAME_OVERHEAD, property flags (2), the lengths of
# content type and message id (1 each), delivery mode (1) and timestamp (8).
HEADER_FRAME_FLOOR = HEADER_FRAME_OVERHEAD + 13
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_GAP_TOKENS = (", ", ": ", "{", "[", "{}", "[]", "null", "true", "false")
_JSON_KINDS = {"[": "list", '"': "str", "t": "bool", "f": "bool", "n": "NoneType"}


def headers_text_problem(text: str, frame_max: int) -> str | None:
    """Why headers of this JSON text (jsonb as PostgreSQL prints it) can never be published,
    told without decoding it: a text of HEADERS_TEXT_MEASURED_ABOVE characters or more that is
    no object, or whose header frame would be over the broker's frame_max (header_frame_floor).
    None: decode it (decode_headers)."""
    if len(text) < HEADERS_TEXT_MEASURED_ABOVE:
        return None
    if text[0] != "{":
        kind = _JSON_KINDS.get(text[0]) or ("int" if text.lstrip("-").isdigit() else "float")
        return f"headers must be a JSON object, got {kind}"
    floor = header_frame_floor(text, above=frame_max)
    if floor > frame_max:
        return (f"headers make a header frame of at least {floor} bytes, over the broker's "
                f"frame_max of {frame_max} bytes")
    return None


def header_frame_floor(text: str, above: int | None = None) -> int:
    """The fewest bytes of a header frame carrying the table of this JSON object's text (jsonb
    as PostgreSQL prints it: ", " between items, ": " after keys), counted without decoding it;
    or, once that exceeds ``above``, a count over ``above`` (the rest is not read).

    Every value of a table costs its type byte, a container 4 bytes of length, a key 1 byte of
    length, a string 4 of length, a number 4 at least, a boolean 1, and every character of a
    string's text but its escapes one byte at least (an escape: 6 characters for one byte at
    most). This counts each of them outside the strings (str.count between one string and the
    next, in C; nothing is copied): a lower bound, so no table that fits is refused, within
    bytes of the exact size for the tables that cost the most to decode (many small values).
    A number counts 4 bytes however many digits jsonb keeps of it (trailing zeros included):
    a long text of a few numbers is decoded, not refused.
    """
    # What escapes take beyond one byte, in the whole text (backslashes are in strings only):
    # \uXXXX 6 characters, the others 2 (an escaped backslash counts twice: a bound still).
    unicode_escapes = text.count("\\u")
    escapes = 5 * unicode_escapes + text.count("\\") - unicode_escapes
    counts = dict.fromkeys(_GAP_TOKENS, 0)
    strings = string_chars = 0
    position = 0

    def floor() -> int:
        keys, containers = counts[": "], counts["{"] + counts["["]
        values = counts[", "] + containers - counts["{}"] - counts["[]"]
        booleans = counts["true"] + counts["false"]
        numbers = values - counts["null"] - booleans - (strings - keys) - (containers - 1)
        return (HEADER_FRAME_FLOOR + 4 * containers + values + keys + booleans
                + 4 * (strings - keys) + 4 * max(0, numbers) + max(0, string_chars - escapes))

    for found in _JSON_STRING.finditer(text):
        start, end = found.span()
        for token in _GAP_TOKENS:
            counts[token] += text.count(token, position, start)
        strings += 1
        string_chars += end - start - 2
        position = end
        # The count up to a string: exact but when that string is a key whose ": " is not
        # read yet, counted as a string value (4 bytes of length, not 1): 3 bytes less.
        if above is not None and strings % 256 == 0 and floor() - 3 > above:
            return floor() - 3
    for token in _GAP_TOKENS:
        counts[token] += text.count(token, position)
    return floor()


def decode_headers(text: str) -> tuple[Any, str | None]:
    """(the headers' value, None) or (None, why they cannot be decoded)."""
    try:
        return json.loads(text), None
    except RecursionError:
        return None, "headers are nested too deeply to decode"
    except (ValueError, OverflowError) as exc:
        return None, f"headers cannot be decoded: {short_reason(exc)}"
