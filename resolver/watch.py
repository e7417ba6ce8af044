"""The resolver's watch: learn between two scans that a relay died holding a prepared batch.

A relay's death ends its PostgreSQL session (the kernel closes the socket of a killed process)
and with it the session-level advisory lock on its instance id. Every OUTBOX_RESOLVER_WATCH_
INTERVAL (0.1 s) one query (the ``watch`` query, ``PreparedStore.watch``) reads the prepared
batches of our prefix and the instance locks held now; a batch whose relay holds no lock wakes
the resolver, which scans at once instead of at its next interval. The watch only wakes: the
scan decides, with every check it always makes (the lock taken, the owner, the hard limit, the
ledger).

Cost: no connection of its own (the resolver's session, idle between scans) and up to
1 / OUTBOX_RESOLVER_WATCH_INTERVAL queries a second, each reading shared memory only (well
under a millisecond of server time; pg_locks is read only while a batch is prepared).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from outbox_relay.gid import Gid


def orphaned(prepared: Sequence[str], live: Collection[int], prefix: str,
             ignored: Collection[str] = ()) -> list[str]:
    """The gids of ``prepared`` that are ours and whose relay holds no instance lock
    (``live``), except ``ignored`` ones (batches the last scan already saw and had to leave:
    another role's, which this resolver may not finish; waking for them would loop)."""
    found = []
    for text in prepared:
        gid = Gid.parse(text)
        if gid is not None and gid.prefix == prefix and gid.instance not in live \
                and text not in ignored:
            found.append(text)
    return found
