"""Every log line's stable ``action`` key, declared once with what it means.

docs/operations.md's table of log actions is generated from ``ACTIONS`` (``./dev docs``), and
tests/unit/test_logs.py checks that the programs log exactly these actions: a new
``extra={"action": ...}`` needs its line here.
"""

from __future__ import annotations

from dataclasses import dataclass

from outbox_relay.ledger import MAX_RECORD_BYTES


@dataclass(frozen=True)
class LogAction:
    """One row of the table: the actions, their level, which program logs them, the extra
    fields of the line and when it is logged (the last two in Markdown)."""

    actions: tuple[str, ...]
    level: str
    program: str  # relay, resolver, both, migrate, compact, or the consumer's Inbox
    fields: str
    when: str


ACTIONS: tuple[LogAction, ...] = (
    LogAction(
        ("relay_started", "relay_stopped"), "INFO", "relay",
        "`instance`",
        "start; clean exit after SIGTERM/SIGINT",
    ),
    LogAction(
        ("resolver_started", "resolver_stopped"), "INFO", "resolver",
        "",
        "start; clean exit",
    ),
    LogAction(
        ("standby_unchecked",), "WARNING", "both",
        "",
        "start-up: another host of a multi-host `OUTBOX_DATABASE_URL` could not be reached to "
        "check its `max_prepared_transactions` (a standby below the primary's stops the start)",
    ),
    LogAction(
        ("schema_create_open",), "WARNING", "both",
        "",
        "start-up, once per process: `PUBLIC` or a role other than the table's and the "
        "schema's owners may `CREATE` in the outbox's schema (PostgreSQL 13 and 14 grant it on "
        "`public`); the programs pin their `search_path` and are not affected, your services "
        "and psql sessions are (docs/operations.md, roles and grants)",
    ),
    LogAction(
        ("ledger_key_readable",), "WARNING", "both",
        "`roles`, `public`",
        "start-up: LOGIN roles other than the program's own, superusers and the key table's "
        "owner can read the ledger key (`SELECT` themselves, through a role they are members "
        "of, `PUBLIC` or `pg_read_all_data`): whoever reads it can sign ledger records; revoke "
        "it ([Roles and grants](#roles-and-grants)). Also when the check itself failed",
    ),
    LogAction(
        ("connected", "reconnected"), "INFO", "both",
        "`server` (`postgresql`, `rabbitmq`)",
        "first connection; a connection back after a loss",
    ),
    LogAction(
        ("disconnected",), "WARNING", "relay",
        "`server`",
        "a lost connection (once; retried with backoff)",
    ),
    LogAction(
        ("connect_failed",), "WARNING", "relay",
        "`server`",
        "the first failed attempt of an outage, with the error (refused, wrong password, untrusted "
        "certificate…); retried with backoff",
    ),
    LogAction(
        ("reconnect_failed",), "DEBUG", "relay",
        "`server`",
        "each further failed attempt",
    ),
    LogAction(
        ("connection_fault",), "DEBUG", "relay",
        "",
        "each lost connection or failed step of the loop (then backoff)",
    ),
    LogAction(
        ("amqp_connected", "amqp_close_failed"), "DEBUG", "both",
        "",
        "RabbitMQ channel set up; an error closing a connection that was already failing",
    ),
    LogAction(
        ("ledger_read_closed",), "DEBUG", "resolver",
        "",
        "the broker closed the connection as the resolver ended a ledger read (the read was "
        "complete; the next scan reconnects)",
    ),
    LogAction(
        ("batch_committed",), "DEBUG", "relay",
        "`gid`, `batch_size`, (`reason`)",
        "COMMIT PREPARED done (routine: DEBUG; the metrics count them)",
    ),
    LogAction(
        ("claim_ahead_gave_up",), "DEBUG", "relay",
        "",
        "the claim made ahead waited 10 ms behind a request for the whole table (a compaction's "
        "rewrite, DDL) and claimed nothing, so that the batch in flight can finish; "
        "counted by `outbox_relay_claims_ahead_given_up_total`",
    ),
    LogAction(
        ("batch_rolled_back",), "WARNING", "relay",
        "`gid`, `batch_size`, `reason`",
        "ROLLBACK PREPARED done: why (`RabbitMQ connection lost…`, `no confirm within 30 s`, "
        "`ledger: …`, `2 of 500 messages refused by the broker`)",
    ),
    LogAction(
        ("batch_finished_elsewhere",), "WARNING", "relay",
        "`gid`, `batch_size`",
        "the resolver finished the batch first (duplicates possible, never loss)",
    ),
    LogAction(
        ("row_failed",), "WARNING", "relay",
        "`gid`, `row_id`, `message_id`",
        "the broker refused the row (unroutable, nacked, no such exchange); retried with backoff",
    ),
    LogAction(
        ("row_dead_lettered",), "WARNING", "relay",
        "`gid`, `row_id`, `message_id`, `reason` (`invalid`, `exhausted`)",
        "the row moved to the dead-letter table (logged once its batch committed); the message "
        "says why",
    ),
    LogAction(
        ("standby_wait_timeout", "standby_caught_up"), "WARNING, INFO", "relay",
        "",
        "`OUTBOX_STANDBY_WAIT`: the first batch rolled back because the standby did not flush "
        "its claim within `OUTBOX_STANDBY_WAIT_TIMEOUT` (nothing is published meanwhile: "
        "`outbox_relay_waiting_for_standby` is 1, [OutboxWaitingForStandby](#outboxwaitingforstandby)); "
        "the first batch that passed the wait again",
    ),
    LogAction(
        ("ledger_missing",), "WARNING", "relay",
        "",
        "the ledger stream or its exchange was deleted under the relay: its batch is rolled back "
        "and nothing more is claimed until the ledger is declared again (on reconnecting)",
    ),
    LogAction(
        ("database_error",), "ERROR", "relay",
        "",
        "a PostgreSQL error that is not a lost connection (first line of it)",
    ),
    LogAction(
        ("resolved_committed", "resolved_rolled_back", "resolved_already_finished"), "INFO", "resolver",
        "`gid`, `age_seconds`, (`batch_size` for a commit: messages in its ledger record)",
        "a decision on an in-doubt batch",
    ),
    LogAction(
        ("not_owner",), "WARNING", "resolver",
        "`gid`, `owner`",
        "a batch prepared by another PostgreSQL role: only that role or a superuser may finish it, "
        "so it is left alone (once per batch); run the resolver as the relays' role",
    ),
    LogAction(
        ("foreign_prepared",), "WARNING", "resolver",
        "`gid`, `owner`, `reason` (`gid`, `owner`)",
        "a prepared transaction of the gid prefix that no relay made (`gid`: not a gid a relay "
        "makes; `owner`: its role cannot read the ledger key): left alone, counted in "
        "`outbox_resolver_foreign_prepared_transactions`, logged once per transaction; it holds "
        "its locks and VACUUM until someone finishes it by hand",
    ),
    LogAction(
        ("hard_limit_reached",), "WARNING", "resolver",
        "`gid`",
        "a batch of a relay that looks alive passed `OUTBOX_RESOLVER_HARD_LIMIT` and is resolved "
        "anyway",
    ),
    LogAction(
        ("ledger_record_rejected",), "WARNING", "resolver",
        "`gid` (null when it names none), `reason` (`unauthenticated`, `other_key`, "
        "`other_transaction`, `malformed`, `oversized`), `offset`",
        "a ledger record names an in-doubt batch but was not signed with the ledger key (with "
        "the key id of another key: `other_key`), or names another transaction (xid, "
        "database); or it cannot be read or checked at all (not JSON, "
        "not an object, fields of the wrong type or range, over "
        f"{MAX_RECORD_BYTES} bytes): ignored, logged once per record however many scans read "
        "it (at most 100 lines a scan: `ledger_records_rejected_unlogged`)",
    ),
    LogAction(
        ("ledger_records_rejected_unlogged",), "WARNING", "resolver",
        "`count`, `reasons` (`{reason: count}`)",
        "the ledger records rejected in one scan past the first 100 (each logged once as "
        "`ledger_record_rejected`): counted in the metric, said in this one line",
    ),
    LogAction(
        ("scan_failed", "resolver_recovered"), "WARNING, INFO", "resolver",
        "",
        "the first failed scan of a run of failures (retried with backoff); the next good one",
    ),
    LogAction(
        ("scan_done",), "INFO", "resolver",
        "`resolved`",
        "`outbox-resolver --once` finished",
    ),
    LogAction(
        ("outbox_stats_failed",), "WARNING", "resolver",
        "`table`",
        "the resolver cannot read the outbox table for `outbox_backlog_events` and "
        "`outbox_lag_seconds` (missing: not migrated yet; or no `SELECT` for its role): once, until"
        " it can; both are NaN meanwhile",
    ),
    LogAction(
        ("stats_failed",), "WARNING", "both",
        "",
        "a stats pass (backlog, lag; the relay's rows never due, the resolver's blocked keys) "
        "failed on its own session and thread: once, until one succeeds; retried after "
        "`OUTBOX_STATS_INTERVAL` or the reconnection backoff, whichever is longer, on a new "
        "session (the metrics keep their last values meanwhile); or a pass still running at "
        "shutdown",
    ),
    LogAction(
        ("inbox_message_failed",), "WARNING", "a consumer's `Inbox` (logger `outbox_relay.inbox`)",
        "`consumer`, `message_id`, `requeued`",
        "a handler raised, or a message had no `message_id`: its transaction rolled back, the "
        "message requeued or rejected by `on_error` "
        "([python-api.md](python-api.md#when-the-handler-raises))",
    ),
    LogAction(
        ("inbox_event_stale",), "WARNING", "a consumer's `Inbox` (logger `outbox_relay.inbox`)",
        "`consumer`, `message_id`, `ordering_key`, `position`",
        "`check_order`: an event older than the last one applied for its key was skipped "
        "(`Outcome.STALE`: acked, handler not run, its effect never applied); counted in "
        "`Inbox.stale_skipped` ([python-api.md](python-api.md#per-key-order-opt-in))",
    ),
    LogAction(
        ("inbox_order_untrusted",), "WARNING", "a consumer's `Inbox` (logger `outbox_relay.inbox`)",
        "`consumer`, `message_id`, `user_id`, `ordering_key`, `position`",
        "`check_order`: a message with order headers whose `user_id` is none of `relay_users` (not "
        "published by a relay, or `relay_users` misses one) was applied without the per-key check; "
        "counted in `Inbox.untrusted_order`",
    ),
    LogAction(
        ("startup_check_failed",), "ERROR", "both",
        "",
        "a server unfit for the protocol (exit 3): the one line that says why",
    ),
    LogAction(
        ("shutdown_requested",), "INFO", "both",
        "`signal`",
        "the first SIGTERM/SIGINT",
    ),
    LogAction(
        ("schema_applied",), "INFO", "migrate",
        "`table`",
        "`outbox-relay migrate` done",
    ),
    LogAction(
        ("compacted",), "INFO", "compact, resolver",
        "`table`, `heap_bytes_before`, `heap_bytes_after`, `index_bytes_before`, "
        "`index_bytes_after`, `blocked_seconds`, `attempts`, `indexes_rebuilt_concurrently`",
        "`outbox-relay compact`, or the resolver once a snapshot held over "
        "`OUTBOX_RESOLVER_COMPACT_AFTER_HOLD` ended, rewrote the table (sizes after its plain "
        "VACUUM, and after; `indexes_rebuilt_concurrently` false: the rewrite rebuilt them "
        "under the lock)",
    ),
    LogAction(
        ("compact_failed",), "ERROR", "compact, resolver",
        "`table`",
        "the rewrite did not happen: the table stayed locked through every attempt, the "
        "rewrite passed OUTBOX_COMPACT_MAX_BLOCK and was rolled back, PostgreSQL refused a "
        "statement (`outbox-relay compact` exits 1), or, for the resolver (a WARNING, tried "
        "again a minute later, 10 times), VACUUM left over 100,000 dead rows (something still "
        "holds the horizon)",
    ),
    LogAction(
        ("compact_not_allowed",), "WARNING", "resolver",
        "`table`, `heap_bytes`, `index_bytes`",
        "once per held snapshot: the outbox is over `OUTBOX_RESOLVER_COMPACT_ABOVE` after it, "
        "and the resolver's role may not rewrite it (not its owner; on PostgreSQL 17 and "
        "later, no `MAINTAIN`): run `outbox-relay compact` as the owner",
    ),
)
