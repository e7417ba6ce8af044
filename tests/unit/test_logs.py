"""Log formatting: a stable ``action`` key and the extras, as JSON or as text."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from outbox_relay.runtime import log_actions, logs
from outbox_relay.runtime.logs import JsonFormatter, TextFormatter
from tests.conftest import package_sources


def record(msg: str = "batch %s", *args: Any, level: int = logging.WARNING,
           extra: dict[str, Any] | None = None, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.getLogger("relay").makeRecord(
        "relay", level, __file__, 1, msg, args or ("rolled back",), exc_info, extra=extra)


def as_json(rec: logging.LogRecord) -> dict[str, Any]:
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def test_json_line_has_the_standard_keys_and_the_action() -> None:
    line = as_json(record(extra={"action": "batch_rolled_back"}))

    assert line["level"] == "WARNING"
    assert line["logger"] == "relay"
    assert line["message"] == "batch rolled back"
    assert line["action"] == "batch_rolled_back"


def test_json_line_includes_the_extras() -> None:
    line = as_json(record(extra={"action": "row_failed", "row_id": 42, "gid": "outbox:00000abc:1"}))

    assert line["row_id"] == 42
    assert line["gid"] == "outbox:00000abc:1"


def test_json_line_leaves_out_standard_record_attributes() -> None:
    line = as_json(record(extra={"action": "x"}))

    assert not {"args", "msg", "pathname", "lineno", "levelno", "created", "exc_info"} & set(line)


def test_json_action_is_null_without_one() -> None:
    assert as_json(record())["action"] is None


def test_json_time_is_utc_iso8601() -> None:
    parsed = datetime.fromisoformat(as_json(record())["time"])

    assert parsed.utcoffset() is not None
    assert parsed.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_json_shows_unserializable_extras_as_text() -> None:
    assert as_json(record(extra={"action": "x", "where": {1, 2}}))["where"] == "{1, 2}"


def test_json_includes_the_exception() -> None:
    line = as_json(record(exc=True))

    assert "RuntimeError: boom" in line["exception"]


def test_text_line_has_level_logger_message_and_extras() -> None:
    text = TextFormatter().format(record(extra={"action": "batch_failed", "batch_size": 3}))

    assert text.endswith(" WARNING relay batch rolled back [action=batch_failed batch_size=3]")


def test_text_line_without_extras_has_no_brackets() -> None:
    text = TextFormatter().format(record())

    assert text.endswith(" WARNING relay batch rolled back")
    assert "[" not in text


# -- a producer's text: one line, no terminal escapes ----------------------------------------------

# A message id that forges a line of its own, an ANSI sequence that clears the screen, a
# carriage return that overwrites the line on a terminal, Unicode's line separator, a
# right-to-left override that shows the line's end reversed.
HOSTILE = "m-1\n2026-01-01 00:00:00,000 ERROR relay forged\r\x1b[2J\x85\u2028\u202eq\t\x7f\x00"
ESCAPED = ("m-1\\n2026-01-01 00:00:00,000 ERROR relay forged\\r\\x1b[2J\\x85\\u2028"
           "\\u202eq\\t\\x7f\\x00")


def test_printable_escapes_every_character_python_would_not_print() -> None:
    assert logs.printable(HOSTILE) == ESCAPED
    assert logs.printable("gid outbox:00000abc:1 'quoted' é€😀 \\n") == (
        "gid outbox:00000abc:1 'quoted' é€😀 \\n")  # already printable: as it is


def test_text_line_escapes_a_producers_text_in_the_message_and_the_extras() -> None:
    text = TextFormatter().format(record(
        "row dead-lettered: %s", HOSTILE, extra={"action": "row_dead_lettered",
                                                 "message_id": HOSTILE, "row_id": 7}))

    assert len(text.splitlines()) == 1 and text.isprintable()
    assert text.endswith(f" WARNING relay row dead-lettered: {ESCAPED} "
                         f"[action=row_dead_lettered message_id={ESCAPED} row_id=7]")


def test_text_traceback_lines_are_indented_and_escaped() -> None:
    try:
        raise RuntimeError(f"failed on {HOSTILE}")
    except RuntimeError:
        exc_info = sys.exc_info()
    rec = logging.getLogger("relay").makeRecord(
        "relay", logging.ERROR, __file__, 1, "crashed", (), exc_info, extra={"action": "x"})
    first, *rest = TextFormatter().format(rec).split("\n")

    assert first.endswith(" ERROR relay crashed [action=x]")
    assert rest[0] == "  Traceback (most recent call last):"
    # The exception's own newline ends a line of the traceback; the forged line after it is
    # indented like the rest, never at the margin where a record starts.
    assert rest[-2:] == ["  RuntimeError: failed on m-1",
                         "  " + ESCAPED.split("\\n", 1)[1]]
    assert all(line.startswith("  ") and line.isprintable() for line in rest)


def test_json_line_escapes_a_producers_text_by_itself() -> None:
    line = JsonFormatter().format(record("row dead-lettered: %s", HOSTILE,
                                         extra={"action": "x", "message_id": HOSTILE}))

    assert line.isascii() and line.isprintable()
    parsed = json.loads(line)
    assert parsed["message"] == f"row dead-lettered: {HOSTILE}"
    assert parsed["message_id"] == HOSTILE  # kept exactly


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("pika").level)
    yield root
    root.handlers[:], root.level = saved[0], saved[1]
    logging.getLogger("pika").setLevel(saved[2])


@pytest.mark.parametrize(("fmt", "formatter"), [("json", JsonFormatter), ("text", TextFormatter)])
def test_setup_installs_one_handler_with_the_format(root_logging: logging.Logger, fmt: str,
                                                    formatter: type[logging.Formatter]) -> None:
    logs.setup("DEBUG", fmt)

    assert len(root_logging.handlers) == 1
    assert isinstance(root_logging.handlers[0].formatter, formatter)
    assert root_logging.level == logging.DEBUG
    assert logging.getLogger("pika").level == logging.CRITICAL


# -- never a password ---------------------------------------------------------------------------

PW = "p@ss:w#rd?x"  # libpq takes an unencoded @, :, # or ? in a password (not a /)


@pytest.mark.parametrize(("text", "shown"), [
    ("cannot connect: postgresql://app:hunter2@db:5432/x failed",
     "cannot connect: postgresql://app:***@db:5432/x failed"),
    ("amqps://relay:s3cr3t%40x@rabbit:5671/%2F", "amqps://relay:***@rabbit:5671/%2F"),
    ("url amqp://u:a@b@host/vh", "url amqp://u:***@host/vh"),  # an unencoded @ in it
    ("host=db user=app password=hunter2 dbname=x", "host=db user=app password=*** dbname=x"),
    (r"password = 'it\'s secret' sslmode=require", "password = *** sslmode=require"),
    ("PASSWORD=abc", "PASSWORD=***"),
    ("postgresql://app@db/x and amqp://guest@h/", "postgresql://app@db/x and amqp://guest@h/"),
    ("gid outbox:00000abc:12 batch_size=500", "gid outbox:00000abc:12 batch_size=500"),
    # Unencoded "/", "#" and "?" in a password: masked whole, not up to the first "/".
    ("amqp://relay:se/cr#t?x@mq:5672/%2F", "amqp://relay:***@mq:5672/%2F"),
    ("postgresql://app:a/b@db/x", "postgresql://app:***@db/x"),
    ("sslmode=verify-full sslpassword=k3y host=db", "sslmode=verify-full sslpassword=*** host=db"),
    ("postgresql://db/x?sslpassword=k3y", "postgresql://db/x?sslpassword=***"),
])
def test_redact_masks_passwords_and_nothing_else(text: str, shown: str) -> None:
    assert logs.redact(text) == shown


def test_json_line_masks_passwords_everywhere_and_stays_json() -> None:
    secret_url = 'postgresql://app:s3"cr}t@db/x'
    try:
        raise RuntimeError(f"boom: {secret_url}")
    except RuntimeError:
        exc_info = sys.exc_info()
    rec = logging.getLogger("psycopg").makeRecord(
        "psycopg", logging.ERROR, __file__, 1, "failed: %s password=%s", (secret_url, 's3"cr}t'),
        exc_info, extra={"action": "x", "url": secret_url, "obj": {secret_url}})
    line = JsonFormatter().format(rec)

    assert 's3\\"cr}t' not in line and "s3" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "failed: postgresql://app:***@db/x password=***"
    assert parsed["url"] == "postgresql://app:***@db/x"
    assert parsed["obj"] == "{'postgresql://app:***@db/x'}"
    assert "postgresql://app:***@db/x" in parsed["exception"]


def test_text_line_masks_passwords() -> None:
    text = TextFormatter().format(record("connect to %s", f"amqp://relay:{PW}@h/%2F",
                                         extra={"action": "x", "url": f"amqp://relay:{PW}@h/"}))
    assert "ss:w" not in text
    assert text.count("amqp://relay:***@h/") == 2


# -- URLs in any text (the cases of the former config.redact_url) ------------------------------


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://relay:hunter2@db:5432/app", "postgresql://relay:***@db:5432/app"),
    ("amqp://guest:guest@mq:5672/%2F?heartbeat=30", "amqp://guest:***@mq:5672/%2F?heartbeat=30"),
    ("postgresql://relay:p@ss@db/app", "postgresql://relay:***@db/app"),
    ("amqp://:token@mq/", "amqp://:***@mq/"),
    ("postgresql://relay:pw@[::1]:5432/app", "postgresql://relay:***@[::1]:5432/app"),
])
def test_redact_url_replaces_the_password(url: str, shown: str) -> None:
    assert logs.redact(url) == shown


@pytest.mark.parametrize("url", ["postgresql://relay@db/app", "postgresql://db/app",
                                 "amqp://mq", "postgresql:///app?host=/tmp"])
def test_redact_url_keeps_urls_without_password(url: str) -> None:
    assert logs.redact(url) == url


def test_redact_url_hides_the_password_of_unparsable_urls() -> None:
    assert logs.redact("postgresql://u:pw@[::1/app") == "postgresql://u:***@[::1/app"


@pytest.mark.parametrize("url", ["postgresql://relay:s3cr#et@db/app", "postgresql://relay:s3cr?et@db/app"])
def test_redact_url_never_shows_a_password_with_url_delimiters(url: str) -> None:
    assert "s3cr" not in logs.redact(url)


# -- the declared actions (outbox_relay/runtime/log_actions.py, docs/operations.md) are the code's -----------

ROOT = Path(__file__).resolve().parents[2]


def code_actions() -> set[str]:
    found: set[str] = set()
    for path in package_sources():
        text = path.read_text("utf-8")
        found |= set(re.findall(r'"action": "([a-z_]+)"', text))
        # The f-string families, one action per outcome.
        if 'f"batch_{outcome}"' in text:
            found |= {"batch_committed", "batch_rolled_back"}
        if 'f"resolved_{outcome}"' in text:
            found |= {"resolved_committed", "resolved_rolled_back", "resolved_already_finished"}
        if 'f"{self.program}_started"' in text:  # outbox_relay/runtime/loop.py, for both programs
            found |= {f"{program}_{event}" for program in ("relay", "resolver")
                      for event in ("started", "stopped")}
    return found


def declared_actions() -> set[str]:
    """outbox_relay/runtime/log_actions.py: what docs/operations.md's table of actions is generated from."""
    return {action for entry in log_actions.ACTIONS for action in entry.actions}


def test_the_declared_actions_are_exactly_the_actions_the_programs_log() -> None:
    code = code_actions()
    assert len(code) > 20
    assert code == declared_actions()
