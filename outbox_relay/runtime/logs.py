"""Log lines with a stable ``action`` key, as text or JSON (``OUTBOX_LOG_FORMAT=json``)."""

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
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        return redact(f"{text} [{fields}]" if fields else text)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # pika logs every connection drop at ERROR with a traceback; our own lines say it once.
    logging.getLogger("pika").setLevel(logging.CRITICAL)
