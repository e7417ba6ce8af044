-- Named queries of the Python API for services (outbox_relay.producer, outbox_relay.inbox).
-- {outbox}, {inbox} and {inbox_keys} are identifiers composed with psycopg.sql; %(x)s are bind
-- parameters. Casts are written CAST(x AS type), which SQLAlchemy's text() reads as well as psycopg.
--
-- These run on the service's own connection, in its transaction, under its own search_path:
-- the API does not change it (a SET LOCAL would change it for the rest of the caller's
-- transaction). So every function is called pg_catalog-qualified: PostgreSQL picks the best
-- match among every schema on the path, and a look-alike in a schema others may create in
-- (public, on PostgreSQL 13 and 14) could otherwise run as the service's role. The one
-- exception is the multi-argument unnest, which PostgreSQL itself expands into
-- pg_catalog.unnest calls (qualified, it would not be expanded). The operators are exact
-- matches of pg_catalog's (text = text, bigint < bigint, timestamptz - interval): found there
-- first as long as the service's search_path does not name pg_catalog after such a schema
-- (by default it comes first).

-- name: enqueue
-- The producer's INSERT: one statement for any number of events (one round trip), in the
-- caller's transaction. Parallel arrays, one element per event; ids are taken in the order
-- given (WITH ORDINALITY), so events of one ordering key keep the caller's order. message_id is
-- made by the caller, so no RETURNING (and no SELECT grant) is needed.
INSERT INTO {outbox} (message_id, exchange, routing_key, ordering_key, payload, payload_bytes,
                      headers, content_type, message_type, correlation_id, available_at)
SELECT m, e, r, o, CAST(p AS jsonb), b, CAST(h AS jsonb), c, y, i, coalesce(a, pg_catalog.now())
FROM unnest(CAST(%(message_id)s AS text[]), CAST(%(exchange)s AS text[]),
            CAST(%(routing_key)s AS text[]), CAST(%(ordering_key)s AS text[]),
            CAST(%(payload)s AS text[]), CAST(%(payload_bytes)s AS bytea[]),
            CAST(%(headers)s AS text[]), CAST(%(content_type)s AS text[]),
            CAST(%(message_type)s AS text[]), CAST(%(correlation_id)s AS text[]),
            CAST(%(available_at)s AS timestamptz[]))
     WITH ORDINALITY AS t(m, e, r, o, p, b, h, c, y, i, a, n)
ORDER BY n;

-- name: inbox_record
-- The inbox, in the consumer's transaction: record the message id (a duplicate finds it there
-- and inserts nothing; a copy being processed right now by another consumer makes this wait
-- for that transaction's outcome). With an ordering key and a position, also move the key's
-- last applied position forward, unless it is already at or past this one (stale).
WITH recorded AS (
    INSERT INTO {inbox} (consumer, message_id)
    VALUES (%(consumer)s, %(message_id)s)
    ON CONFLICT DO NOTHING
    RETURNING 1
), advanced AS (
    INSERT INTO {inbox_keys} AS k (consumer, ordering_key, position, message_id)
    SELECT %(consumer)s, CAST(%(ordering_key)s AS text), CAST(%(position)s AS bigint),
           %(message_id)s
    WHERE EXISTS (SELECT FROM recorded) AND CAST(%(ordering_key)s AS text) IS NOT NULL
    ON CONFLICT (consumer, ordering_key) DO UPDATE
        SET position = excluded.position, message_id = excluded.message_id,
            applied_at = pg_catalog.now()
        WHERE k.position < excluded.position
    RETURNING 1
)
SELECT EXISTS (SELECT FROM recorded), EXISTS (SELECT FROM advanced);

-- name: inbox_prune
-- Retention: forget message ids processed more than older_than seconds ago, a bounded batch
-- per transaction.
DELETE FROM {inbox}
WHERE (consumer, message_id) IN (
    SELECT consumer, message_id FROM {inbox}
    WHERE processed_at
          < pg_catalog.now() - pg_catalog.make_interval(secs => CAST(%(older_than)s AS float8))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);

-- name: inbox_prune_keys
-- The same for the per-key positions: a key quiet for longer than the window has no copy left
-- to arrive late.
DELETE FROM {inbox_keys}
WHERE (consumer, ordering_key) IN (
    SELECT consumer, ordering_key FROM {inbox_keys}
    WHERE applied_at
          < pg_catalog.now() - pg_catalog.make_interval(secs => CAST(%(older_than)s AS float8))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);
