-- outbox-relay schema, version 3 (version 1 and 2 tables are upgraded in place). The version is
-- recorded in the database, as the comment on the outbox table (the end of this file).
--
-- Idempotent: apply it as often as you like. {outbox}, {dead_letter} and the index names are
-- filled in from the configured table name by `outbox-relay migrate`; for psql, print the
-- filled-in SQL with `outbox-relay migrate --print` (default table name: outbox).
--
-- Producers write one row per event with a plain INSERT in the same transaction as their
-- own change. Only routing_key and one of payload / payload_bytes are required.
--
-- Defaults, checks and the generated column bind their functions when the table is created,
-- under the search_path of the session that applies this: `migrate` pins it to pg_catalog
-- (outbox_relay/postgres.py); for psql, the calls whose pg_catalog function needs a cast or
-- takes "any" (which a look-alike in a schema others may create in would beat) are written
-- pg_catalog-qualified.

-- A schema newer than this file is left alone: applying this file to it would record an older
-- version over the newer one (an older outbox-relay's `migrate`, or an old migration run again).
DO $version$
DECLARE
    recorded text := obj_description(to_regclass({outbox_text}), 'pg_class');
BEGIN
    IF coalesce(substring(recorded FROM '^outbox-relay schema version ([0-9]+)')::numeric, 0) > 3 THEN
        RAISE EXCEPTION USING MESSAGE = 'table ' || {outbox_text} || ' has a newer schema than '
            || 'version 3 (' || recorded || '): not changed; use a newer outbox-relay';
    END IF;
END
$version$;

CREATE TABLE IF NOT EXISTS {outbox} (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Stable dedup key, sent as the AMQP message_id on every (re)delivery.
    message_id    text NOT NULL DEFAULT gen_random_uuid()::text,
    exchange      text NOT NULL DEFAULT '',
    routing_key   text NOT NULL,
    -- The aggregate id: events with the same key are meant to be consumed in order.
    ordering_key  text,
    -- Exactly one of: a JSON document (sent as its text) or raw bytes (sent as they are).
    payload       jsonb,
    payload_bytes bytea,
    headers       jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    content_type  text,
    -- The AMQP type and correlation_id properties (consumers route and correlate by them):
    -- set when not NULL. Version 2 tables get them below.
    message_type   text,
    correlation_id text,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Not claimed before this time: retry backoff, or a producer's deliberate delay.
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text,
    CHECK (pg_catalog.num_nonnulls(payload, payload_bytes) = 1)
);

-- Version 1 and 2 tables: the AMQP type and correlation_id columns (NULL in every row there is:
-- no rewrite).
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS message_type text,
                     ADD COLUMN IF NOT EXISTS correlation_id text;

-- What the relay fetches of a row, in bytes (the payload's JSON text or bytes, the headers' JSON
-- text, the text columns): its batches are cut by OUTBOX_BATCH_MAX_BYTES of it, and a row over
-- OUTBOX_MAX_MESSAGE_BYTES is moved to the dead-letter table without being fetched at all.
-- Computed by PostgreSQL at insert (a producer cannot set it). A version 2 table's row_bytes
-- leaves out message_type and correlation_id (a producer could make the relay fetch a row far
-- over its budget through them): it is dropped and added again below. PostgreSQL before 17
-- cannot change a generated column's expression in place. Adding it (to version 1 and 2
-- tables) rewrites the table once, under an exclusive lock.
DO $row_bytes$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_attrdef AS d
               JOIN pg_catalog.pg_attribute AS a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
               WHERE d.adrelid = {outbox_text}::regclass AND a.attname = 'row_bytes'
                 AND pg_catalog.strpos(pg_catalog.pg_get_expr(d.adbin, d.adrelid),
                                       'correlation_id') = 0) THEN
        ALTER TABLE {outbox} DROP COLUMN row_bytes;
    END IF;
END
$row_bytes$;
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS row_bytes bigint GENERATED ALWAYS AS (
    coalesce(octet_length(payload_bytes), octet_length(payload::text), 0)::bigint
    + octet_length(headers::text) + octet_length(message_id) + octet_length(exchange)
    + octet_length(routing_key) + coalesce(octet_length(ordering_key), 0)
    + coalesce(octet_length(content_type), 0) + coalesce(octet_length(message_type), 0)
    + coalesce(octet_length(correlation_id), 0)) STORED;

CREATE UNIQUE INDEX IF NOT EXISTS {message_id_index} ON {outbox} (message_id);

-- Rows that failed before are retried one at a time, in due order.
CREATE INDEX IF NOT EXISTS {retry_index} ON {outbox} (available_at) WHERE attempts > 0;

-- Rows that can never be published, or that ran out of attempts. The dead letter has an id of
-- its own (outbox_id is the row's id in the outbox): an outbox id can come back (TRUNCATE ...
-- RESTART IDENTITY, a re-created outbox, OVERRIDING SYSTEM VALUE) and must never make a dead
-- letter collide with an older one and vanish.
CREATE TABLE IF NOT EXISTS {dead_letter} (
    id            bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    outbox_id     bigint,
    message_id    text NOT NULL,
    exchange      text NOT NULL,
    routing_key   text NOT NULL,
    ordering_key  text,
    payload       jsonb,
    payload_bytes bytea,
    headers       jsonb NOT NULL,
    content_type  text,
    message_type   text,
    correlation_id text,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL,
    last_error    text NOT NULL,
    dead_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Version 1 and 2 dead-letter tables: the AMQP type and correlation_id of their rows.
ALTER TABLE {dead_letter} ADD COLUMN IF NOT EXISTS message_type text,
                          ADD COLUMN IF NOT EXISTS correlation_id text;

-- Version 1 dead-letter tables: the id was the outbox id. Keep it as outbox_id, and number new
-- dead letters after the highest id there is.
ALTER TABLE {dead_letter} ADD COLUMN IF NOT EXISTS outbox_id bigint;
DO $upgrade$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = {dead_letter_text}::regclass AND attname = 'id'
                     AND attidentity <> '') THEN
        UPDATE {dead_letter} SET outbox_id = id WHERE outbox_id IS NULL;
        ALTER TABLE {dead_letter} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY;
        PERFORM pg_catalog.setval(pg_catalog.pg_get_serial_sequence({dead_letter_text}, 'id'),
                       coalesce(max(id), 0) + 1, false)
        FROM {dead_letter};
    END IF;
END
$upgrade$;

-- Per-key order (docs/protocol.md): the claim finds the oldest rows of a key here, and whether
-- the key has a dead letter (which holds it back until an operator requeues or discards it).
-- Rows without a key are in neither index. On an existing table, `migrate` builds them once
-- (CREATE INDEX blocks producers' inserts while it runs: on a large outbox, create them
-- CONCURRENTLY by hand first, with these names, and migrate finds them).
CREATE INDEX IF NOT EXISTS {key_index} ON {outbox} (ordering_key, id)
    WHERE ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS {dead_letter_key_index} ON {dead_letter} (ordering_key)
    WHERE ordering_key IS NOT NULL;

-- The ledger's key: every ledger record carries an HMAC-SHA256 of its fields under this key, and
-- the resolver believes only records whose HMAC checks out. Only the role of the relays and the
-- resolver may read it (sql/roles.sql), never a producer: a record is then evidence that a relay
-- wrote it. 32 bytes from two random UUIDs (244 random bits, PostgreSQL's strong random source).
CREATE TABLE IF NOT EXISTS {ledger_key} (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key        bytea NOT NULL CHECK (octet_length(key) >= 16),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
REVOKE ALL ON {ledger_key} FROM PUBLIC;
INSERT INTO {ledger_key} (key)
VALUES (uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()))
ON CONFLICT (singleton) DO NOTHING;

-- The schema's version, read at start by both programs and by `outbox-relay migrate --check`
-- (outbox_relay/schema.py): "version N" is what this file creates, "usable by ... M" the oldest
-- schema version whose programs can still run on it (a later, additive change keeps M, so
-- relays of the previous version keep running through a rolling upgrade). A comment, not a
-- table: pg_dump (--schema-only too) and pg_restore keep it, it moves with the table, and
-- every role can read it (pg_description) without a grant. Do not change it by hand.
COMMENT ON TABLE {outbox} IS 'outbox-relay schema version 3, usable by programs of schema version 3 or newer; written by outbox-relay migrate';
