"""Per-key order inside one batch: which messages go out together, and which wait.

The claim (relay/queries.sql) hands a batch every row of whose key older rows are published
or in the batch too. Inside the batch, one channel carries the messages to the broker in
publishing order, and what fails there fails for a prefix: a closed channel or a lost
connection takes every later message with it, a queue without a majority nacks every later
message too. What fails one message and not the next is routing: a message returned as
unroutable (mandatory) while the next one of its key, with another routing key, is routed.
So a key's messages go out at once while they share their route (exchange and routing key),
and a change of route starts a new wave: the next wave is published only once every message
of this one is confirmed. A batch whose keys keep one route each is one wave: full speed.
(A message pika cannot encode is never sent: the publisher holds back the rest of its key.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

from relay.model import Message, OutboxRow


def waves(messages: Sequence[Message]) -> list[list[Message]]:
    """The messages in waves, each in id order; empty for no messages."""
    ordered = sorted(messages, key=attrgetter("row_id"))
    routes = {(m.ordering_key, m.exchange, m.routing_key)
              for m in ordered if m.ordering_key is not None}
    if len(routes) == len({key for key, _exchange, _routing in routes}):
        return [ordered] if ordered else []  # every key keeps one route: one wave
    out: list[list[Message]] = []
    last: dict[str, tuple[int, tuple[str, str]]] = {}  # key -> (its wave, its route)
    for m in ordered:
        i = 0
        if m.ordering_key is not None:
            route = (m.exchange, m.routing_key)
            wave, previous = last.get(m.ordering_key, (-1, route))
            i = wave + 1 if previous != route else max(wave, 0)
            last[m.ordering_key] = (i, route)
        while len(out) <= i:
            out.append([])
        out[i].append(m)
    return out


def held_back(messages: Sequence[Message], stopped: Iterable[OutboxRow]) -> list[Message]:
    """Messages that must not be published in this batch: those of a key whose older row in the
    batch is ``stopped`` (dead-lettered, or refused before publishing)."""
    first: dict[str, int] = {}
    for row in stopped:
        if row.ordering_key is not None:
            first[row.ordering_key] = min(row.id, first.get(row.ordering_key, row.id))
    return [m for m in messages if m.ordering_key is not None
            and m.row_id > first.get(m.ordering_key, m.row_id)]
