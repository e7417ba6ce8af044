"""The inbox's Prometheus metrics, for the consuming service to export with its own.

Opt-in: ``Inbox(..., metrics=InboxMetrics())``. Only this module imports prometheus-client
(``import outbox_relay`` does not: tests/unit/test_imports.py). ``InboxMetrics()`` declares
the metrics on prometheus-client's default registry (the one ``start_http_server`` and the
usual framework integrations serve), ``InboxMetrics(registry)`` on another; the metrics of one
registry are declared once, whatever the number of ``InboxMetrics`` made for it, so every
inbox of a process may make its own (the label ``consumer`` tells them apart).

What they measure (``Inbox.process``, ``process_async`` and the pika/aio-pika helpers, which
run them; ``Inbox.record`` in a transaction of the caller's own counts no outcome, since only
the caller knows whether it commits, only the untrusted order headers it finds):

- ``outbox_inbox_messages_total{consumer,outcome}``: messages by outcome, once their
  transaction committed (applied, duplicate, stale) or failed (the handler or the database
  raised, or a helper got a message without a message_id);
- ``outbox_inbox_handler_duration_seconds{consumer}``: each run of the handler, whether it
  returned or raised;
- ``outbox_inbox_event_age_seconds{consumer}``: how old an applied event was when its
  transaction committed, from the AMQP timestamp (the relay sets it from the outbox row's
  created_at): the producer's commit to the consumer's, the delay the service's users see;
- ``outbox_inbox_untrusted_order_total{consumer}``: ``Inbox.untrusted_order``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

# The outcomes counted: outbox_relay.inbox.Outcome's values, and failed.
OUTCOMES = ("applied", "duplicate", "stale", "failed")

HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
# The AMQP timestamp counts whole seconds (the relay truncates created_at): an age is up to a
# second more than the event's true age, so nothing finer than a second is told apart.
AGE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 21600.0,
               86400.0)


@dataclass(frozen=True)
class _Collectors:
    messages: Counter
    handler_duration: Histogram
    event_age: Histogram
    untrusted_order: Counter


_DECLARED: weakref.WeakKeyDictionary[CollectorRegistry, _Collectors] = weakref.WeakKeyDictionary()


def _declare(registry: CollectorRegistry) -> _Collectors:
    return _Collectors(
        messages=Counter(
            "outbox_inbox_messages_total",
            "Messages the inbox processed, by consumer and outcome: applied (the handler ran "
            "and committed), duplicate and stale (acked, handler not run), failed (the handler "
            "or the database raised, or no message_id)",
            ["consumer", "outcome"], registry=registry),
        handler_duration=Histogram(
            "outbox_inbox_handler_duration_seconds",
            "Time of each run of a consumer's handler, returned or raised (a run retried after "
            "a serialization failure counts again)",
            ["consumer"], buckets=HANDLER_BUCKETS, registry=registry),
        event_age=Histogram(
            "outbox_inbox_event_age_seconds",
            "Age of each applied event when its transaction committed: now minus the AMQP "
            "timestamp, which the relay sets from the outbox row's created_at (whole seconds, "
            "so up to 1 s more; an event delayed on purpose with available_at counts its delay)",
            ["consumer"], buckets=AGE_BUCKETS, registry=registry),
        untrusted_order=Counter(
            "outbox_inbox_untrusted_order_total",
            "Messages carrying order headers that check_order did not trust (user_id none of "
            "relay_users): applied without the per-key check",
            ["consumer"], registry=registry),
    )


class InboxMetrics:
    """The inbox's metrics on ``registry`` (None: prometheus-client's default REGISTRY)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        found = _DECLARED.get(self.registry)
        if found is None:
            found = _DECLARED[self.registry] = _declare(self.registry)
        self._collectors = found

    def for_consumer(self, consumer: str) -> ConsumerMetrics:
        """The children of one consumer, with every outcome declared (at 0) from the start."""
        c = self._collectors
        return ConsumerMetrics(
            outcomes={outcome: c.messages.labels(consumer, outcome) for outcome in OUTCOMES},
            handler_duration=c.handler_duration.labels(consumer),
            event_age=c.event_age.labels(consumer),
            untrusted_order=c.untrusted_order.labels(consumer))


@dataclass(frozen=True)
class ConsumerMetrics:
    """One consumer's metrics, looked up once (an Inbox holds these)."""

    outcomes: dict[str, Counter]
    handler_duration: Histogram
    event_age: Histogram
    untrusted_order: Counter


__all__ = ["AGE_BUCKETS", "HANDLER_BUCKETS", "OUTCOMES", "ConsumerMetrics", "InboxMetrics"]
