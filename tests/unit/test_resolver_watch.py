"""Which prepared batches wake the resolver between scans (resolver/watch.py)."""

from __future__ import annotations

from outbox_relay.resolver.watch import orphaned


def test_only_our_batches_whose_relay_holds_no_lock_wake_the_resolver() -> None:
    prepared = ["outbox:0000000a:1", "outbox:0000000b:7", "other:0000000c:1",
                "outbox:not-ours", "outbox:0000000d:2", "outbox:0000000e:3"]
    live = {0xA, 0xC}
    assert orphaned(prepared, live, "outbox") == [
        "outbox:0000000b:7", "outbox:0000000d:2", "outbox:0000000e:3"]
    # Batches the last scan had to leave (another role's) do not wake it again and again.
    assert orphaned(prepared, live, "outbox", {"outbox:0000000d:2"}) == [
        "outbox:0000000b:7", "outbox:0000000e:3"]
    assert orphaned([], live, "outbox") == []
