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
