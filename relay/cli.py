"""``outbox-relay``: run the relay (default), apply the schema (``migrate``), inspect, requeue and
discard the dead letters (``dead-letter``), give back a bloated outbox's space (``compact``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from outbox_relay import compact, schema
from outbox_relay.errors import (
    ConfigError,
    OutboxError,
    StartupCheckError,
    TransientError,
    describe,
)
from outbox_relay.inbox_cli import age_seconds
from outbox_relay.postgres import connect_pinned
from outbox_relay.relay import dead_letter
from outbox_relay.relay.faults import Fault, no_fault
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.publisher import AmqpPublisher
from outbox_relay.relay.settings import RELAY_OPTIONS, RelaySettings
from outbox_relay.relay.store import OutboxStore
from outbox_relay.relay.worker import Relay, relay_health
from outbox_relay.runtime import http, logs, options
from outbox_relay.runtime.exits import EXIT_FAILED, EXIT_OK, EXIT_STARTUP, run_program
from outbox_relay.runtime.logs import printable
from outbox_relay.runtime.signals import Shutdown
from outbox_relay.schema import SCHEMA_VERSION, migrate, roles_sql, schema_sql
from outbox_relay.tables import Tables
from outbox_relay.version import __version__

log = logging.getLogger("relay")

MIGRATE_OPTIONS = (options.DATABASE_URL, options.TABLE, options.CONNECT_TIMEOUT,
                   options.LOG_LEVEL, options.LOG_FORMAT)
DEAD_LETTER_OPTIONS = (options.DATABASE_URL, options.TABLE, options.CONNECT_TIMEOUT)
COMPACT_OPTIONS = (options.DATABASE_URL, options.TABLE, compact.LOCK_TIMEOUT, compact.MAX_BLOCK,
                   compact.ATTEMPTS, options.CONNECT_TIMEOUT, options.LOG_LEVEL,
                   options.LOG_FORMAT)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-relay",
        description="Relay outbox rows from PostgreSQL to RabbitMQ with two-phase commit. "
        "Every flag can also be set by the environment variable shown in its help.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{run,migrate,dead-letter,compact}")
    run = sub.add_parser("run", help="relay events (the default)")
    options.add_options(run, RELAY_OPTIONS)
    mig = sub.add_parser(
        "migrate", help="create or upgrade the outbox tables (idempotent)",
        description="Create the outbox tables if missing, upgrade older ones, record the schema's "
        f"version ({SCHEMA_VERSION}) as the outbox table's comment. Exit codes: 0 done (--check: "
        "the schema is one this program runs on), 1 PostgreSQL unreachable, 2 bad arguments, 3 "
        "the schema is missing or older (--check), or newer than this program can use.")
    what = mig.add_mutually_exclusive_group()
    what.add_argument("--print", action="store_true", dest="print_only",
                      help="print the SQL instead of applying it (for psql -f)")
    what.add_argument("--check", action="store_true",
                      help="change nothing; exit 0 if the schema is one this program runs on, 3 "
                      "with one line if it is missing, older, or newer than it can use (for "
                      "deploy pipelines and init containers)")
    what.add_argument("--print-roles", action="store_true",
                      help="print sql/roles.sql, the least-privilege roles, for psql: "
                      "| psql URL -v table=outbox -v roles=outbox -f -")
    options.add_options(mig, MIGRATE_OPTIONS)
    dead = sub.add_parser(
        "dead-letter", help="list, requeue or discard the rows of the dead-letter table",
        description="Inspect <table>_dead_letter, discard rows from it, or requeue them: they go "
        "back into the "
        "outbox in one transaction with attempts 0, due now; a row with an ordering key gets its "
        "old id back (the rows of its key that waited behind it stay behind it), others a new id.")
    dead_sub = dead.add_subparsers(dest="dead_letter_command", metavar="{list,requeue,discard}",
                                   required=True)
    listing = dead_sub.add_parser(
        "list", help="print the dead letters, oldest first (tab-separated: id, message_id, "
        "exchange, routing_key, attempts, dead_at, last_error; control characters escaped)")
    listing.add_argument("--limit", type=_positive_int, default=100, metavar="N",
                         help="print at most N rows (default: 100)")
    listing.add_argument("--json", action="store_true", help="print a JSON array instead")
    _add_selection(listing)
    options.add_options(listing, DEAD_LETTER_OPTIONS)
    requeue = dead_sub.add_parser(
        "requeue", help="move dead letters back into the outbox (one transaction)")
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=_positive_int, action="append", dest="ids", metavar="ID",
                       help="dead-letter id to requeue (repeat for several)")
    which.add_argument("--all", action="store_true", help="requeue every dead letter")
    options.add_options(requeue, DEAD_LETTER_OPTIONS)
    drop = dead_sub.add_parser(
        "discard", help="delete dead letters for good, after showing them and a confirmation",
        description="Delete dead letters: those given by --id, those the filters match (both: "
        "those of the ids the filters match), or --all. It prints them and how many, then "
        "asks on a terminal; --yes deletes without asking, --dry-run only prints. Exit codes: "
        "0 done (or nothing matched, or --dry-run), 1 not confirmed or PostgreSQL unreachable, "
        "2 bad arguments (or no --yes and no terminal to ask on), 3 tables missing.")
    drop.add_argument("--id", type=_positive_int, action="append", dest="ids", metavar="ID",
                      help="dead-letter id to discard (repeat for several)")
    drop.add_argument("--all", action="store_true", help="every dead letter")
    _add_selection(drop)
    confirm = drop.add_mutually_exclusive_group()
    confirm.add_argument("--yes", action="store_true", help="discard without asking")
    confirm.add_argument("--dry-run", action="store_true",
                         help="print what would be discarded, discard nothing")
    options.add_options(drop, DEAD_LETTER_OPTIONS)
    shrink = sub.add_parser(
        "compact", help="give back the space a long-held snapshot left in the outbox",
        description="VACUUM the outbox, then rebuild its indexes concurrently and rewrite it "
        "with its live rows only (CLUSTER), as its owner: producers and relays wait while the rewrite holds "
        "the table, at most OUTBOX_COMPACT_LOCK_TIMEOUT + OUTBOX_COMPACT_MAX_BLOCK seconds an "
        "attempt; a rewrite that would take longer is rolled back. Run it once the snapshot "
        "that made the table grow has ended. Exit codes: 0 done (--dry-run: sizes printed), 1 "
        "not done (the table stayed locked, or the rewrite took too long; nothing changed) or "
        "PostgreSQL unreachable, 2 bad arguments, 3 the table is missing or this role may not "
        "rewrite it.")
    shrink.add_argument("--dry-run", action="store_true",
                        help="print the table's size and whether this role may compact it; "
                        "change nothing")
    options.add_options(shrink, COMPACT_OPTIONS)
    return parser


def _add_selection(parser: argparse.ArgumentParser) -> None:
    """The filters of `list` and `discard`; each one given narrows the selection."""
    parser.add_argument("--exchange", metavar="NAME", help="only dead letters for this exchange")
    parser.add_argument("--reason", metavar="TEXT",
                        help="only those whose last_error contains TEXT (in any case)")
    parser.add_argument("--older-than", type=_age, metavar="AGE",
                        help="only those dead-lettered longer ago than AGE (7D, 36h, 90m, 3600s)")
    parser.add_argument("--newer-than", type=_age, metavar="AGE",
                        help="only those dead-lettered within the last AGE")


def _age(text: str) -> float:
    try:
        return age_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (got {text!r})") from None


def _selection(args: argparse.Namespace) -> dead_letter.Selection:
    return dead_letter.Selection(
        ids=getattr(args, "ids", None), exchange=args.exchange, reason=args.reason,
        older_than=args.older_than, newer_than=args.newer_than)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def main(argv: Sequence[str] | None = None, *, fault: Fault = no_fault) -> int:
    """``outbox-relay``. ``fault``: the crash-point hook (relay/faults.py), given only by the
    tests' launcher (devenv/crash_points.py): the command itself reads no such setting."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-")
                         and args_list[0] not in ("-h", "--help", "--version")):
        args_list.insert(0, "run")
    args = build_parser().parse_args(args_list)
    command = {"migrate": _migrate, "dead-letter": _dead_letter, "compact": _compact}.get(
        args.command, lambda run_args: _run(run_args, fault))
    return run_program("outbox-relay", log, lambda: command(args))


def _migrate(args: argparse.Namespace) -> int:
    if args.print_roles:
        sys.stdout.write(roles_sql())
        return EXIT_OK
    if args.print_only:
        table = options.resolve(args, (options.TABLE,))["table"]
        sys.stdout.write(schema_sql(table) + "\n")
        return EXIT_OK
    values = options.resolve(args, MIGRATE_OPTIONS)
    if args.check:  # one line, on stdout when fit, on stderr when not; no log set up
        found = schema.check(values["database_url"], values["table"],
                             timeout=values["connect_timeout"])
        if found.problem is not None:
            print(f"outbox-relay: error: {found.problem}", file=sys.stderr)
            return EXIT_STARTUP
        print(f"outbox-relay: {found.describe()}")
        return EXIT_OK
    logs.setup(values["log_level"], values["log_format"])
    migrate(values["database_url"], values["table"], timeout=values["connect_timeout"])
    log.info("schema applied", extra={"action": "schema_applied", "table": values["table"]})
    return EXIT_OK


def _run(args: argparse.Namespace, fault: Fault) -> int:
    settings = RelaySettings(**options.resolve(args, RELAY_OPTIONS))
    logs.setup(settings.log_level, settings.log_format)
    shutdown = Shutdown()
    shutdown.install()
    relay_metrics = RelayMetrics(confirm_timeout=settings.confirm_timeout)
    health = relay_health(settings)
    store = OutboxStore(settings.database_url, settings.table,
                        connect_timeout=settings.connect_timeout,
                        standby_wait=settings.standby_wait,
                        standby_wait_timeout=settings.standby_wait_timeout)
    publisher = AmqpPublisher(
        settings.amqp_url, ledger_stream=settings.ledger_stream,
        ledger_max_age=settings.ledger_max_age, confirm_timeout=settings.confirm_timeout,
        connect_timeout=settings.connect_timeout, user_id=settings.amqp_user_id, fault=fault)
    relay = Relay(settings, store, publisher, metrics=relay_metrics, health=health, fault=fault,
                  shutdown=shutdown)
    publisher.name = f"outbox-relay {relay.instance_name}"
    http.serve(relay_metrics.registry, settings.metrics_host, settings.metrics_port, health)
    # Fail fast on what a retry cannot fix (2PC off, schema missing, stream clash).
    try:
        relay.run()
    except OutboxError:
        relay.close()
        raise
    return EXIT_OK


def _compact(args: argparse.Namespace) -> int:
    values = options.resolve(args, COMPACT_OPTIONS)
    logs.setup(values["log_level"], values["log_format"])
    conn, tables = connect_pinned(values["database_url"], values["table"],
                                  timeout=values["connect_timeout"],
                                  application_name="outbox-relay compact")
    with conn:
        try:
            if args.dry_run:
                compact.check_owner(conn, tables)
                sizes = compact.Sizes.read(conn, tables)
                print(f"{tables.name}: table {compact.mb(sizes.heap_bytes)}, indexes "
                      f"{compact.mb(sizes.index_bytes)}, about {sizes.live_rows} live and "
                      f"{sizes.dead_rows} dead rows; this role may compact it")
                return EXIT_OK
            done = compact.compact(conn, tables, lock_timeout=values["lock_timeout"],
                                   max_block=values["max_block"], attempts=values["attempts"])
        except psycopg.errors.UndefinedTable:
            raise StartupCheckError(
                f"table {tables.name} does not exist: run outbox-relay migrate first") from None
        except compact.CompactFailed as exc:
            log.error("%s", exc, extra={"action": "compact_failed", "table": tables.name})
            return EXIT_FAILED
        except psycopg.OperationalError as exc:
            raise TransientError(f"compact stopped: {describe(exc)}") from exc
        except psycopg.Error as exc:  # refused by PostgreSQL: one line, nothing rewritten
            log.error("compact failed: %s", describe(exc),
                      extra={"action": "compact_failed", "table": tables.name})
            return EXIT_FAILED
    compact.log_compacted(log, tables, done)
    return EXIT_OK


def _dead_letter(args: argparse.Namespace) -> int:
    values = options.resolve(args, DEAD_LETTER_OPTIONS)
    if args.dead_letter_command == "discard" and _selection(args).everything != args.all:
        raise ConfigError("name the dead letters to discard: --id, a filter (--exchange, "
                          "--reason, --older-than, --newer-than) or --all, and --all alone")
    try:
        return _dead_letter_command(args, values["database_url"], values["table"],
                                    values["connect_timeout"])
    except StartupCheckError as exc:  # a missing table: one line, no log set up to repeat it
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP


def _dead_letter_command(args: argparse.Namespace, database_url: str, table: str,
                         connect_timeout: float) -> int:
    conn, tables = connect_pinned(database_url, table, timeout=connect_timeout,
                                  application_name="outbox-relay dead-letter")
    with conn:
        if args.dead_letter_command == "discard":
            return _discard(args, conn, tables)
        if args.dead_letter_command == "list":
            rows, total = dead_letter.list_dead_letters(conn, tables, args.limit,
                                                        _selection(args))
            if args.json:
                json.dump([{"id": r.id, "message_id": r.message_id, "exchange": r.exchange,
                            "routing_key": r.routing_key, "attempts": r.attempts,
                            "dead_at": r.dead_at.isoformat(), "last_error": r.last_error}
                           for r in rows], sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                _print_lines(rows)
            if total > len(rows):
                print(f"outbox-relay: {len(rows)} of {total} dead letters shown (--limit)",
                      file=sys.stderr)
            return EXIT_OK
        result = dead_letter.requeue(conn, tables, None if args.all else args.ids)
    for dead_id, message_id in result.skipped.items():
        print(f"skipped dead letter {dead_id}: message_id {message_id!r} is already in the outbox")
    for dead_id in result.missing:
        print(f"skipped dead letter {dead_id}: not in {tables.dead_letter_name}")
    print(f"requeued {len(result.moved)} dead letter{'' if len(result.moved) == 1 else 's'} "
          f"into {tables.name}")
    return EXIT_OK


def _print_lines(rows: Sequence[dead_letter.DeadLetter]) -> None:
    """`list`'s lines: tab-separated, one line each."""
    for r in rows:
        # One line each, whatever the producer's text holds: its control characters (a tab, a
        # newline, a terminal's escape sequence) escaped, and the error's lines joined.
        error = printable(" ".join(r.last_error.split()))
        print("\t".join((str(r.id), printable(r.message_id), printable(r.exchange),
                         printable(r.routing_key), str(r.attempts), r.dead_at.isoformat(),
                         error)))


DISCARD_SHOWN = 20  # dead letters printed before a confirmation; the count says the rest


def _discard(args: argparse.Namespace, conn: psycopg.Connection[Any], tables: Tables) -> int:
    """Show what the selection matches, confirm, delete exactly those rows."""
    selection = _selection(args)
    rows, _total = dead_letter.list_dead_letters(conn, tables, None, selection)
    found = {r.id for r in rows}
    unmatched = " (or the filters do not match it)" if _filtered(selection) else ""
    for dead_id in sorted(set(args.ids or ())):
        if dead_id not in found:
            print(f"skipped dead letter {dead_id}: not in {tables.dead_letter_name}{unmatched}")
    if not rows:
        print(f"no dead letter matches: nothing discarded from {tables.dead_letter_name}")
        return EXIT_OK
    _print_lines(rows[:DISCARD_SHOWN])
    if len(rows) > DISCARD_SHOWN:
        print(f"... and {len(rows) - DISCARD_SHOWN} more")
    count = f"{len(rows)} dead letter{'' if len(rows) == 1 else 's'}"
    if args.dry_run:
        print(f"would discard {count} from {tables.dead_letter_name} (--dry-run: nothing "
              "discarded)")
        return EXIT_OK
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"would discard {count}: nothing discarded; confirm with --yes "
                              "(--dry-run only prints them)")
        sys.stderr.write(f"discard these {count} from {tables.dead_letter_name} for good? "
                         "[y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            print("nothing discarded", file=sys.stderr)
            return EXIT_FAILED
    gone = dead_letter.discard(conn, tables, [r.id for r in rows])
    print(f"discarded {len(gone)} dead letter{'' if len(gone) == 1 else 's'} from "
          f"{tables.dead_letter_name}")
    if len(gone) < len(rows):
        print(f"{len(rows) - len(gone)} of them had gone meanwhile (requeued or discarded)")
    return EXIT_OK


def _filtered(selection: dead_letter.Selection) -> bool:
    return any(v is not None for v in (selection.exchange, selection.reason,
                                       selection.older_than, selection.newer_than))
