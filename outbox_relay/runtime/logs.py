"""Log lines with a stable ``action`` key, as text or JSON (``OUTBOX_LOG_FORMAT=json``).

Lines carry a producer's text (message ids, routing keys, dead-letter reasons quoting a row's
values): each is one line whatever that text holds. JSON escapes every control character by
itself (``json.dumps``, ASCII only); the text format escapes them with ``printable``, so a
producer can neither start a line that looks like the program's own nor send a terminal's
escape sequences to whoever reads the log.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import datetime, timezone

# LogRecord attributes that are not "extra" fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


# A safety net under "never log a password": the programs never put a URL's password in a
# message, but a library's exception text might. URL userinfo passwords (up to the last "@" of
# the URL, so an unencoded "/", "#", "?" or "@" in one is covered) and libpq's key=value
# ``password=...`` and ``sslpassword=...`` are masked in every line, whatever logger wrote it.
_URL_PASSWORD_RE = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:)\S+@")
_KV_PASSWORD_RE = re.compile(r"(\b\w*password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with passwords in URLs and in libpq key=value strings replaced by ``***``."""
    return _KV_PASSWORD_RE.sub(r"\1***", _URL_PASSWORD_RE.sub(r"\1***@", text))


def _escaped(char: str) -> str:
    return repr(char)[1:-1]  # "\n", "\x1b", "\u2028": Python's escape of one character


def printable(text: str) -> str:
    """``text`` with every character Python would not print written as its escape: control
    characters (newline, carriage return, tab, ESC and the rest of C0 and C1), line and
    paragraph separators, format characters (bidirectional overrides), unassigned ones. The
    text of a well-behaved program is returned as it is, at the cost of one ``isprintable``."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "action": getattr(record, "action", None),
            "message": record.getMessage(),
        }
        line.update(_extras(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        # Redacted value by value, before encoding, so the line always stays valid JSON.
        return json.dumps({k: redact(v) if isinstance(v, str) else v for k, v in line.items()},
                          default=lambda v: redact(str(v)))


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger> <message> [key=value ...]`` on one line: the message and the
    values escaped (``printable``). A traceback follows on lines of its own, each indented and
    escaped, so only a record's first line starts at the margin."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = (f"{self.formatTime(record, self.datefmt)} {record.levelname} {record.name} "
                f"{printable(record.getMessage())}")
        fields = " ".join(f"{k}={printable(str(v))}" for k, v in _extras(record).items())
        if fields:
            text = f"{text} [{fields}]"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for more in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if more:
                text += "".join(f"\n  {printable(line)}" for line in more.split("\n"))
        return redact(text)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # pika logs every connection drop at ERROR with a traceback; our own lines say it once.
    logging.getLogger("pika").setLevel(logging.CRITICAL)
