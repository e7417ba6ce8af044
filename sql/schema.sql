-- outbox-relay schema, version 1.
--
-- Idempotent: apply it as often as you like. {outbox}, {dead_letter} and the index names are
-- filled in from the configured table name by `outbox-relay migrate`; for psql, print the
-- filled-in SQL with `outbox-relay migrate --print` (default table name: outbox).
--
-- Producers write one row per event with a plain INSERT in the same transaction as their
-- own change. Only routing_key and one of payload / payload_bytes are required.

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
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Not claimed before this time: retry backoff, or a producer's deliberate delay.
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text,
    CHECK (num_nonnulls(payload, payload_bytes) = 1)
);

CREATE UNIQUE INDEX IF NOT EXISTS {message_id_index} ON {outbox} (message_id);

-- Rows that failed before are retried one at a time, in due order.
CREATE INDEX IF NOT EXISTS {retry_index} ON {outbox} (available_at) WHERE attempts > 0;

CREATE TABLE IF NOT EXISTS {dead_letter} (
    id            bigint PRIMARY KEY,
    message_id    text NOT NULL,
    exchange      text NOT NULL,
    routing_key   text NOT NULL,
    ordering_key  text,
    payload       jsonb,
    payload_bytes bytea,
    headers       jsonb NOT NULL,
    content_type  text,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL,
    last_error    text NOT NULL,
    dead_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
