"""Crash points: the named steps of a batch at which a fault-injection test may kill or stall
the relay.

The relay calls the ``fault`` function it was given (``Relay``, ``AmqpPublisher``) with each
point it passes. The installed programs give it ``no_fault``: no setting and no environment
variable of ``outbox-relay run`` turns a crash point on, so a production deployment cannot.
The tests' hook, and the variables that set it, live in ``devenv/crash_points.py``, a launcher
of the checkout that the wheel does not ship; ``devenv/launch.py`` runs it in place of the relay
when a launch asks for crash points.
"""

from __future__ import annotations

from collections.abc import Callable

Fault = Callable[[str], None]

CRASH_POINTS = (
    "after_claim",  # rows locked and deleted, not prepared yet
    "after_prepare",  # prepared, nothing published
    "mid_publish",  # half the batch written to the socket
    "after_publish",  # every message confirmed, no ledger record
    "after_ledger",  # ledger record confirmed, not committed
    "after_commit",  # COMMIT PREPARED done
)


def no_fault(_point: str) -> None:
    """The installed relay's hook: every crash point passes by."""
