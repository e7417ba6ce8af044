-- Named queries of the outbox store. Each starts with a "-- name:" line; {outbox} and
-- {dead_letter} are table identifiers composed with psycopg.sql, %(x)s are bind parameters.

-- name: claim
-- Step 1 of the protocol. Lock due rows without waiting on anyone's locks and delete them in
-- the same statement, so the claim changes the claimed rows themselves. A row that failed
-- before (attempts > 0) is claimed alone: a poison row then fails only its own batch.
WITH retry AS (
    SELECT id FROM {outbox}
    WHERE attempts > 0 AND available_at <= now()
    ORDER BY available_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), fresh AS (
    SELECT id FROM {outbox}
    WHERE attempts = 0 AND available_at <= now() AND NOT EXISTS (SELECT FROM retry)
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {outbox}
WHERE id IN (SELECT id FROM retry UNION ALL SELECT id FROM fresh)
RETURNING id, message_id, exchange, routing_key, ordering_key, payload::text, payload_bytes,
          headers, content_type, created_at, attempts, last_error;

-- name: dead_letter_claimed
-- A claimed row that can never be published goes to the dead-letter table inside the claim
-- transaction: it is committed together with the batch, or rolled back with it.
INSERT INTO {dead_letter} (id, message_id, exchange, routing_key, ordering_key, payload,
                           payload_bytes, headers, content_type, created_at, attempts, last_error)
VALUES (%(id)s, %(message_id)s, %(exchange)s, %(routing_key)s, %(ordering_key)s,
        %(payload)s::jsonb, %(payload_bytes)s, %(headers)s, %(content_type)s, %(created_at)s,
        %(attempts)s + 1, %(error)s)
ON CONFLICT (id) DO NOTHING;

-- name: forget_delivered
-- After a failed batch was rolled back: rows the broker did confirm are delivered; remove them
-- so the retry does not publish them again. Rows another relay has claimed meanwhile are left
-- to it.
DELETE FROM {outbox}
WHERE id IN (SELECT id FROM {outbox} WHERE id = ANY(%(ids)s) FOR UPDATE SKIP LOCKED);

-- name: record_failures
-- Outside the rolled-back transaction: count the attempt, keep the error, back off
-- exponentially (with jitter) before the row is due again.
UPDATE {outbox} AS o
SET attempts = o.attempts + 1,
    last_error = f.error,
    available_at = now() + make_interval(secs =>
        least(%(max_delay)s::float8, %(base_delay)s::float8 * power(2, o.attempts))
        * (0.75 + random() / 2))
FROM unnest(%(ids)s::bigint[], %(errors)s::text[]) AS f(id, error)
WHERE o.id = f.id
  AND o.id IN (SELECT id FROM {outbox} WHERE id = ANY(%(ids)s) FOR UPDATE SKIP LOCKED);

-- name: dead_letter_exhausted
-- Rows out of attempts move to the dead-letter table in one statement.
WITH moved AS (
    DELETE FROM {outbox}
    WHERE id IN (SELECT id FROM {outbox} WHERE id = ANY(%(ids)s) AND attempts >= %(max_attempts)s
                 FOR UPDATE SKIP LOCKED)
    RETURNING *
)
INSERT INTO {dead_letter} (id, message_id, exchange, routing_key, ordering_key, payload,
                           payload_bytes, headers, content_type, created_at, attempts, last_error)
SELECT id, message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers,
       content_type, created_at, attempts, coalesce(last_error, 'unknown error')
FROM moved
ON CONFLICT (id) DO NOTHING
RETURNING id;

-- name: stats
-- Backlog size and lag: the age of the oldest row not yet published (claimed rows included,
-- they are not published until their batch commits).
SELECT count(*) AS backlog,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS lag_seconds
FROM {outbox};

-- name: server_check
SELECT current_setting('max_prepared_transactions')::int AS max_prepared_transactions,
       to_regclass(%(outbox)s) IS NOT NULL AS has_outbox,
       to_regclass(%(dead_letter)s) IS NOT NULL AS has_dead_letter,
       current_setting('server_version_num')::int AS server_version;

-- name: try_instance_lock
SELECT pg_try_advisory_lock(%(class)s, %(instance)s) AS locked;

-- name: instance_unlock
SELECT pg_advisory_unlock(%(class)s, %(instance)s);

-- name: prepared_of_prefix
-- This database's prepared transactions with our gid prefix; anything else is not ours.
SELECT gid, prepared, owner,
       extract(epoch FROM now() - prepared)::float8 AS age_seconds
FROM pg_prepared_xacts
WHERE database = current_database() AND starts_with(gid, %(prefix)s)
ORDER BY prepared;

-- name: session_role
-- Who may finish a prepared transaction: the role that prepared it (pg_prepared_xacts.owner is
-- its current_user at PREPARE time) or a superuser; membership in that role is not enough.
SELECT current_user AS role, rolsuper AS superuser FROM pg_roles WHERE rolname = current_user;

-- name: xmin_horizon
-- What holds back VACUUM in this database: for each kind of holder, the oldest transaction id it
-- keeps alive (a running or prepared transaction's own xid, a snapshot's xmin, a replication
-- slot's xmin), as its age in transactions; for prepared transactions also in seconds. The
-- database's xmin horizon is the largest of these ages. Sessions in other databases hold back
-- only the shared catalogs here; sessions without a database (walsenders with
-- hot_standby_feedback) hold back every database. pg_stat_activity shows backend_xid and
-- backend_xmin of every role's sessions without extra privileges.
WITH holders AS (
    SELECT CASE WHEN starts_with(gid, %(prefix)s) THEN 'outbox_prepared' ELSE 'other_prepared' END
               AS holder,
           age(transaction) AS xid_age,
           extract(epoch FROM now() - prepared)::float8 AS age_seconds
    FROM pg_prepared_xacts
    WHERE database = current_database()
    UNION ALL
    SELECT 'session', greatest(age(backend_xid), age(backend_xmin)), NULL
    FROM pg_stat_activity
    WHERE (datname = current_database() OR datid IS NULL) AND pid <> pg_backend_pid()
      AND coalesce(backend_xid, backend_xmin) IS NOT NULL
    UNION ALL
    SELECT 'replication_slot', age(xmin), NULL
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL AND (database IS NULL OR database = current_database())
)
SELECT holder, max(xid_age)::bigint AS xid_age, max(age_seconds) AS age_seconds
FROM holders
GROUP BY holder;

-- name: dead_letter_list
-- `outbox-relay dead-letter list`: the oldest dead letters first, with how many there are.
SELECT id, message_id, exchange, routing_key, attempts, dead_at, last_error,
       count(*) OVER () AS total
FROM {dead_letter}
ORDER BY id
LIMIT %(limit)s;

-- name: dead_letter_lock
-- `outbox-relay dead-letter requeue`: lock the chosen rows (all of them, or the given ids) for
-- the transaction that moves them back, in dead-letter order so the new outbox ids keep it.
SELECT id, message_id
FROM {dead_letter}
WHERE %(all)s OR id = ANY(%(ids)s)
ORDER BY id
FOR UPDATE;

-- name: dead_letter_requeue
-- Move one locked dead letter back into the outbox as a fresh row: a new id (the outbox id is
-- GENERATED ALWAYS), attempts 0, due now, no error; everything the producer wrote is kept. A
-- message_id already in the outbox is left in the dead-letter table (no row returned).
WITH moved AS (
    INSERT INTO {outbox} (message_id, exchange, routing_key, ordering_key, payload, payload_bytes,
                          headers, content_type, created_at, attempts, available_at, last_error)
    SELECT message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers,
           content_type, created_at, 0, now(), NULL
    FROM {dead_letter}
    WHERE id = %(id)s
    ON CONFLICT (message_id) DO NOTHING
    RETURNING id
)
DELETE FROM {dead_letter}
WHERE id = %(id)s AND EXISTS (SELECT FROM moved)
RETURNING id, (SELECT id FROM moved) AS outbox_id;
