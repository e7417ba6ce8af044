"""How the cluster chaos run explains an order violation at its consumer (devenv/chaos_cluster.py):
a reversed run of unmarked deliveries on one connection is the broker's, not the relays'."""

from __future__ import annotations

from devenv import checker
from devenv.chaos_cluster import Received, order_violation_details


def consumer_of(positions: list[int], *, connections: list[int] | None = None,
                redelivered: list[bool] | None = None) -> list[Received]:
    """What a consumer got: events of two keys (even / odd position) in ``positions`` order,
    one a second."""
    connections = connections or [1] * len(positions)
    redelivered = redelivered or [False] * len(positions)
    return [Received(checker.Delivery(f"c-{n}", f"k{n % 2}", n), again, connection, None,
                     float(i))
            for i, (n, connection, again)
            in enumerate(zip(positions, connections, redelivered, strict=True))]


def details(received: list[Received]) -> list[dict[str, object]]:
    late = checker.late_first_copies([r.delivery for r in received])
    return order_violation_details(received, late, 0.0, [("relay", 0.5)])


def test_missed_deliveries_served_newest_first_are_a_reversed_run() -> None:
    # 1..4 missed by the channel, then served newest first: 4 before 2, 3 before 1.
    found = details(consumer_of([0, 4, 3, 2, 1, 5]))
    assert [(d["key"], d["reversed_run"]) for d in found] == [("k0", True), ("k1", True)]
    first_newer = found[0]["first_newer"]
    assert isinstance(first_newer, dict) and first_newer["message_id"] == "c-4"
    assert found[0]["late"] == {"message_id": "c-2", "seq": 2, "connection": 1,
                                "redelivered": False, "delivery_count": None, "at": 3.0,
                                "after_fault": ("relay", 2.5)}


def test_a_late_event_that_is_not_a_reversed_run_is_said_so() -> None:
    # Another connection, a redelivery, or a rising position between the two: not that path.
    assert [d["reversed_run"] for d in details(
        consumer_of([0, 4, 3, 2], connections=[1, 1, 2, 2]))] == [False]
    assert [d["reversed_run"] for d in details(
        consumer_of([0, 4, 3, 2], redelivered=[False, False, False, True]))] == [False]
    assert [d["reversed_run"] for d in details(consumer_of([0, 4, 5, 2]))] == [False]


def test_no_late_event_no_details() -> None:
    assert details(consumer_of([0, 1, 2, 3, 2])) == []
