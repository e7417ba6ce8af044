-- outbox-relay consumer inbox, version 1: in the CONSUMER's own database, not the producer's.
--
-- Idempotent: apply it as often as you like. {inbox}, {inbox_keys} and the index names are
-- filled in from the inbox table name by `outbox-inbox migrate` (print the filled-in SQL with
-- `outbox-inbox migrate --print`; default table name: inbox) or by
-- outbox_relay.inbox_schema_sql(table) for an Alembic or Django migration.
--
-- One row per message a consumer has processed, written in the same transaction as the
-- handler's effect: a copy of the message that arrives later finds its message_id here and is
-- acknowledged without running the handler. `consumer` names the handler, so two handlers in
-- one database that receive the same event (two queues bound to one exchange) each apply it.

CREATE TABLE IF NOT EXISTS {inbox} (
    consumer     text NOT NULL,
    message_id   text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention (`outbox-inbox prune`) deletes by age.
CREATE INDEX IF NOT EXISTS {processed_at_index} ON {inbox} (processed_at);

-- Per-key order (opt-in, Inbox(check_order=True)): the position (the producer's outbox row id,
-- header x-outbox-id) of the last event applied for each ordering key (header x-ordering-key).
CREATE TABLE IF NOT EXISTS {inbox_keys} (
    consumer     text NOT NULL,
    ordering_key text NOT NULL,
    position     bigint NOT NULL,
    message_id   text NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (consumer, ordering_key)
);

CREATE INDEX IF NOT EXISTS {keys_applied_at_index} ON {inbox_keys} (applied_at);
