"""What both chaos runs share: devenv/chaos.py (single servers) and devenv/chaos_cluster.py
(a RabbitMQ cluster and a PostgreSQL primary/standby pair).

The skeleton, ``Run.main``: the options, the servers (the run's own, ``Run.start``), relays and
a resolver reaching them through proxies the faults can cut (``Programs``), a steady producer
and a hostile one (``Producer``, ``HostileProducer``), the hostile neighbours (poisoned ledger
records, foreign prepared transactions: devenv/chaos_neighbours.py), what the run watches besides
(``Run.watch``), the fault loop (an ``Injector`` of the run's kinds), the drain of the outbox
and of the batches in doubt, the check (``Run.collect``) and the report: a figure a line, the
JSON file, OK or FAILED, and the logs kept on failure. A run says only what differs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pika
import pika.exceptions
import psycopg
from psycopg.types.json import Jsonb

from devenv import checker, launch
from devenv.chaos_neighbours import Attacks, Neighbours, ResolverLog
from devenv.proxy import Proxy
from outbox_relay.schema import migrate

EXCHANGE = "chaos.events"
QUEUE = "chaos.sink"
LEDGER = "outbox.ledger"
MAX_MESSAGE_BYTES = 256 * 1024  # the relays' OUTBOX_MAX_MESSAGE_BYTES in the chaos runs

# Hostile rows: {kind: the columns a buggy or malicious producer writes}. Each can never be
# published; every one must end in the dead-letter table, whatever the faults.
HOSTILE: dict[str, dict[str, Any]] = {
    "nested_headers": {"headers": "NESTED"},
    "headers_not_object": {"headers": Jsonb(["not", "an", "object"])},
    "headers_over_frame_max": {"headers": Jsonb({"big": "x" * 200_000})},
    "header_int_too_big": {"headers": Jsonb({"n": 2**70})},
    # The relay's order headers on a keyless row, at the largest position: an inbox with the
    # per-key check would skip every later event of the key (issue 32).
    "forged_order_headers": {"headers": Jsonb({"x-ordering-key": "k1", "x-outbox-id": 2**63 - 1})},
    "created_infinity": {"created_at": "infinity"},
    "created_minus_infinity": {"created_at": "-infinity"},
    "created_bc": {"created_at": "4713-01-01 00:00:00+00 BC"},
    "created_year_10000": {"created_at": "10000-01-01 00:00:00+00"},
    "created_1960": {"created_at": "1960-01-01 00:00:00+00"},
    "forged_ledger_default_exchange": {"exchange": "", "routing_key": LEDGER, "payload": "FORGED"},
    "forged_ledger_exchange": {"exchange": LEDGER, "routing_key": LEDGER, "payload": "FORGED"},
    "oversized_payload": {"payload_bytes": b"\x00" * (MAX_MESSAGE_BYTES + 1)},
    "long_routing_key": {"routing_key": "r" * 300},
    # A poison event with an ordering key (a key of its own): the relays' claims hold its key
    # and pass the dead letter (relay/marks.py), as long as there are 100 such at most.
    "long_routing_key_keyed": {"routing_key": "r" * 300, "ordering_key": "KEY"},
    # The AMQP type and correlation_id, which consumers route and match by.
    "type_with_line_break": {"message_type": "order.paid\r\nX-Injected: 1"},
    "long_correlation_id": {"correlation_id": "c" * 300},
}


@dataclass
class Tally:
    relay_kills: int = 0
    postgres_restarts: int = 0
    rabbitmq_restarts: int = 0
    connection_cuts: int = 0
    black_holes: int = 0
    # Relays or resolvers that exited without being killed: a bug, whatever the checker says.
    unexpected_exits: int = 0
    max_in_doubt_seconds: float = 0.0
    produced: list[str] = field(default_factory=list)
    producer_errors: int = 0
    hostile: list[str] = field(default_factory=list)  # message ids: expected in dead letter
    forged_records: int = 0  # forged records appended to the ledger stream directly


class Producer(threading.Thread):
    """Inserts events at a steady rate; retries a failed transaction with the same ids."""

    def __init__(self, url: str, rate: float, stop: threading.Event, tally: Tally) -> None:
        super().__init__(daemon=True)
        self.url, self.rate, self.stop_event, self.tally = url, rate, stop, tally
        # Held from BEGIN until ``tally.produced`` has the committed ids: a reader holding it
        # sees the table and the tally agree (the cluster run's flow sampling).
        self.lock = threading.Lock()

    def _insert(self, conn: psycopg.Connection[Any], seq: int, count: int) -> None:
        """Events over 32 ordering keys, but one in 50 a scheduled event: no key, due 0-10 s
        later (the claims' floor passes it while it waits: relay/marks.py); and one in 1,000
        a scheduled event with its key, due 3-10 s later, which holds its key's later events
        until then (the floor passes them too, holding the key)."""
        with conn.transaction():
            conn.execute(
                "INSERT INTO outbox (message_id, exchange, routing_key, ordering_key,"
                " payload, available_at) SELECT 'c-' || n, %(ex)s, 'chaos', key,"
                " jsonb_build_object('key', key, 'seq', n, 'pad', repeat('x', 160)),"
                " now() + make_interval(secs => CASE WHEN key IS NULL THEN n %% 11"
                " WHEN n %% 1000 = 500 THEN 3 + n %% 8 ELSE 0 END)"
                " FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) n,"
                " LATERAL (SELECT CASE WHEN n %% 50 <> 25 THEN 'k' || (n %% 32) END AS key) k"
                " ON CONFLICT (message_id) DO NOTHING",
                {"ex": EXCHANGE, "lo": seq, "hi": seq + count - 1})

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        tick = 0.05
        per_tick = max(1, round(self.rate * tick))
        seq = 0
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                with self.lock:
                    self._insert(conn, seq, per_tick)
                    # After the commit: ids whose commit failed are retried, not counted.
                    self.tally.produced.extend(f"c-{n}" for n in range(seq, seq + per_tick))
                seq += per_tick
            except psycopg.Error:
                # Outcome unknown: retry the same ids; ON CONFLICT makes the retry idempotent.
                self.tally.producer_errors += 1
                conn = None
                time.sleep(0.2)
                continue
            next_at += tick
            time.sleep(max(0.0, next_at - time.monotonic()))


class HostileProducer(threading.Thread):
    """Inserts a hostile row every ``gap`` seconds on average, committed or retried with the
    same message id (ON CONFLICT makes a retry after a lost commit safe): each kind once first,
    in a random order (so a short run has every kind), then kinds at random.

    Forged ledger records name a batch that is in doubt right now (pg_prepared_xacts is
    readable by everyone), its real xid included. Now and then one is also appended to the
    stream directly, as another broker user would: the resolver must reject it.
    """

    def __init__(self, url: str, amqp_url: str, gap: float, stop: threading.Event, tally: Tally,
                 rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.url, self.amqp_url, self.gap = url, amqp_url, gap
        self.stop_event, self.tally, self.rng = stop, tally, rng

    def _in_doubt(self, conn: psycopg.Connection[Any] | None) -> tuple[str, int]:
        row = None
        if conn is not None:
            row = conn.execute("SELECT gid, transaction::text::bigint FROM pg_prepared_xacts"
                               " ORDER BY random() LIMIT 1").fetchone()
        return (str(row[0]), int(row[1])) if row else ("outbox:00000001:1", 1)

    def _forged(self, conn: psycopg.Connection[Any] | None) -> dict[str, Any]:
        gid, xid = self._in_doubt(conn)
        return {"type": "batch", "v": 1, "gid": gid, "xid": xid, "database": "outbox",
                "count": 1, "relay": "forged", "mac": f"{self.rng.getrandbits(256):064x}"}

    def _forge_in_stream(self, conn: psycopg.Connection[Any] | None) -> None:
        try:
            amqp = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            try:
                amqp.channel().basic_publish("", LEDGER, json.dumps(self._forged(conn)).encode())
            finally:
                amqp.close()
            self.tally.forged_records += 1
        except (pika.exceptions.AMQPError, OSError):
            pass

    def _columns(self, kind: str, n: int, conn: psycopg.Connection[Any] | None) -> dict[str, Any]:
        columns: dict[str, Any] = {"message_id": f"h-{n}-{kind}", "exchange": EXCHANGE,
                                   "routing_key": "chaos", "payload": Jsonb({"hostile": kind})}
        columns.update(HOSTILE[kind])
        if columns.get("headers") == "NESTED":
            columns["headers"] = '{"a":' * 5000 + "1" + "}" * 5000
        if columns.get("payload") == "FORGED":
            columns["payload"] = Jsonb(self._forged(conn))
        if "payload_bytes" in columns:
            columns["payload"] = None
        if columns.get("ordering_key") == "KEY":
            columns["ordering_key"] = f"hostile-{n}"
        return columns

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        n = 0
        pending: dict[str, Any] | None = None
        first = sorted(HOSTILE)
        self.rng.shuffle(first)
        deadline = float("inf")
        while time.monotonic() < deadline:
            if self.stop_event.wait(self.rng.uniform(0, 2 * self.gap)):
                # Stopped: only a row whose insert may have failed is still written (for 30 s),
                # so every hostile row in the table is one the checker expects.
                if pending is None:
                    break
                deadline = min(deadline, time.monotonic() + 30)
                time.sleep(0.2)
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                if pending is None and self.rng.random() < 0.2:
                    self._forge_in_stream(conn)
                    continue
                if pending is None:
                    n += 1
                    kind = (first.pop() if first else self.rng.choice(sorted(HOSTILE)))
                    pending = self._columns(kind, n, conn)
                names = list(pending)
                casts = {"headers": "::jsonb", "created_at": "::timestamptz"}
                values = ", ".join(f"%({name})s{casts.get(name, '')}" for name in names)
                conn.execute(f"INSERT INTO outbox ({', '.join(names)}) VALUES ({values})"
                             " ON CONFLICT (message_id) DO NOTHING", pending)
            except psycopg.Error:
                self.tally.producer_errors += 1
                conn = None
                continue
            self.tally.hostile.append(pending["message_id"])
            pending = None
        if conn is not None:
            conn.close()


class Programs:
    """The relays (``relay-0``...) and the resolver, last, each logging to ``<name>.log`` in
    ``logdir`` (a respawned one appends to it); the resolver logs JSON, which the run reads
    (devenv/chaos_neighbours.py's ResolverLog)."""

    def __init__(self, relays: int, env: dict[str, str], logdir: Path) -> None:
        self.relays, self.env, self.logdir = relays, env, logdir
        self.names = [*(f"relay-{i}" for i in range(relays)), "resolver"]
        self.procs = [self._spawn(name) for name in self.names]

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        env = {**self.env, "OUTBOX_LOG_FORMAT": "json"} if name == "resolver" else self.env
        return launch.launch(name.split("-")[0], env, self.logdir / f"{name}.log", append=True)

    def kill_relay(self, i: int) -> None:
        """SIGKILL relay ``i`` and start it again at once."""
        self.procs[i].kill()
        self.procs[i].wait()
        self.procs[i] = self._spawn(self.names[i])

    def respawn_exited(self, tally: Tally) -> None:
        """Start again, and count, each program that exited without being killed."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                tally.unexpected_exits += 1
                print(f"  {self.names[i]} exited by itself ({proc.returncode}); restarted",
                      flush=True)
                self.procs[i] = self._spawn(self.names[i])

    def terminate(self) -> None:
        """SIGTERM each program and wait for it (a graceful stop)."""
        for proc in self.procs:
            proc.terminate()
            proc.wait(60)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class Injector:
    """Applies one fault, by its kind's name (the method ``_<kind>``), and counts it: here the
    kinds both runs have; a run's subclass adds its own."""

    rng: random.Random
    tally: Tally
    programs: Programs
    # The proxies the relays and the resolver reach the servers through, in two groups: a cut
    # closes the connections through the first, the second or both.
    cut_groups: tuple[list[Proxy], list[Proxy]]

    def inject(self, fault: str) -> None:
        getattr(self, f"_{fault}")()

    def _relay(self) -> None:
        self.programs.kill_relay(self.rng.randrange(self.programs.relays))
        self.tally.relay_kills += 1

    def _cut(self) -> None:
        first, second = self.cut_groups
        for proxy in self.rng.choice([first, second, first + second]):
            proxy.cut()
        self.tally.connection_cuts += 1

    def partitionable(self) -> list[Proxy]:
        """The proxies a black hole may fall on."""
        first, second = self.cut_groups
        return first + second

    def _blackhole(self) -> None:
        """A partition: nothing answers for a while, then the held connections are dropped."""
        proxy = self.rng.choice(self.partitionable())
        proxy.blackhole()
        time.sleep(self.rng.uniform(1, 6))
        proxy.heal()
        self.tally.black_holes += 1


def scalar(url: str, query: str, params: tuple[Any, ...] | None = None) -> float:
    """The one value ``query`` returns (0 for none), or -1 when PostgreSQL does not answer."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(query, params).fetchone()
            return float(row[0]) if row and row[0] is not None else 0.0
    except psycopg.Error:
        return -1.0


# The relays' prepared transactions: not the neighbours' foreign ones (gids), nor the batches
# of the relays they hold after PREPARE on purpose (gid heads): Attacks.not_relays().
RELAYS_PREPARED = ("FROM pg_prepared_xacts WHERE gid <> ALL(%s::text[])"
                   " AND NOT gid ^@ ANY(%s::text[])")


def watch_in_doubt(url: str, watching: threading.Event, tally: Tally, attacks: Attacks) -> None:
    """Sample the age of the relays' oldest prepared transaction, faults and drain included."""
    query = f"SELECT extract(epoch FROM now() - min(prepared)) {RELAYS_PREPARED}"
    while watching.is_set():
        tally.max_in_doubt_seconds = max(tally.max_in_doubt_seconds,
                                         scalar(url, query, attacks.not_relays()))
        time.sleep(0.25)


def prepare(database_url: str, amqp_url: str, queues: dict[str, dict[str, Any]],
            ledger: dict[str, Any]) -> None:
    """The outbox schema; the exchange and each of ``queues`` (its arguments) bound to it for
    every key; the ledger stream (``ledger``: arguments besides its type and age)."""
    migrate(database_url, "outbox")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = conn.channel()
    channel.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
    for queue, arguments in queues.items():
        channel.queue_declare(queue, durable=True, arguments=arguments)
        channel.queue_bind(queue, EXCHANGE, routing_key="#")
    channel.queue_declare(LEDGER, durable=True, arguments={
        "x-queue-type": "stream", "x-max-age": "7D", **ledger})
    conn.close()
    time.sleep(1.5)  # RabbitMQ 3.10 loses a stream killed within ~1 s of its first declaration


@dataclass
class Verdict:
    """What a run's check found."""

    figures: dict[str, Any]  # the report: printed a line each, in this order, and the JSON
    report: checker.Report
    expected_dead: set[str]  # the hostile rows' message ids
    # Further counts that must be 0 (unexpected_exits...), named on the FAILED line
    zero: dict[str, int]


class Run:
    """One chaos run: the skeleton is ``run``; a subclass fills in the hooks and class
    attributes below."""

    title: ClassVar[str] = "chaos"  # "<title> for 60 s: 4 relays, ..."
    prog: ClassVar[str] = "./dev chaos"
    faults: ClassVar[dict[str, int]] = {}  # the kinds, each with its weight at random
    cycle: ClassVar[tuple[str, ...]] = ()  # the kinds' order under --cycle (default: faults')
    rate: ClassVar[float] = 500.0  # the options' defaults
    fault_gap: ClassVar[tuple[float, float]] = (4.0, 12.0)
    hostile_gap: ClassVar[float] = 1.0
    neighbour_gap: ClassVar[float] = 5.0
    settings: ClassVar[dict[str, str]] = {}  # the programs' settings besides the common ones
    drain_seconds: ClassVar[float] = 180.0
    row: ClassVar[str] = "  {name:<34}{value:>12}"  # a line of the report
    kept_logs: ClassVar[str] = "outbox-chaos-logs"  # under the temporary folder, on failure

    # Set by start(): the servers as the producers and the checks reach them (no proxy).
    database_url: str
    amqp_url: str

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.injected = 0  # faults so far
        self.started = 0.0  # time.monotonic() when the faults began
        self.attacks = Attacks()  # the hostile neighbours' (devenv/chaos_neighbours.py)
        self.logdir = Path()  # the programs' logs, set by run()

    @classmethod
    def main(cls, argv: list[str] | None, description: str | None) -> int:
        parser = argparse.ArgumentParser(prog=cls.prog, description=description)
        parser.add_argument("--duration", type=float, default=60, help="seconds of chaos")
        parser.add_argument("--rate", type=float, default=cls.rate,
                            help="events per second offered")
        parser.add_argument("--relays", type=int, default=4)
        parser.add_argument("--batch-size", type=int, default=100)
        parser.add_argument("--seed", type=int, default=None)
        low, high = cls.fault_gap
        parser.add_argument("--fault-gap", type=float, nargs=2, default=cls.fault_gap,
                            metavar=("MIN", "MAX"),
                            help=f"seconds between faults (default: {low:g} {high:g})")
        parser.add_argument("--cycle", action="store_true",
                            help="inject every kind of fault in turn instead of at random by weight")
        cls.add_arguments(parser)
        parser.add_argument("--json", type=Path, default=None,
                            help="also write the figures here")
        parser.add_argument("--hostile-gap", type=float, default=cls.hostile_gap,
                            metavar="SECONDS", help="mean seconds between hostile rows"
                            f" (0: none; default: {cls.hostile_gap:g})")
        parser.add_argument("--neighbour-gap", type=float, default=cls.neighbour_gap,
                            metavar="SECONDS", help="mean seconds between two poisoned ledger "
                            "records of the hostile neighbours; a foreign prepared transaction "
                            "every 3 of these, a poisoned takeover every 12 "
                            f"(0: none; default: {cls.neighbour_gap:g})")
        args = parser.parse_args(argv)
        cls.check_arguments(parser, args)
        return cls(args).run()

    # -- hooks ------------------------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The run's own options (after --cycle in --help)."""

    @classmethod
    def check_arguments(cls, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        """parser.error() on options that do not go together."""

    def kinds(self) -> list[str]:
        """The kinds of fault this run injects."""
        return list(self.faults)

    def start(self, stack: ExitStack) -> tuple[str, str]:
        """Start the servers (their cleanup on ``stack``), ``prepare`` them, set
        ``database_url`` and ``amqp_url``; put the proxies the faults cut between the servers
        and the programs, and return the programs' database and AMQP URLs."""
        raise NotImplementedError

    def injector(self, programs: Programs) -> Injector:
        raise NotImplementedError

    def neighbour_amqp_url(self) -> str:
        """Where the hostile neighbours reach RabbitMQ (no proxy)."""
        return self.amqp_url

    def watch(self, producer: Producer) -> None:
        """Start what the run watches besides (threads), once the traffic flows."""

    def before_drain(self) -> None:
        """Once the faults have stopped: bring back whatever the drain needs."""

    def collect(self) -> Verdict:
        """After the drain, with the programs stopped: what reached the consumers, checked."""
        raise NotImplementedError

    # -- the skeleton -----------------------------------------------------------------------

    def run(self) -> int:
        args, rng, tally = self.args, self.rng, self.tally
        with ExitStack() as stack:
            logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-chaos-")))
            self.logdir = logdir
            database_url, amqp_url = self.start(stack)
            env = launch.program_env(
                database_url, amqp_url, OUTBOX_BATCH_SIZE=str(args.batch_size),
                OUTBOX_CONFIRM_TIMEOUT="5", OUTBOX_RECONNECT_MAX_DELAY="2",
                OUTBOX_MAX_MESSAGE_BYTES=str(MAX_MESSAGE_BYTES), OUTBOX_RESOLVER_INTERVAL="1",
                **self.settings)
            programs = Programs(args.relays, env, logdir)
            injector = self.injector(programs)
            stack.callback(programs.kill_all)

            stop, watching = threading.Event(), threading.Event()
            watching.set()
            producer = Producer(self.database_url, args.rate, stop, tally)
            producer.start()
            hostile = HostileProducer(self.database_url, self.amqp_url, args.hostile_gap, stop,
                                      tally, random.Random(rng.random()))
            if args.hostile_gap > 0:
                hostile.start()
            neighbours = Neighbours(self.database_url, self.neighbour_amqp_url(), env, logdir,
                                    args.neighbour_gap, stop, random.Random(
                                        None if args.seed is None else f"{args.seed}-neighbours"))
            self.attacks = neighbours.attacks
            if args.neighbour_gap > 0:
                Neighbours.create_role(self.database_url)
                neighbours.start()
            self.watch(producer)
            watch = threading.Thread(target=watch_in_doubt, args=(
                self.database_url, watching, tally, self.attacks), daemon=True)
            watch.start()

            print(f"{self.title} for {args.duration:.0f} s: {args.relays} relays,"
                  f" {args.rate:.0f} events/s, logs in {logdir}", flush=True)
            self.faults_loop(injector, programs)

            stop.set()
            producer.join(30)
            if hostile.is_alive():
                hostile.join(30)
            if neighbours.is_alive():
                neighbours.join(180)
            self.before_drain()
            self.drain(programs)
            watching.clear()
            watch.join(10)
            programs.terminate()
            # The run's own cleanup of the foreign transactions, before the checker counts
            # what the relays left in doubt.
            figures, zero = self.attacks.verdict(ResolverLog.read(logdir / "resolver.log"),
                                                 self.attacks.finish(self.database_url))
            verdict = self.collect()
            verdict.figures["forged_order_header_rows"] = sum(
                message_id.endswith("-forged_order_headers") for message_id in tally.hostile)
            verdict.figures.update(figures)
            verdict.zero.update(zero)
            return self.report(verdict, logdir)

    def faults_loop(self, injector: Injector, programs: Programs) -> None:
        """For ``--duration`` seconds: a fault every ``--fault-gap`` seconds, at random by
        weight or in turn; a program that exited by itself is counted and started again."""
        args, rng = self.args, self.rng
        kinds = self.kinds()
        cycle = [kind for kind in (self.cycle or self.faults) if kind in kinds]
        self.started = time.monotonic()
        next_fault = self.started + rng.uniform(*args.fault_gap)
        while time.monotonic() - self.started < args.duration:
            programs.respawn_exited(self.tally)
            if time.monotonic() >= next_fault:
                if args.cycle:
                    fault = cycle[self.injected % len(cycle)]
                else:
                    fault = rng.choices(kinds, weights=[self.faults[k] for k in kinds])[0]
                self.injected += 1
                injector.inject(fault)
                print(f"  {time.monotonic() - self.started:6.1f} s  fault: {fault}", flush=True)
                next_fault = time.monotonic() + rng.uniform(*args.fault_gap)
            time.sleep(0.5)

    def drain(self, programs: Programs) -> None:
        """Wait (``drain_seconds`` at most) until the outbox is empty, nothing of the relays is
        in doubt, and the resolver has reported every foreign transaction prepared."""
        deadline = time.monotonic() + self.drain_seconds
        while time.monotonic() < deadline:
            left = scalar(self.database_url, "SELECT count(*) FROM outbox")
            doubt = scalar(self.database_url, f"SELECT count(*) {RELAYS_PREPARED}",
                           self.attacks.not_relays())
            if left == 0 and doubt == 0 and self.foreign_reported():
                break
            programs.respawn_exited(self.tally)
            time.sleep(1)

    def foreign_reported(self) -> bool:
        """Whether the resolver's log names every foreign transaction prepared now."""
        foreign = list(self.attacks.foreign)
        if not foreign:
            return True
        try:
            with psycopg.connect(self.database_url, autocommit=True, connect_timeout=2) as conn:
                prepared = {row[0] for row in conn.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                    " AND gid = ANY(%s)", (foreign,))}
        except psycopg.Error:
            return False
        return prepared <= set(ResolverLog.read(self.logdir / "resolver.log").foreign)

    def report(self, verdict: Verdict, logdir: Path) -> int:
        """Print the figures (and write them to --json) and the verdict; on failure, keep the
        programs' logs. The exit code."""
        args = self.args
        print()
        for name, value in verdict.figures.items():
            shown = value if isinstance(value, (int, float, str)) else json.dumps(value)
            print(self.row.format(name=name, value=shown))
        if args.json:
            args.json.write_text(json.dumps(verdict.figures, indent=2) + "\n")
        # Duplicates come from crashes and failed batches: a batch per relay per fault at most.
        ok = (verdict.report.ok(max_duplicates=args.batch_size * max(1, self.injected)
                                * args.relays, dead_letter_expected=verdict.expected_dead)
              and not any(verdict.zero.values()))
        counts = "".join(f" {name}={count}" for name, count in verdict.zero.items())
        print("\nOK: nothing lost, nothing unexpected, nothing left over" if ok
              else f"\nFAILED: {verdict.report.summary()}{counts}")
        if not ok:
            kept = Path(tempfile.gettempdir()) / f"{self.kept_logs}-{int(time.time())}"
            shutil.copytree(logdir, kept)
            print(f"relay and resolver logs kept in {kept}")
        return 0 if ok else 1
