"""Log formatting: a stable ``action`` key and the extras, as JSON or as text."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from relay import logs
from relay.logs import JsonFormatter, TextFormatter


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
