"""Recovery: from SIGKILL of a relay at a crash point to its batch finished and delivered.

Two relays and a resolver run with default settings while a producer offers 500 events/s
(``--recovery-rate``).
The victim relay SIGKILLs itself at one of the protocol's crash points (the test suite's
``OUTBOX_TEST_CRASH_AT`` hook, relay/faults.py): after its claim, after PREPARE, halfway
through publishing, after the broker confirmed the batch, after the ledger record, after
COMMIT PREPARED. The kill is seen at once (a pidfd of the victim), and two clocks start:

- resolved: the victim's prepared batch has left ``pg_prepared_xacts`` (the resolver
  committed or rolled it back), polled every few milliseconds; 0 at the points that leave
  nothing prepared (after the claim PostgreSQL rolls back the dead session's transaction;
  after COMMIT PREPARED there is nothing to finish);
- delivered: every event committed before the kill has reached the consumer (the victim's
  batch among them: a rolled-back one once the surviving relay published it again).

A trial's figure is the later of the two. Every trial is checked: every event delivered,
copies only of the victim's batch and only at the points where the broker may hold a batch
PostgreSQL rolls back (``mid_publish``, ``after_publish``).
"""

from __future__ import annotations

import os
import select
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import processes
from benchmarks.steady import Consumer, Producer
from benchmarks.workload import DeliveryError, Servers, outbox_rows, reset
from outbox_relay.relay.faults import CRASH_POINTS

RATE = 500
# Points where the broker may hold messages of a batch that is then rolled back: copies.
MAY_DUPLICATE = frozenset({"mid_publish", "after_publish"})
# Points where the victim dies holding a prepared batch.
PREPARED = frozenset({"after_prepare", "mid_publish", "after_publish", "after_ledger"})
POLL = 0.005  # seconds between two looks at pg_prepared_xacts while the batch is in doubt

_HELD_ROWS = """
SELECT o.message_id FROM outbox o JOIN pg_prepared_xacts p ON o.xmax = p.transaction
WHERE starts_with(p.gid, %(gid_head)s)
"""
_PREPARED = "SELECT count(*) FROM pg_prepared_xacts WHERE starts_with(gid, %(gid_head)s)"


@dataclass
class RecoveryTrial:
    crash_at: str
    seconds: float  # the later of the two below
    resolved_s: float  # kill -> the victim's prepared batch finished (0: none was prepared)
    delivered_s: float  # kill -> every event committed before the kill delivered
    batch_rows: int  # rows of the victim's prepared batch (0: none was prepared)
    outcome: str  # the resolver's decision, or what PostgreSQL did without it


def _wait_exit(pid: int, timeout: float) -> float:
    """Block until process ``pid`` exits; the monotonic time it did (the kernel's wake-up,
    not a poll's)."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        raise DeliveryError(f"the victim relay did not reach its crash point in {timeout:g} s")
    return time.monotonic()


def _held_sequences(conn: psycopg.Connection[Any], gid_head: str, prefix: str) -> list[int]:
    rows = conn.execute(_HELD_ROWS, {"gid_head": gid_head}).fetchall()
    return sorted(int(message_id.removeprefix(prefix + "-")) for (message_id,) in rows)


def _resolved_at(conn: psycopg.Connection[Any], gid_head: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(_PREPARED, {"gid_head": gid_head}).fetchone()
        now = time.monotonic()
        if row is not None and row[0] == 0:
            return now
        if now > deadline:
            raise DeliveryError(f"the victim's batch still in doubt after {timeout:g} s")
        time.sleep(POLL)


def _outcome(resolver: processes.Program, held: list[int], crash_at: str) -> str:
    if not held:
        return "rolled back by PostgreSQL" if crash_at == "after_claim" else "nothing in doubt"
    text = resolver.log_path.read_text(errors="replace")
    return ("committed" if '"resolved_committed"' in text else
            "rolled back" if '"resolved_rolled_back"' in text else "finished by another")


def trial(servers: Servers, logdir: Path, number: int, crash_at: str = "after_prepare", *,
          rate: int = RATE, crash_after: int = 10, produce_seconds: float = 6.0
          ) -> RecoveryTrial | None:
    """One kill at ``crash_at`` and its recovery; None if the victim's prepared batch was
    finished before it could be read (the trial would say 0 s)."""
    reset(servers)
    prefix = f"rec{number}"
    consumer = Consumer(servers, prefix)
    resolver = processes.resolver(servers, logdir, f"recovery-{number}-resolver")
    survivor = processes.relay(servers, logdir, f"recovery-{number}-survivor")
    victim = processes.relay(servers, logdir, f"recovery-{number}-victim",
                             OUTBOX_TEST_CRASH_AT=crash_at,
                             OUTBOX_TEST_CRASH_AFTER=str(crash_after))
    programs = [resolver, survivor, victim]
    try:
        gid_head = f"outbox:{victim.log_field('relay_started', 'instance')}:"
        survivor.log_field("relay_started", "instance")
        resolver.log_field("resolver_started", "action")
        producer = Producer(servers, prefix, rate, produce_seconds)
        killed_at = _wait_exit(victim.pid, produce_seconds)
        with psycopg.connect(servers.db_url, autocommit=True) as conn:
            held = _held_sequences(conn, gid_head, prefix)
            resolved_at = _resolved_at(conn, gid_head, 60) if held else killed_at
        produced = producer.result()
        before_kill = [seq for seq, at in enumerate(produced.commit_at) if at < killed_at]
        received = consumer.wait_for(before_kill, timeout=60)
        delivered_at = max((received.at(s) for s in before_kill), default=killed_at)
        consumer.wait_for(range(produced.count), timeout=60)
    finally:
        for program in programs:
            program.stop()
        final = consumer.stop()
    what = f"recovery trial {number} ({crash_at})"
    _check(final, produced.count, servers.db_url, what,
           max_duplicates=len(held) if crash_at in MAY_DUPLICATE else 0)
    if crash_at in PREPARED and not held:
        return None
    if crash_at == "after_prepare" and not all(final.at(s) > killed_at for s in held):
        raise DeliveryError(f"{what}: part of the held batch arrived before the kill")
    resolved, delivered = resolved_at - killed_at, max(0.0, delivered_at - killed_at)
    return RecoveryTrial(crash_at, round(max(resolved, delivered), 3), round(resolved, 3),
                         round(delivered, 3), len(held), _outcome(resolver, held, crash_at))


def _check(final: Any, produced: int, db_url: str, what: str, *, max_duplicates: int) -> None:
    """Every event arrived, nothing foreign did, copies within the bound, the outbox empty."""
    missing = sum(1 for seq in range(produced) if not final.at(seq))
    left = outbox_rows(db_url)
    if missing or final.unexpected or final.duplicates > max_duplicates or left:
        raise DeliveryError(f"{what}: {missing} lost, {final.duplicates} duplicates (at most "
                            f"{max_duplicates}), {final.unexpected} unexpected, {left} left")


def run(servers: Servers, logdir: Path, *, points: Sequence[str] = CRASH_POINTS,
        trials: int = 3, rate: int = RATE, say: Any = print) -> dict[str, Any]:
    """``trials`` kills at each of ``points`` while ``rate`` events/s are offered; p50 and max
    per point and over all of them."""
    by_point: dict[str, Any] = {}
    number = 0
    for point in points:
        found: list[RecoveryTrial] = []
        for _attempt in range(trials + 3):  # a trial whose batch went unseen is run again
            if len(found) == trials:
                break
            number += 1
            say(f"recovery at {point}: trial {len(found) + 1}/{trials}")
            done = trial(servers, logdir, number, point, rate=rate)
            if done is not None:
                found.append(done)
        by_point[point] = summary(found)
    every = [t for entry in by_point.values() for t in entry["seconds"]]
    return {"offered_events_per_s": rate, "points": by_point, "seconds": every,
            "median_s": _median(every), "max_s": max(every) if every else None}


def summary(trials: list[RecoveryTrial]) -> dict[str, Any]:
    seconds = [t.seconds for t in trials]
    return {"trials": [vars(t) for t in trials], "seconds": seconds,
            "median_s": _median(seconds), "max_s": max(seconds) if seconds else None,
            "resolved_median_s": _median([t.resolved_s for t in trials]),
            "delivered_median_s": _median([t.delivered_s for t in trials])}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None
