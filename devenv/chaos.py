"""The chaos run: ``./dev chaos --duration 600`` (or ``python -m devenv.chaos``).

Several relays and a resolver relay a steady stream of events while a loop SIGKILLs relays at
random, crashes and restarts PostgreSQL, kills or stops and restarts RabbitMQ, and cuts or
black-holes their connections (the relays and the resolver reach both servers through loopback
proxies, devenv/proxy.py). A second producer mixes hostile rows into the traffic at random
(headers nested thousands deep or over frame_max, created_at 'infinity', BC or year 10000,
records forged for the ledger, oversized payloads...): each must end in the dead-letter table,
none may be published or stop a relay. At the end every process is allowed to finish, the queue
is drained and the total-queue checker prints: events, kills, restarts, cuts, lost (events not
delivered and hostile rows not dead-lettered), unexpected, duplicated, order violations, what is
left over, and the longest time a batch waited in doubt.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import ClassVar

import psycopg

from devenv import checker
from devenv.chaos_run import QUEUE, Injector, Programs, Run, Verdict, prepare
from devenv.proxy import Proxy
from devenv.servers import PostgresServer, RabbitServer


@dataclass
class ServersInjector(Injector):
    """The faults of single servers, besides the relay kills, cuts and black holes."""

    pg: PostgresServer
    rabbit: RabbitServer

    def _postgres(self) -> None:
        self.pg.stop("immediate")  # a crash: prepared transactions must survive it
        time.sleep(self.rng.uniform(0.5, 3))
        self.pg.restart()
        self.tally.postgres_restarts += 1

    def _rabbitmq(self) -> None:
        if self.rng.random() < 0.5:
            self.rabbit.kill()
        else:
            self.rabbit.stop()
        time.sleep(self.rng.uniform(0.5, 3))
        self.rabbit.restart()
        self.tally.rabbitmq_restarts += 1


class ServersRun(Run):
    """One PostgreSQL and one RabbitMQ; the sink a classic queue, drained after the run."""

    # Relay kills are cheap and the most telling, server restarts slow.
    faults: ClassVar[dict[str, int]] = {
        "relay": 6, "postgres": 1, "rabbitmq": 1, "cut": 3, "blackhole": 1}

    pg: PostgresServer
    rabbit: RabbitServer
    pg_proxy: Proxy
    mq_proxy: Proxy

    def start(self, stack: ExitStack) -> tuple[str, str]:
        self.pg = stack.enter_context(PostgresServer(max_prepared_transactions=64))
        self.rabbit = stack.enter_context(RabbitServer())
        self.database_url, self.amqp_url = self.pg.url, self.rabbit.url
        prepare(self.pg.url, self.rabbit.url, {QUEUE: {}}, {})
        # Relays and resolver go through proxies the fault loop can cut; the producer does not.
        self.pg_proxy = stack.enter_context(Proxy.to(self.pg.url))
        self.mq_proxy = stack.enter_context(Proxy.to(self.rabbit.url))
        return self.pg_proxy.url(self.pg.url), self.mq_proxy.url(self.rabbit.url)

    def injector(self, programs: Programs) -> Injector:
        return ServersInjector(self.rng, self.tally, programs,
                               ([self.pg_proxy], [self.mq_proxy]), self.pg, self.rabbit)

    def collect(self) -> Verdict:
        args, tally = self.args, self.tally
        deliveries = checker.drain(self.rabbit.url, QUEUE, expected=set(tally.produced),
                                   total_timeout=600)
        with psycopg.connect(self.pg.url, autocommit=True) as db:
            report = checker.check(tally.produced, deliveries, conn=db, table="outbox")
        expected_dead = set(tally.hostile)
        missing_dead = report.dead_letter_missing(expected_dead)
        figures = {
            "duration_seconds": args.duration, "relays": args.relays, "rate": args.rate,
            "batch_size": args.batch_size, "events": report.produced,
            "delivered": report.delivered, "relay_kills": tally.relay_kills,
            "postgres_restarts": tally.postgres_restarts,
            "rabbitmq_restarts": tally.rabbitmq_restarts,
            "connection_cuts": tally.connection_cuts, "black_holes": tally.black_holes,
            "hostile_rows": len(expected_dead), "forged_ledger_records": tally.forged_records,
            "hostile_dead_lettered": len(expected_dead) - len(missing_dead),
            "lost": len(report.lost) + len(missing_dead), "unexpected": len(report.unexpected),
            "duplicated": report.duplicates,
            "order_violations": sum(report.order_violations.values()),
            "left_in_outbox": report.left_in_outbox, "dead_lettered": report.dead_lettered,
            "in_doubt_left": report.in_doubt,
            "longest_in_doubt_seconds": round(tally.max_in_doubt_seconds, 2),
            "producer_retries": tally.producer_errors,
            "unexpected_exits": tally.unexpected_exits,
        }
        return Verdict(figures, report, expected_dead,
                       {"unexpected_exits": tally.unexpected_exits})


def main(argv: list[str] | None = None) -> int:
    return ServersRun.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
