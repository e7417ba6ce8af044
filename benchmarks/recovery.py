"""Recovery: from SIGKILL of a relay holding a prepared batch to that batch delivered.

Two relays and a resolver run with default settings while a producer offers 500 events/s.
The victim relay SIGKILLs itself right after its PREPARE TRANSACTION (the test suite's
``OUTBOX_TEST_CRASH_AT=after_prepare`` hook), so it dies holding a prepared batch none of whose
messages was published. The rows of that batch are read from the outside (rows whose deleting
transaction, ``xmax``, is the victim's prepared one); the clock stops when the last of them has
reached the consumer: the resolver noticed the dead relay, rolled the batch back, and the
surviving relay published it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from benchmarks import processes
from benchmarks.steady import Consumer, Producer
from benchmarks.workload import DeliveryError, Servers, reset

RATE = 500

_HELD_ROWS = """
SELECT o.message_id FROM outbox o JOIN pg_prepared_xacts p ON o.xmax = p.transaction
WHERE starts_with(p.gid, %(gid_head)s)
"""


@dataclass
class RecoveryTrial:
    seconds: float
    batch_rows: int


def _held_sequences(db_url: str, instance: str, prefix: str) -> list[int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(_HELD_ROWS, {"gid_head": f"outbox:{instance}:"}).fetchall()
    return sorted(int(message_id.removeprefix(prefix + "-")) for (message_id,) in rows)


def trial(servers: Servers, logdir: Path, number: int, *, crash_after: int = 20,
          produce_seconds: float = 12.0) -> RecoveryTrial | None:
    """One kill and its recovery; None if the resolver finished the batch before it was read."""
    reset(servers)
    prefix = f"rec{number}"
    consumer = Consumer(servers, prefix)
    programs = [processes.resolver(servers, logdir, f"recovery-{number}-resolver"),
                processes.relay(servers, logdir, f"recovery-{number}-survivor")]
    victim = processes.relay(servers, logdir, f"recovery-{number}-victim",
                             OUTBOX_TEST_CRASH_AT="after_prepare",
                             OUTBOX_TEST_CRASH_AFTER=str(crash_after))
    programs.append(victim)
    try:
        instance = victim.log_field("relay_started", "instance")
        programs[1].log_field("relay_started", "instance")
        producer = Producer(servers, prefix, RATE, produce_seconds)
        victim.proc.wait(timeout=produce_seconds)
        killed_at = time.monotonic()
        held = _held_sequences(servers.db_url, instance, prefix)
        received = consumer.wait_for(held, timeout=60)
        recovered_at = max((received.at(s) for s in held), default=0.0)
        produced = producer.result()
        consumer.wait_for(range(produced.count), timeout=60)
    finally:
        for program in programs:
            program.stop()
        final = consumer.stop()
    final.check_exactly_once(produced.count, servers.db_url, f"recovery trial {number}")
    if not held:
        return None
    if not all(final.at(s) > killed_at for s in held):
        raise DeliveryError(f"recovery trial {number}: part of the held batch arrived before the kill")
    return RecoveryTrial(round(recovered_at - killed_at, 3), len(held))
