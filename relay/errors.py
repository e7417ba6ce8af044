"""The relay's error hierarchy: every error the programs report on purpose is one of these."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error raised on purpose by outbox-relay."""


class ConfigError(OutboxError):
    """A setting has a value the programs cannot use."""


class StartupCheckError(OutboxError):
    """A server is reachable but not fit to run the protocol (2PC off, schema missing...)."""


class TransientError(OutboxError):
    """A connection-level fault: reconnect with backoff and try again."""


class BatchFailed(OutboxError):
    """The broker did not confirm every message of a batch; it must be rolled back."""


def first_line(text: str) -> str:
    """The first line of ``text`` without surrounding blanks ("" for blank text): error texts
    of libpq and pika run over several lines, logs and probe bodies want one."""
    return (text.strip().splitlines() or [""])[0]


def describe(exc: BaseException) -> str:
    """One line naming ``exc``: its text's first line, or its class when it has no text."""
    return first_line(str(exc)) or type(exc).__name__
