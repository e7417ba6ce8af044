"""The chaos runs' hostile neighbours (devenv/chaos_run.py): what parties that share the
servers do besides the hostile producer's rows, with devenv/hostile.py's attacks (issue 32).

- **Poisoned ledger records**: every ``gap`` seconds on average, two of ``poisoned_records``
  (a non-ASCII mac, oversized, malformed, a header timestamp past 9999...), naming a relay's
  batch in doubt at that moment when there is one (its real xid and database: anyone reads
  pg_prepared_xacts), appended to the ledger stream as any user of the vhost can.
- **Poisoned takeovers**: a relay of the neighbours' own is held right after its PREPARE (the
  crash point's stall: alive, its instance lock held), every one of ``poisoned_records`` is
  appended naming its batch, and it is SIGKILLed: the resolver must take the batch over
  through them and roll it back (one such record used to stop every takeover). Only a
  takeover whose relay still held its lock after the last record was confirmed counts: the
  scan that decides its batch then reads every record (its marker follows the lock). One at
  once, so a short run has one; then one every ``12 * gap`` seconds on average, and again
  2 s after one a fault spoiled (the relay's session cut, no batch to hold) until one counts.
- **Foreign prepared transactions**: gids of our prefix no relay makes (``foreign_gids``,
  prepared by the run's own role, a superuser like the resolver's, which could finish them)
  and a gid a relay could make prepared by a role that cannot read the ledger key
  (``relay_shaped_gid``), each kind once: one of each reason at once, then one every
  ``3 * gap`` seconds on average. Each stays prepared until the run's own cleanup
  (``Attacks.finish``): the resolver must leave it alone and say so.

What the resolver said about them is read from its JSON log (``ResolverLog``), and
``Attacks.verdict`` turns both into the run's figures and the counts that must be 0.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import pika.exceptions
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from devenv import launch
from devenv.hostile import (
    append_to_ledger,
    foreign_gids,
    poisoned_records,
    prepare_foreign,
    relay_shaped_gid,
)
from outbox_relay.gid import lock_class

PREFIX = "outbox"  # the programs' gid prefix (OUTBOX_GID_PREFIX's default)
ROLE = "chaos_neighbour"  # a LOGIN role with no grant: any role of the cluster
OWNER_KIND = "relay_shaped_other_role"  # the foreign kind whose reason is "owner"
STALL_SECONDS = 90  # how long the held relay would sleep after PREPARE (it is killed first)
WAIT_SECONDS = 30.0  # for the held relay's start, its batch, the records' confirms
ERRORS = (psycopg.Error, pika.exceptions.AMQPError, OSError, TimeoutError)

_T = TypeVar("_T")


def bounded(call: Callable[[], _T], seconds: float) -> _T:
    """``call()`` on a thread of its own, or TimeoutError after ``seconds`` (a confirm that
    never comes: the stream has no majority). The thread is left to finish by itself."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {seconds:g} s")
    if "error" in result:
        raise result["error"]
    return cast(_T, result["value"])


@dataclass
class Takeover:
    """A poisoned takeover that counts: the batch held, every record confirmed, then the kill."""

    gid: str
    records: int
    seconds: float | None  # from the kill until the batch was finished (None: not seen in 120 s)


@dataclass
class ResolverLog:
    """What the resolver's JSON log says about the attacks."""

    rejected: Counter[str] = field(default_factory=Counter)  # by reason, each record once
    rejected_naming: Counter[str] = field(default_factory=Counter)  # by the gid they name
    foreign: dict[str, set[str]] = field(default_factory=dict)  # gid -> reasons given
    outcomes: dict[str, set[str]] = field(default_factory=dict)  # gid -> resolved_* actions

    @classmethod
    def read(cls, path: Path) -> ResolverLog:
        said = cls()
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return said
        for line in text.splitlines():
            if not line.startswith("{"):
                continue  # a traceback, or what a program printed before its logging began
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            action, gid = entry.get("action"), entry.get("gid")
            if action == "ledger_record_rejected":
                said.rejected[str(entry.get("reason"))] += 1
                if isinstance(gid, str):
                    said.rejected_naming[gid] += 1
            elif action == "ledger_records_rejected_unlogged":
                for reason, count in (entry.get("reasons") or {}).items():
                    said.rejected[reason] += int(count)
            elif action == "foreign_prepared" and isinstance(gid, str):
                said.foreign.setdefault(gid, set()).add(str(entry.get("reason")))
            elif isinstance(action, str) and action.startswith("resolved_") and isinstance(
                    gid, str):
                said.outcomes.setdefault(gid, set()).add(action)
        return said


@dataclass
class Attacks:
    """What the neighbours did, for the run's watch, drain and check."""

    poisoned_records: int = 0  # appended to the ledger, the takeovers' included
    poisoned_naming_in_doubt: int = 0  # of the others, those naming a relay's batch in doubt
    takeovers: list[Takeover] = field(default_factory=list)
    takeovers_spoiled: int = 0  # attempts a fault spoiled, or that found no batch to hold
    # gid -> the reason the resolver must give: every foreign gid tried, in the order tried
    # (a PREPARE cut off by a fault may have happened or not: the end says which).
    foreign: dict[str, str] = field(default_factory=dict)
    confirmed: set[str] = field(default_factory=set)  # foreign PREPAREs that returned
    # Gid heads of the held relays: their batches are in doubt on purpose, and the longest
    # time in doubt leaves them out (the takeovers have a figure of their own).
    held: list[str] = field(default_factory=list)
    errors: int = 0  # attacks a fault made fail (retried by the next one)

    def not_relays(self) -> tuple[list[str], list[str]]:
        """(foreign gids, held relays' gid heads): what the run's in-doubt figures leave out."""
        return list(self.foreign), list(self.held)

    def finish(self, database_url: str) -> set[str]:
        """The run's own cleanup, once the programs have stopped: which foreign gids are still
        prepared (the resolver must have left every one alone); each is then rolled back."""
        with psycopg.connect(database_url, autocommit=True) as conn:
            prepared = {row[0] for row in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                " AND gid = ANY(%s)", (list(self.foreign),)).fetchall()}
            for gid in prepared:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        return prepared

    def verdict(self, said: ResolverLog, prepared_at_end: set[str]
                ) -> tuple[dict[str, Any], dict[str, int]]:
        """(figures, counts that must be 0) of the attacks, from what the resolver said and
        which foreign transactions were still prepared at the end. A foreign PREPARE that a
        fault cut off counts if it happened (it is prepared at the end: nothing else finishes
        a gid the resolver leaves alone)."""
        foreign = {gid: reason for gid, reason in self.foreign.items()
                   if gid in prepared_at_end or gid in self.confirmed}
        reported = [gid for gid, reason in foreign.items() if reason in said.foreign.get(gid, ())]
        committed = [t.gid for t in self.takeovers if "resolved_committed" in said.outcomes.get(
            t.gid, ())]
        unrejected = [t.gid for t in self.takeovers if not said.rejected_naming[t.gid]]
        expected_rejections = sum(t.records for t in self.takeovers)
        seconds = [t.seconds for t in self.takeovers if t.seconds is not None]
        figures: dict[str, Any] = {
            "poisoned_ledger_records": self.poisoned_records,
            "poisoned_records_naming_in_doubt": self.poisoned_naming_in_doubt,
            "poisoned_takeovers": len(self.takeovers),
            "poisoned_takeovers_spoiled": self.takeovers_spoiled,
            "poisoned_takeovers_rolled_back": sum(
                "resolved_rolled_back" in said.outcomes.get(t.gid, ()) for t in self.takeovers),
            "poisoned_takeover_max_seconds": round(max(seconds, default=0.0), 2),
            "ledger_records_rejected": sum(said.rejected.values()),
            "ledger_records_rejected_by_reason": dict(sorted(said.rejected.items())),
            "foreign_prepared": len(foreign),
            "foreign_prepared_by_reason": dict(sorted(Counter(foreign.values()).items())),
            "foreign_reported": len(reported),
            "foreign_left_prepared": len(prepared_at_end),
            "neighbour_attack_errors": self.errors,
        }
        zero = {
            # Finished by someone: the resolver may finish no foreign transaction.
            "foreign_finished": len(set(foreign) - prepared_at_end),
            "foreign_unreported": len(foreign) - len(reported),
            # A batch whose messages were never published, committed on a poisoned record.
            "takeovers_committed": len(committed),
            # The scan that decided a held batch read its records: each names it or is junk.
            "takeovers_unrejected": len(unrejected),
            "rejections_missing": max(0, expected_rejections - sum(said.rejected.values())),
        }
        return figures, zero


class Neighbours(threading.Thread):
    """The attacks above, on a thread, until ``stop`` is set."""

    def __init__(self, database_url: str, amqp_url: str, relay_env: dict[str, str],
                 logdir: Path, gap: float, stop: threading.Event, rng: random.Random) -> None:
        """``database_url`` and ``amqp_url``: the servers themselves (no proxy: the faults aim
        at the run's programs, not at the neighbours); ``relay_env``: the relays' settings, for
        the held relay."""
        super().__init__(daemon=True)
        self.database_url, self.amqp_url, self.gap = database_url, amqp_url, gap
        self.stop_event, self.rng = stop, rng
        self.attacks = Attacks()
        self.stranger_url = make_conninfo(database_url, user=ROLE)
        self.relay_env = {**relay_env, "OUTBOX_DATABASE_URL": database_url,
                          "OUTBOX_AMQP_URL": amqp_url, "OUTBOX_BATCH_SIZE": "5",
                          "OUTBOX_LOG_FORMAT": "json", "OUTBOX_TEST_CRASH_AT": "after_prepare",
                          "OUTBOX_TEST_STALL_SECONDS": str(STALL_SECONDS)}
        self.held_log = logdir / "held-relay.log"
        gids = foreign_gids(PREFIX)
        kinds = sorted(gids)
        rng.shuffle(kinds)
        # One of each reason first; the role's own relay-shaped gid sits far from the random
        # instances relays draw (1 in 2^31 of meeting one).
        self.foreign_queue: list[tuple[str, str, str]] = [
            (relay_shaped_gid(PREFIX, 0x7FFFFFFE), "owner", self.stranger_url),
            *((gids[kind], "gid", database_url) for kind in kinds)]

    @staticmethod
    def create_role(database_url: str) -> None:
        """The stranger: a LOGIN role with no grant (the servers trust local connections)."""
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(ROLE)))

    def run(self) -> None:
        gap = self.gap
        for _attempt in range(5):  # one of each reason at once (a fault may fail one)
            if len(self.attacks.foreign) >= 2 or self.stop_event.is_set():
                break
            if self._foreign() is False:
                time.sleep(1)
        counted = self._takeover()
        now = time.monotonic()
        next_takeover = now + (self.rng.uniform(0, 24 * gap) if counted else 2)
        next_poison = now + self.rng.uniform(0, 2 * gap)
        next_foreign = now + self.rng.uniform(0, 6 * gap)
        while not self.stop_event.wait(0.2):
            now = time.monotonic()
            if now >= next_poison:
                self._poison()
                next_poison = time.monotonic() + self.rng.uniform(0, 2 * gap)
            if now >= next_foreign and self.foreign_queue:
                self._foreign()
                next_foreign = time.monotonic() + self.rng.uniform(0, 6 * gap)
            if now >= next_takeover:
                counted = self._takeover()
                next_takeover = time.monotonic() + (self.rng.uniform(0, 24 * gap) if counted
                                                    else 2)

    # -- the attacks --------------------------------------------------------------------------

    def _in_doubt(self) -> tuple[str, int, str] | None:
        """A relay's batch in doubt right now (gid, xid, database), at random, or None."""
        foreign, held = self.attacks.not_relays()
        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(
                "SELECT gid, transaction::text::bigint, database FROM pg_prepared_xacts"
                " WHERE database = current_database() AND starts_with(gid, %s)"
                " AND gid <> ALL(%s::text[]) AND NOT gid ^@ ANY(%s::text[])"
                " ORDER BY random() LIMIT 1", (PREFIX + ":", foreign, held)).fetchone()
        return (str(row[0]), int(row[1]), str(row[2])) if row else None

    def _poison(self) -> None:
        """Two poisoned records, naming a batch in doubt if there is one."""
        try:
            doubt = self._in_doubt()
            gid, xid, database = doubt or (f"{PREFIX}:00000001:1", 1, "outbox")
            records = poisoned_records(gid, xid, database)
            chosen = {kind: records[kind] for kind in self.rng.sample(sorted(records), 2)}
            bounded(lambda: append_to_ledger(self.amqp_url, "outbox.ledger", chosen),
                    WAIT_SECONDS)
        except ERRORS:
            self.attacks.errors += 1
            return
        self.attacks.poisoned_records += len(chosen)
        if doubt is not None:
            self.attacks.poisoned_naming_in_doubt += len(chosen)

    def _foreign(self) -> bool:
        """PREPARE the next foreign gid, and leave it prepared; False if a fault made it fail.
        Then it is tried again next time, unless it may have been prepared (the end says
        whether)."""
        if not self.foreign_queue:
            return True
        gid, reason, url = attempt = self.foreign_queue.pop(0)
        self.attacks.foreign[gid] = reason  # before: a PREPARE cut off may still have happened
        try:
            bounded(lambda: prepare_foreign(url, gid), WAIT_SECONDS)
        except ERRORS:
            self.attacks.errors += 1
            if self._prepared(gid) is False:
                del self.attacks.foreign[gid]
                self.foreign_queue.insert(0, attempt)
            return False
        self.attacks.confirmed.add(gid)
        return True

    def _takeover(self) -> bool:
        """Hold a relay after PREPARE, poison its batch, kill it; True if it counts."""
        start = self.held_log.stat().st_size if self.held_log.exists() else 0
        relay = launch.launch("relay", self.relay_env, self.held_log, append=True)
        try:
            held = self._hold_and_poison(relay, start)
        except ERRORS:
            self.attacks.errors += 1
            held = None
        finally:
            relay.kill()
            relay.wait()
        if held is None:
            self.attacks.takeovers_spoiled += 1
            return False
        gid, records = held
        killed = time.monotonic()
        seconds = None
        while time.monotonic() - killed < 120 and not self.stop_event.is_set():
            if self._prepared(gid) is False:
                seconds = round(time.monotonic() - killed, 3)
                break
            time.sleep(0.05)
        self.attacks.takeovers.append(Takeover(gid, records, seconds))
        return True

    def _hold_and_poison(self, relay: Any, start: int) -> tuple[str, int] | None:
        deadline = time.monotonic() + WAIT_SECONDS
        instance = None
        while instance is None:
            if time.monotonic() > deadline or relay.poll() is not None:
                return None
            instance = self._instance(start)
            time.sleep(0.1)
        head = f"{PREFIX}:{instance}:"
        self.attacks.held.append(head)
        found = None
        while found is None:
            if time.monotonic() > deadline or relay.poll() is not None:
                return None
            with psycopg.connect(self.database_url, autocommit=True, connect_timeout=2) as conn:
                found = conn.execute(
                    "SELECT gid, transaction::text::bigint, database FROM pg_prepared_xacts"
                    " WHERE database = current_database() AND starts_with(gid, %s)",
                    (head,)).fetchone()
            time.sleep(0.05)
        gid, xid, database = str(found[0]), int(found[1]), str(found[2])
        records = poisoned_records(gid, xid, database)
        bounded(lambda: append_to_ledger(self.amqp_url, "outbox.ledger", records), WAIT_SECONDS)
        self.attacks.poisoned_records += len(records)
        if not self._lock_held(int(instance, 16)):
            return None  # its session was lost: the resolver may have decided it before them
        return gid, len(records)

    def _instance(self, start: int) -> str | None:
        """The held relay's instance, from its log's relay_started line."""
        with open(self.held_log, "rb") as log:
            log.seek(start)
            for line in log.read().splitlines():
                if line.startswith(b"{"):
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    if entry.get("action") == "relay_started":
                        return str(entry["instance"])
        return None

    def _lock_held(self, instance: int) -> bool:
        """Whether a relay's session holds the instance lock of ``instance`` right now: then no
        resolver can have taken the batch over yet (it takes the lock first)."""
        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(
                "SELECT EXISTS (SELECT FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
                " AND l.classid = %s::oid AND l.objid = %s::oid"
                " AND starts_with(a.application_name, 'outbox-relay'))",
                (lock_class(PREFIX), instance)).fetchone()
        return bool(row and row[0])

    def _prepared(self, gid: str) -> bool | None:
        """Whether ``gid`` is prepared in the run's database; None when PostgreSQL does not
        answer."""
        try:
            with psycopg.connect(self.database_url, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute("SELECT count(*) FROM pg_prepared_xacts"
                                   " WHERE database = current_database() AND gid = %s",
                                   (gid,)).fetchone()
        except psycopg.Error:
            return None
        return bool(row and row[0])
