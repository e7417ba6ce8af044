"""Per-key order inside one batch: which messages go out together, and which wait.

The claim (sql/queries.sql) hands a batch every row of whose key older rows are published
or in the batch too. Inside the batch, messages of one key could go out back to back on one
channel, in id order, if what fails there failed for a suffix: the message that fails and every
later one. It does not. A message returned as unroutable fails alone while the next one of its
key, with another routing key, is routed. And a quorum queue that loses its majority while a
batch waits for its confirms can nack some of its messages and confirm later ones once a
leader is back: RabbitMQ 3.10 did so in the suite's cluster chaos run (30 events nacked, the
next event of each of their keys confirmed and consumed before them). So a key has
one message unconfirmed at a time: a key's n-th message of the batch goes in wave n, and the
next wave is published only once every message of this one is answered; a key whose message was
not confirmed (returned, nacked) sends no more (relay/worker.py, _publish), while the other keys
go on. A batch in which no
key repeats is one wave: full speed, whatever the number of keys (10,000 keys and batches of
2,000); with few keys a batch is as many waves as its busiest key has rows (docs/performance.md).
(A message pika cannot encode is never sent: the publisher holds back the rest of its key.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

from outbox_relay.model import Message, OutboxRow


def waves(messages: Sequence[Message]) -> list[list[Message]]:
    """The messages in waves, each in id order: a key's n-th message in wave n, messages
    without a key in the first; empty for no messages."""
    ordered = sorted(messages, key=attrgetter("row_id"))
    keys = [m.ordering_key for m in ordered if m.ordering_key is not None]
    if len(set(keys)) == len(keys):
        return [ordered] if ordered else []  # no key repeats: one wave
    out: list[list[Message]] = []
    sent: dict[str, int] = {}  # key -> its messages so far
    for m in ordered:
        i = 0
        if m.ordering_key is not None:
            i = sent.get(m.ordering_key, 0)
            sent[m.ordering_key] = i + 1
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
