-- Named queries of the outbox store. Each starts with a "-- name:" line; {outbox} and
-- {dead_letter} are table identifiers composed with psycopg.sql, %(x)s are bind parameters.
--
-- Names: every session of the relay and the resolver runs with search_path pinned to
-- pg_catalog, pg_temp and schema-qualified tables (outbox_relay/postgres.py, pin_search_path),
-- so no function, operator or type here can resolve to one another role created. PostgreSQL
-- picks the best match among every schema on the path, not the first: with the default path,
-- a producer's public.mod(numeric, bigint) or operator <= (numeric, integer) beats pg_catalog's
-- mod(numeric, numeric) and <= (numeric, numeric), which need a cast (public is writable by
-- every role on PostgreSQL 13 and 14). The calls that need a cast (mod, format, convert_to,
-- power, make_interval, the advisory locks) are also written pg_catalog-qualified, for a copy
-- of a statement run in an unpinned session (psql, a benchmark); operators are not, and rely
-- on the pin.

-- name: claim
-- Step 1 of the protocol. Lock due rows without waiting on anyone's locks and delete them in
-- the same statement, so the claim changes the claimed rows themselves. A row that failed
-- before (attempts > 0) is claimed alone: a poison row then fails only its own batch; fresh
-- rows are claimed only when no such row is due (coalesce never evaluates its second ARRAY
-- then, so no fresh row is locked for nothing). attempts is a producer's column too: a
-- negative value counts as fresh.
--
-- A batch holds at most %(limit)s rows and about %(max_bytes)s bytes of row data (row_bytes,
-- computed by PostgreSQL at insert: what the relay fetches of a row), and one row at least
-- when %(one_row_at_least)s (a batch claimed ahead, while another is in memory, takes none
-- beyond its budget, the retried row included: the relay's memory bound, reliability.md).
-- The budget cuts the locked rows in id order; rows locked beyond it stay locked until the
-- batch ends, so the relay asks for about twice the rows that fit last time (store.py). A row
-- over %(max_row_bytes)s bytes (OUTBOX_MAX_MESSAGE_BYTES plus room for headers) is never
-- fetched: this statement moves it to the dead-letter table itself
-- (oversized) and returns only its id, message_id and reason.
--
-- Every column comes in a form psycopg always loads, whatever a producer wrote: the body as
-- bytea (fetched in binary), headers as JSON text (decoded row by row in Python), created_at
-- as float8 epoch seconds (+-Infinity for 'infinity') and as text for a dead-letter copy.
--
-- Every plan of this statement is linear in the batch, whatever the planner believes about
-- the table (an outbox swings between empty and full, and its statistics lag behind):
-- - Each ARRAY(SELECT ...) is an InitPlan: run once, at most once, never rescanned per row.
--   (`id IN (SELECT ... FROM cte)` let the planner build a nested loop that rescanned the CTE
--   for every outbox row: 50,000 x 2,000 tuple copies, seconds per claim.) The budget's
--   window functions run over the locked rows, inside the InitPlan. The rows come locked in
--   id order, so the window over w sorts nothing, and k is named before w: PostgreSQL then
--   computes w first and k last, the rows leave that level sorted by key, and the next
--   level's window over k sorts nothing either. One sort of the batch, by key.
-- - The claim session prepares it once and runs only its generic plan, built whatever the
--   table looked like then (store.py, CLAIM_STATEMENT), and plans with sequential scans off:
--   even a plan made for an empty table walks the primary key in id order and stops after
--   the batch (the retry branch walks outbox_retry_idx). The DELETE finds its rows by
--   ctid, a TID scan: the ctids of the row versions this statement locked (a row changed
--   since the snapshot is locked in its last version, below), which no one else can change
--   or remove before it ends. A sequential scan would read the whole table per claim, and
--   test each row against the whole array.
-- - The CTE of the deleted rows is read twice (for the oversized rows and by the final
--   SELECT), and the oversized rows' twice (by the dead-letter INSERT and the final SELECT),
--   each a scan of the batch. The two joins are LATERAL, nested loops whose inner side is
--   one probe per row: the read of each keyed row's key head (one probe of outbox_key_idx,
--   below), and the lock of each chosen row (one fetch by ctid, below).
-- - Rows another transaction holds (a batch in flight, prepared or in doubt, or a claim
--   made ahead) are stepped over before any per-key probe below: their xmax names a running
--   transaction (one the snapshot lists, or one newer than the snapshot and older than the
--   first age() reading of this transaction; age() assigns no transaction id, so a claim that
--   locks nothing still writes nothing). SKIP LOCKED would skip them too, but only after the
--   probes: with 4 relays, up to 16,000 such rows come before the first free one, and probing
--   each cost PostgreSQL about a quarter more CPU per keyed event (benchmarks/NOTEBOOK.md).
--   xmax is only a hint here, never trusted for order (the checks below still decide): a
--   row whose locker finished after the snapshot waits for the next claim, and a multixact
--   (share locks of other clients) read as a transaction id at worst has its row stepped over
--   while an unrelated transaction of that number runs.
-- Look, choose, lock. The claim looks at up to 3 x %(limit)s due rows in id order (past the
-- rows held, above), each keyed one with its key's head; chooses the first %(limit)s whose
-- key's head no running transaction holds (the head's xmax, the same hint as above); and only
-- then locks those, one by one by ctid, skipping any locked since (LATERAL ... FOR UPDATE
-- SKIP LOCKED). A row whose key's oldest row is in a batch in flight cannot be taken now.
-- Locked anyway (the claim's first form), such rows took room in the batch and were dropped
-- after: with 4 relays and 10,000 keys at random distances, half of every batch, twice
-- the claims and PREPAREs (benchmarks/NOTEBOOK.md). Stepped over without a bound, they
-- made a claim with few keys, all held, read the whole backlog (measured: 53 ms a claim over
-- 50,000 rows); the look stops at three batches instead, and rows beyond it wait for the
-- next claim.
-- Where the look starts: after %(after)s, the relay's low-water mark (relay/marks.py), and
-- where each key's head is looked for: after %(floor)s, below which no row is left, or, for a
-- key the relay holds (a key with a dead letter, whose rows the floor passes), after the
-- bound %(held)s gives it (relay/marks.py; a jsonb object, one lookup per keyed row). A head is
-- read as the first entry of outbox_key_idx in the range (key, floor) < (ordering_key, id) <=
-- (key, this row's id): row comparisons, which only that index can serve, with no equality on
-- the key (an equality let the planner drop the key from the ORDER BY and read the head through
-- the primary key in id order, filtered by key: from the floor on, or, given a plain
-- id > floor, every row above it once per keyed row: 5,000 to 208,000 buffers a claim in the
-- generic plans of test_plans.py). The count of a key's rows between its first and last row
-- in the batch (once locked, below) reads that index the same way: written with an equality
-- on the key and id BETWEEN, a generic plan built on a drained outbox whose statistics still
-- described a keyed backlog walked the primary key from the first to the last id, filtered
-- by key, once per such key: 111,000 buffers a claim; 4 relays with 10,000 keys relayed 8,300
-- events/s, 21,000 once it read that index (benchmarks/NOTEBOOK.md; test_plans.py has the
-- state).
-- Dead index entries that VACUUM may not remove yet (a snapshot held elsewhere keeps every row
-- deleted after it) pile up in front of the due rows; a look from the start of the primary key
-- walked all of them at every claim (p99 13 -> 85 ms over 10 minutes of a held snapshot at 500
-- events/s, docs/performance.md). From the mark, it walks what was claimed since the mark last
-- moved: about a batch or two. Rows below the mark that come back (a rolled-back batch, a late
-- producer commit, a delayed row now due, a key freed) are found by the relay's periodic look
-- from its floor; the head reads start at the floor for the same reason (a key's dead entries
-- would be walked once per probe). What a claim still reads beyond its batch: rows that are not due (a
-- producer's future available_at, rows waiting for a retry, rows of a key held back, below)
-- between the mark and the first due row are stepped over.
--
-- Per-key order (docs/protocol.md): a row with an ordering_key is claimed only when every
-- older row of its key is gone (published and committed) or claimed in this same batch. A row
-- deleted by a batch that is not committed yet (prepared, or in doubt after a crash) is still
-- visible here, so the next rows of its key wait until that batch is finished. The key's
-- oldest row (its head) is read once per keyed row, by a LATERAL join (one probe of
-- outbox_key_idx; the planner may memoize it per key, so with few keys a batch reads each
-- head once), and every check uses it: the statement reads every row in one snapshot, so
-- the head read before locking is the head after. Three checks:
-- - while looking: the head is fresh and due (this row, or an older one), and the key has no
--   dead letter (one probe of the dead-letter key index per row, made only when some dead
--   letter has a key at all: one read per claim). A key held back by a retry or a dead
--   letter is stepped over and not counted in the look, so it cannot fill the batch or the
--   look and starve the other keys, however long it stays held.
-- - while choosing: the head is not held (above). A key held back by a batch in flight (or in
--   doubt) counts in the look: that lasts as long as the batch (milliseconds; in doubt, until
--   the resolver finishes it), and with more of its rows than the look ahead of every other
--   key, claims come back empty until then, as they came back full of dropped rows before.
-- - once locked: the head is our first row of the key, and the key's rows from our first to
--   our last are all ours (else only our first row of it is taken; one count per key with
--   several rows in the batch, on its first row, spread over the key's rows by a window).
--   Rows of a key held back here stay locked, unclaimed, until this batch ends.
-- Each probe walks outbox_key_idx from the key's oldest row: linear in the key's rows in the
-- batch, never a read of the table. Rows without a key skip these checks (the OR stops at
-- ordering_key IS NULL; the head's read is gated on a key, so it reads nothing for them).
WITH live AS MATERIALIZED (
    -- The transactions running at this statement's snapshot: those it lists, and those that
    -- started after it and before this transaction first read age() (lag: how many). An xid8
    -- becomes an xid through text (its low 32 bits), the way every supported version has.
    SELECT ARRAY(SELECT pg_catalog.mod(x::text::numeric, 4294967296)::text::xid
                 FROM pg_snapshot_xip(s) AS x) AS xids,
           age(pg_catalog.mod(pg_snapshot_xmax(s)::text::numeric, 4294967296)::text::xid) AS lag
    FROM pg_current_snapshot() AS s
), claimed AS (
    DELETE FROM {outbox}
    WHERE ctid = ANY(coalesce(
        nullif(ARRAY(SELECT ctid FROM {outbox} AS o
                     WHERE attempts > 0 AND available_at <= now()
                       AND (%(one_row_at_least)s OR row_bytes <= %(max_bytes)s
                            OR row_bytes > %(max_row_bytes)s)
                       AND (ordering_key IS NULL
                            OR ((SELECT h.id FROM {outbox} AS h
                                 WHERE h.ordering_key IS NOT NULL
                                   AND (h.ordering_key, h.id)
                                       > (o.ordering_key,
                                          coalesce((%(held)s::jsonb ->> o.ordering_key)::bigint,
                                                   %(floor)s))
                                   AND (h.ordering_key, h.id) <= (o.ordering_key, o.id)
                                 ORDER BY h.ordering_key, h.id LIMIT 1) = o.id
                                AND NOT EXISTS (SELECT FROM {dead_letter} AS d
                                                WHERE d.ordering_key = o.ordering_key)))
                     ORDER BY available_at
                     LIMIT 1
                     FOR UPDATE SKIP LOCKED), '{{}}'),
        ARRAY(SELECT tid
              FROM (SELECT id, tid, ordering_key, n, taken, first_of_key, head_id,
                           bool_or(gapless) OVER k AS gapless
                    FROM (SELECT *,
                                 CASE WHEN ordering_key IS NOT NULL AND id = first_of_key
                                           AND key_rows > 1 THEN
                                     (SELECT count(*) FROM {outbox} AS h
                                      WHERE h.ordering_key IS NOT NULL
                                        AND (h.ordering_key, h.id)
                                            >= (keyed.ordering_key, keyed.first_of_key)
                                        AND (h.ordering_key, h.id)
                                            <= (keyed.ordering_key, keyed.last_of_key))
                                     = key_rows
                                 END AS gapless
                          FROM (SELECT id, tid, ordering_key, head_id,
                                       row_number() OVER w AS n,
                                       sum(CASE WHEN row_bytes > %(max_row_bytes)s THEN 0
                                                ELSE row_bytes END) OVER w AS taken,
                                       min(id) OVER k AS first_of_key,
                                       max(id) OVER k AS last_of_key,
                                       count(*) OVER k AS key_rows
                                FROM (SELECT c.id, l.tid, l.row_bytes, l.ordering_key, c.head_id
                                      FROM (SELECT id, tid, ordering_key, head_id
                                            FROM (SELECT o.id, o.ctid AS tid, o.ordering_key,
                                                         head.id AS head_id, head.xmax AS head_xmax
                                                  FROM {outbox} AS o
                                                  LEFT JOIN LATERAL (
                                                      SELECT h.id, h.attempts, h.available_at, h.xmax
                                                      FROM {outbox} AS h
                                                      WHERE o.ordering_key IS NOT NULL
                                                        AND h.ordering_key IS NOT NULL
                                                        AND (h.ordering_key, h.id)
                                                            > (o.ordering_key, coalesce(
                                                                (%(held)s::jsonb
                                                                 ->> o.ordering_key)::bigint,
                                                                %(floor)s))
                                                        AND (h.ordering_key, h.id)
                                                            <= (o.ordering_key, o.id)
                                                      ORDER BY h.ordering_key, h.id LIMIT 1) AS head
                                                      ON true
                                                  WHERE o.id > %(after)s
                                                    AND o.attempts <= 0 AND o.available_at <= now()
                                                    AND (o.xmax = '0'::xid
                                                         OR NOT (o.xmax = ANY((SELECT xids FROM live)::xid[])
                                                                 OR age(o.xmax) BETWEEN 1
                                                                                AND (SELECT lag FROM live)))
                                                    AND (o.ordering_key IS NULL
                                                         OR (head.attempts <= 0
                                                             AND head.available_at <= now()
                                                             AND ((SELECT NOT EXISTS (
                                                                      SELECT FROM {dead_letter}
                                                                      WHERE ordering_key IS NOT NULL))
                                                                  OR NOT EXISTS (
                                                                      SELECT FROM {dead_letter} AS d
                                                                      WHERE d.ordering_key = o.ordering_key))))
                                                  ORDER BY o.id
                                                  LIMIT 3 * %(limit)s) AS seen
                                            WHERE ordering_key IS NULL
                                               OR head_xmax = '0'::xid
                                               OR NOT (head_xmax = ANY((SELECT xids FROM live)::xid[])
                                                       OR age(head_xmax) BETWEEN 1 AND (SELECT lag FROM live))
                                            ORDER BY id
                                            LIMIT %(limit)s) AS c
                                      CROSS JOIN LATERAL (
                                          -- A row changed since the snapshot (record_failures
                                          -- after a failed batch, a producer's UPDATE) is
                                          -- locked in its last version, and these conditions
                                          -- are checked again on it: a row now waiting for
                                          -- its retry, or of another key, is not taken.
                                          SELECT o.ctid AS tid, o.row_bytes, o.ordering_key
                                          FROM {outbox} AS o
                                          WHERE o.ctid = c.tid AND o.id = c.id
                                            AND o.attempts <= 0 AND o.available_at <= now()
                                            AND o.ordering_key IS NOT DISTINCT FROM c.ordering_key
                                          FOR UPDATE SKIP LOCKED) AS l) AS locked
                                WINDOW k AS (PARTITION BY ordering_key), w AS (ORDER BY id))
                               AS keyed) AS checked
                    WINDOW k AS (PARTITION BY ordering_key)) AS decided
              WHERE ((n = 1 AND %(one_row_at_least)s) OR taken <= %(max_bytes)s)
                AND (ordering_key IS NULL
                     OR (head_id = first_of_key AND (id = first_of_key OR gapless))))))
    RETURNING *
), oversized AS (
    SELECT *, CASE WHEN coalesce(octet_length(payload_bytes), octet_length(payload::text))
                        > %(max_message_bytes)s
                   THEN pg_catalog.format(
                            'payload of %%s bytes exceeds OUTBOX_MAX_MESSAGE_BYTES=%%s',
                            coalesce(octet_length(payload_bytes), octet_length(payload::text)),
                            %(max_message_bytes)s)
                   ELSE pg_catalog.format(
                            'row of %%s bytes (payload, headers and text columns) exceeds the '
                            '%%s bytes the relay fetches of one row', row_bytes,
                            %(max_row_bytes)s)
              END AS reason
    FROM claimed
    WHERE row_bytes > %(max_row_bytes)s
), moved AS (
    -- No RETURNING: the relays' role needs no SELECT on the dead-letter table for it.
    INSERT INTO {dead_letter} (outbox_id, message_id, exchange, routing_key, ordering_key,
                               payload, payload_bytes, headers, content_type, message_type,
                               correlation_id, created_at, attempts, last_error)
    SELECT id, message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers,
           content_type, message_type, correlation_id, created_at,
           least(attempts, 2147483646) + 1, reason
    FROM oversized
)
SELECT id, message_id, exchange, routing_key, ordering_key,
       coalesce(payload_bytes, pg_catalog.convert_to(payload::text, 'UTF8')) AS body,
       payload IS NOT NULL AS is_json, headers::text AS headers, content_type,
       extract(epoch FROM created_at)::float8 AS created_epoch, created_at::text AS created_at,
       attempts, row_bytes, NULL::text AS dead_reason, message_type, correlation_id
FROM claimed
WHERE row_bytes <= %(max_row_bytes)s
UNION ALL
SELECT id, message_id, '', '', NULL, '\x'::bytea, false, '{{}}', NULL, 0::float8, '',
       least(attempts, 2147483646) + 1, 0::bigint, reason, NULL, NULL
FROM oversized;

-- name: claim_writers
-- Step 1, read twice: before the claim's snapshot and right after the claim (before its
-- frontier). The transactions that hold the outbox's RowExclusiveLock, the lock every INSERT,
-- UPDATE and DELETE of it takes before it touches a row (a producer's INSERT has it before its
-- row gets an id), this session's excepted. An id below the claim's highest that the claim
-- could not see (an INSERT not committed) belongs to one of those read after it, or its row
-- is committed for the frontier: the relay moves its low-water mark past such an id only once
-- they have all ended, seen by the read before a later claim (store.py, ClaimMarks). A
-- transaction holding a snapshot without writing the outbox (a report, a slot) is not among
-- them. pg_locks is readable by every role.
SELECT coalesce(array_agg(virtualtransaction::text), '{{}}'::text[])
FROM pg_catalog.pg_locks
WHERE locktype = 'relation' AND relation = {outbox_text}::regclass
  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
  AND mode = 'RowExclusiveLock' AND pid IS DISTINCT FROM pg_backend_pid();

-- name: claim_frontier
-- Step 1, after the claim, in its transaction (its own deletes are gone from view): where the
-- relay's marks may move (store.py, ClaimMarks). waiting: the first row after %(after)s that
-- a claim would take if no one held it (due, fresh, its key's head fresh and due, no dead
-- letter of its key): rows of a batch in flight or in doubt, of a claim made ahead, of a key
-- held by a batch in flight; the mark stays below it. Only when %(full)s (the CTEs' one-time
-- filters and the CASE branch run nothing otherwise):
-- - first: the first row after %(after)s that is not parked, not of a dead key and not of a
--   parked key, due or not, held back for long or not (it may be a key's head: the head reads
--   start at the floor); the floor stays below it.
-- - dead_keys, dead_lows: the keys of the dead letters, when there are %(max_held)s such dead
--   letters at most with %(max_held_bytes)s bytes of keys at most (one read of that many
--   entries of the dead-letter key index), and for each the lowest id one of its dead letters
--   gets back when it is requeued (dead_letter_requeue; NULL: none, it gets a new one). The
--   relay holds those keys (relay/marks.py: %(held)s, where each one's head reads start,
--   below every row of it and below that id), and the floor passes their rows. Past either
--   bound, dead_keys is NULL: first is also below the lowest such id, as for every key before.
-- - parked: a row without an ordering key that waits for its retry or is due over
--   %(park_horizon)s from now (a producer's available_at; PARK_HORIZON, 2 s, in
--   outbox_relay/postgres.py, which the stats' lowest_unparked uses too; a row committed just
--   after this transaction began has a later now() of its own: not parked, it is claimed at
--   once). No head read looks for it, and a retry is claimed by available_at
--   (outbox_retry_idx), never from the mark: the floor may pass it, so that one scheduled for
--   tomorrow does not have every look from the floor walk the dead entries a held snapshot
--   keeps behind it (relay/marks.py).
--   parked_low, parked_due_in: the lowest id of the parked rows between %(after)s and first
--   that are not retries, and the seconds until the first of them is due: the relay looks
--   from below the lowest again once one is.
-- - parked_keys: the keys whose head (their oldest row, read as the claim reads it) is a row
--   with an ordering key that would be parked if it had none: a poison event between its
--   retries, an event scheduled for tomorrow, and every later row of its key waits behind
--   it. The keys of the rows between %(after)s and first (each such row's head is parked),
--   and those held already whose head still is (one probe each): at most %(max_held)s, with
--   %(max_held_bytes)s bytes of keys (NULL past either bound, and first is then the first
--   row that is not parked and not of a dead key, as before). The relay holds them as it
--   holds the dead keys, and lets one go at the first look that finds its head not parked
--   (published, due within %(park_horizon)s, deleted): that look starts below its rows.
-- Each walks the primary key from %(after)s, the range the claim walked (parked twice, up to
-- first, and only while rows it counts lie there; first and parked_keys once more, with a
-- probe of outbox_key_idx for each keyed row they pass; first reads the dead-letter table,
-- once a full look). The arithmetic is in float8: 'infinity' is +Infinity, never an error.
WITH dead_letters AS MATERIALIZED (
    SELECT d.ordering_key, d.outbox_id FROM {dead_letter} AS d
    WHERE %(full)s AND d.ordering_key IS NOT NULL
    LIMIT %(max_held)s + 1
), dead AS MATERIALIZED (
    SELECT CASE WHEN (SELECT count(*) <= %(max_held)s
                             AND coalesce(sum(octet_length(ordering_key)), 0)
                                 <= %(max_held_bytes)s FROM dead_letters)
                THEN coalesce(array_agg(ordering_key ORDER BY ordering_key), '{{}}') END AS keys,
           array_agg(low ORDER BY ordering_key) AS lows
    FROM (SELECT ordering_key, min(outbox_id) AS low FROM dead_letters
          GROUP BY ordering_key) AS k
), past_keys AS MATERIALIZED (
    -- The first row that is not parked, not of a dead key, and not of a key whose head is
    -- parked (read from where the claim reads it).
    SELECT o.id FROM {outbox} AS o
    WHERE %(full)s AND o.id > %(after)s
      AND NOT (o.ordering_key IS NULL
               AND (o.attempts > 0 OR o.available_at > now() + %(park_horizon)s::interval))
      AND NOT coalesce(o.ordering_key = ANY((SELECT keys FROM dead)::text[]), false)
      AND NOT (o.ordering_key IS NOT NULL
               AND coalesce((SELECT h.attempts > 0
                                    OR h.available_at > now() + %(park_horizon)s::interval
                             FROM {outbox} AS h
                             WHERE h.ordering_key IS NOT NULL
                               AND (h.ordering_key, h.id)
                                   > (o.ordering_key,
                                      coalesce((%(held)s::jsonb ->> o.ordering_key)::bigint,
                                               %(floor)s))
                               AND (h.ordering_key, h.id) <= (o.ordering_key, o.id)
                             ORDER BY h.ordering_key, h.id LIMIT 1), false))
    ORDER BY o.id LIMIT 1
), passed AS MATERIALIZED (
    -- The keyed rows that walk passed, not of a dead key: each one's head is parked.
    SELECT min(r.id) AS low, array_agg(DISTINCT r.key) AS keys FROM (
        -- OFFSET 0: the range's rows by the primary key, never the whole key index (a
        -- partial one, which "ordering_key IS NOT NULL" here would let a plan read).
        SELECT o.id, o.ordering_key AS key FROM {outbox} AS o
        WHERE %(full)s AND o.id > %(after)s
          AND o.id < coalesce((SELECT id FROM past_keys), 9223372036854775807)
        OFFSET 0) AS r
    WHERE r.key IS NOT NULL
      AND NOT coalesce(r.key = ANY((SELECT keys FROM dead)::text[]), false)
), parked_keys AS MATERIALIZED (
    -- The keys of the rows that walk passed, and the keys held already whose head still is
    -- parked: at most %(max_held)s, %(max_held_bytes)s bytes.
    SELECT CASE WHEN count(*) <= %(max_held)s
                     AND coalesce(sum(octet_length(key)), 0) <= %(max_held_bytes)s
                THEN coalesce(array_agg(key ORDER BY key), '{{}}') END AS keys
    FROM (SELECT unnest((SELECT keys FROM passed)) AS key
          UNION
          SELECT k.key FROM jsonb_each_text(%(held)s::jsonb) AS k(key, low)
          WHERE %(full)s
            AND NOT coalesce(k.key = ANY((SELECT keys FROM dead)::text[]), false)
            AND coalesce((SELECT h.attempts > 0
                                 OR h.available_at > now() + %(park_horizon)s::interval
                          FROM {outbox} AS h
                          WHERE h.ordering_key IS NOT NULL
                            AND (h.ordering_key, h.id) > (k.key, k.low::bigint)
                            AND (h.ordering_key, h.id) <= (k.key, 9223372036854775807)
                          ORDER BY h.ordering_key, h.id LIMIT 1), false)
          LIMIT %(max_held)s + 1) AS k
), unparked AS MATERIALIZED (
    -- Past the bounds, the first row that is not parked and not of a dead key, as before:
    -- the first keyed row that walk passed, or the row it stopped at.
    SELECT CASE WHEN (SELECT keys FROM parked_keys) IS NOT NULL
                THEN (SELECT id FROM past_keys)
                ELSE least((SELECT id FROM past_keys), (SELECT low FROM passed)) END AS id
    WHERE %(full)s
), parked AS MATERIALIZED (
    SELECT min(o.id) AS low,
           min(extract(epoch FROM o.available_at)::float8) - extract(epoch FROM now())::float8
               AS due_in
    FROM {outbox} AS o
    WHERE %(full)s AND o.id > %(after)s
      AND o.id < coalesce((SELECT id FROM unparked), 9223372036854775807)
      AND o.ordering_key IS NULL AND o.attempts <= 0
      AND o.available_at > now() + %(park_horizon)s::interval
)
SELECT (SELECT o.id FROM {outbox} AS o
        WHERE o.id > %(after)s AND o.attempts <= 0 AND o.available_at <= now()
          AND (o.ordering_key IS NULL
               OR ((SELECT h.attempts <= 0 AND h.available_at <= now() FROM {outbox} AS h
                    WHERE h.ordering_key IS NOT NULL
                      AND (h.ordering_key, h.id)
                          > (o.ordering_key,
                             coalesce((%(held)s::jsonb ->> o.ordering_key)::bigint, %(floor)s))
                      AND (h.ordering_key, h.id) <= (o.ordering_key, o.id)
                    ORDER BY h.ordering_key, h.id LIMIT 1)
                   AND NOT EXISTS (SELECT FROM {dead_letter} AS d
                                   WHERE d.ordering_key = o.ordering_key)))
        ORDER BY o.id LIMIT 1) AS waiting,
       CASE WHEN %(full)s THEN
           least((SELECT id FROM unparked),
                 (SELECT min(d.outbox_id) FROM {dead_letter} AS d
                  WHERE (SELECT keys FROM dead) IS NULL
                    AND d.ordering_key IS NOT NULL AND d.outbox_id > %(after)s)) END AS first,
       (SELECT low FROM parked) AS parked_low,
       (SELECT due_in FROM parked) AS parked_due_in,
       (SELECT keys FROM dead) AS dead_keys,
       (SELECT lows FROM dead) AS dead_lows,
       (SELECT keys FROM parked_keys) AS parked_keys;

-- name: dead_letter_claimed
-- A claimed row that can never be published goes to the dead-letter table inside the claim
-- transaction: it is committed together with the batch, or rolled back with it. The dead
-- letter gets an id of its own (no conflict can drop it); outbox_id keeps the row's. The
-- body goes back as the claim fetched it, bytes sent in binary (a JSON payload's UTF-8 text
-- too): the relay makes no copy of it for this.
INSERT INTO {dead_letter} (outbox_id, message_id, exchange, routing_key, ordering_key, payload,
                           payload_bytes, headers, content_type, message_type, correlation_id,
                           created_at, attempts, last_error)
VALUES (%(id)s, %(message_id)s, %(exchange)s, %(routing_key)s, %(ordering_key)s,
        CASE WHEN %(is_json)s THEN convert_from(%(body)s, 'UTF8')::jsonb END,
        CASE WHEN NOT %(is_json)s THEN %(body)s END, %(headers)s::jsonb, %(content_type)s,
        %(message_type)s, %(correlation_id)s, %(created_at)s::timestamptz,
        least(%(attempts)s, 2147483646) + 1, %(error)s);

-- name: forget_delivered
-- After a failed batch was rolled back: rows the broker did confirm are delivered; remove them
-- so the retry does not publish them again. Rows another relay has claimed meanwhile are left
-- to it. This and the next two statements run on the main session in one transaction with
-- sequential scans off (store.py), and lock their rows in an ARRAY(...) InitPlan, run once:
-- every plan finds the given ids by primary key, linear in their number.
DELETE FROM {outbox}
WHERE id = ANY(ARRAY(SELECT id FROM {outbox} WHERE id = ANY(%(ids)s) FOR UPDATE SKIP LOCKED));

-- name: record_failures
-- Outside the rolled-back transaction: count the attempt, keep the error, back off
-- exponentially (with jitter) before the row is due again. %(errors)s is a jsonb object from
-- each row id (as text) to its error: each row looks its error up in it (a binary search),
-- where a join with unnest(ids, errors) could be planned as a nested loop rescanning the
-- unnest for every row. attempts is a producer's column too: clamped, so no value of it can
-- make this fail.
UPDATE {outbox} AS o
SET attempts = greatest(least(o.attempts, 2147483646), 0) + 1,
    last_error = %(errors)s::jsonb ->> o.id::text,
    available_at = now() + pg_catalog.make_interval(secs =>
        least(%(max_delay)s::float8,
              %(base_delay)s::float8 * pg_catalog.power(2, least(greatest(o.attempts, 0), 60)))
        * (0.75 + random() / 2))
WHERE o.id = ANY(ARRAY(SELECT id FROM {outbox} WHERE id = ANY(%(ids)s) FOR UPDATE SKIP LOCKED));

-- name: dead_letter_exhausted
-- Rows out of attempts move to the dead-letter table in one statement (the CTE is read once,
-- by the INSERT; each dead letter gets an id of its own: nothing deleted here can fail to
-- arrive there).
WITH moved AS (
    DELETE FROM {outbox}
    WHERE id = ANY(ARRAY(SELECT id FROM {outbox}
                         WHERE id = ANY(%(ids)s) AND attempts >= %(max_attempts)s
                         FOR UPDATE SKIP LOCKED))
    RETURNING *
)
INSERT INTO {dead_letter} (outbox_id, message_id, exchange, routing_key, ordering_key, payload,
                           payload_bytes, headers, content_type, message_type, correlation_id,
                           created_at, attempts, last_error)
SELECT id, message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers,
       content_type, message_type, correlation_id, created_at, attempts,
       coalesce(last_error, 'unknown error')
FROM moved
RETURNING outbox_id;

-- name: dead_letter_rows
-- Rows set aside before their batch was published (relay/worker.py, _set_aside): moved to the
-- dead-letter table as they are in the outbox, each with its reason from %(errors)s (a jsonb
-- object from row id to reason, as in record_failures). Rows another relay holds are left to it.
WITH moved AS (
    DELETE FROM {outbox}
    WHERE id = ANY(ARRAY(SELECT id FROM {outbox} WHERE id = ANY(%(ids)s) FOR UPDATE SKIP LOCKED))
    RETURNING *
)
INSERT INTO {dead_letter} (outbox_id, message_id, exchange, routing_key, ordering_key, payload,
                           payload_bytes, headers, content_type, message_type, correlation_id,
                           created_at, attempts, last_error)
SELECT id, message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers,
       content_type, message_type, correlation_id, created_at, least(attempts, 2147483646) + 1,
       coalesce(%(errors)s::jsonb ->> id::text, 'unknown error')
FROM moved
RETURNING outbox_id;

-- name: stats
-- Backlog size, lag, and the rows that will never be due, of the rows with ids above
-- %(after)s, and the lowest and highest id seen (NULL when none). Run on
-- a session of its own, on a thread of its own (outbox_relay/runtime/stats.py), never on the
-- batch or claim path:
-- every stats_interval from a floor (the lowest id the last pass saw, less one), a walk of
-- the primary key over about what was published since (the dead entries a held snapshot
-- keeps below the floor are not visited again), and every FULL_STATS_INTERVAL from 0, one
-- exact pass over the whole table (a count needs it), which finds what came back below the
-- floor (a late commit of an older id, a requeued dead letter's old id, a restored row);
-- stats_lowest then says where the next passes start, and counts the rows they leave out.
-- - backlog: every row not yet published (claimed rows included, they are not published until
--   their batch commits; rows a producer delayed too).
-- - lag: how late the oldest of them is: its age counted from when it was due, its created_at,
--   or its producer's available_at when that is later. A row the producer delayed is not late
--   before its time (it made OutboxLagHigh fire for events delayed on purpose); a row not due
--   yet has a due time in the future, which the min() passes over as long as any row is due
--   (when none is, the value is negative: how long until the first is due; outbox_stats
--   exports 0 then). A row that failed before (attempts > 0: its available_at is its
--   retry's) is late since its created_at. A row due but held behind an
--   older row of its key (per-key order) is late too: its consumers wait for it.
-- - never_due: rows delayed to the year 10000 or later ('infinity' included): the relay moves
--   them to the dead-letter table (dead_letter_never_due).
-- Per row, 1,458 instructions of PostgreSQL 15 where the backlog and lag alone took 1,155
-- (callgrind, docs/operations.md; measured when this aggregate also computed two of
-- stats_lowest's ids). created_at and available_at are a producer's columns: an 'infinity'
-- created_at is left out and the arithmetic is in float8, so no value can make this fail.
SELECT count(*) AS backlog,
       {_lag_seconds} AS lag_seconds,
       count(*) FILTER (WHERE available_at >= '10000-01-01 00:00:00+00') AS never_due,
       min(id) AS lowest,
       max(id) AS highest,
       -- A full pass's: the ids at or below %(floor)s (where the last passes had got to:
       -- the rows held back below it, and any that came back there), when there are
       -- %(max_listed)s at most; stats_lowest reads them by id and walks from the floor.
       CASE WHEN count(*) FILTER (WHERE id <= %(floor)s) <= %(max_listed)s
            THEN coalesce(array_agg(id) FILTER (WHERE id <= %(floor)s), '{{}}') END AS listed
FROM {outbox} AS o
WHERE id > %(after)s;

-- name: _lag_seconds
-- (stats' lag_seconds, and stats_lowest's of the rows below lowest_due) How late the oldest
-- row o is, as stats describes it.
extract(epoch FROM now())::float8
    - extract(epoch FROM min(CASE WHEN o.attempts > 0 THEN o.created_at
                                  ELSE greatest(o.created_at, o.available_at)
                             END)
              FILTER (WHERE isfinite(o.created_at)))::float8

-- name: stats_lowest
-- A full stats pass's second statement, in the same REPEATABLE READ snapshot as stats and with
-- sequential scans off (outbox_relay/postgres.py, outbox_stats): each value the first row it
-- wants in id order, with a probe of outbox_key_idx for each keyed row it passes (its key's
-- head, its oldest row: listed_heads). The rows it reads: those at or below %(floor)s by id,
-- as stats listed them (%(listed)s: where the passes had got to, the rows held back below
-- it, and any that came back there), and a walk of the primary key from there. A held
-- snapshot keeps the dead entries of every row published meanwhile, and a row held back for
-- long (a scheduled event, a poison event's key) lies below them all: walks from the lowest
-- row took 0.8 s a full pass after 10 minutes at 2,000 events/s, in the relay and in the
-- resolver, and raised p99 with them. Past MAX_LISTED rows at or below the floor
-- (outbox_relay/postgres.py), stats lists none, and %(floor)s is below the lowest row.
-- - lowest_unparked: the lowest id of a row that is not parked, not of a dead key (below)
--   and not of a parked key (claim_frontier): a relay whose claims' floor is at or above it
--   has its next claim look from below it (a row that came back below the floor, or a parked
--   one a producer made due or keyed since).
-- - parked_keys, lowest_parked_key: the parked keys of the rows below lowest_unparked, each
--   with its lowest id there (NULL past the frontier's bounds), and the lowest of those ids:
--   the relay has its next claim look from below those of a key it does not hold.
-- - lowest_due: the lowest id of a row that is not a fresh one delayed over
--   %(park_horizon)s (before the year 10000: those go to the dead-letter table), not of a
--   dead key, and not of a key whose head is such a delayed row.
--   The next passes may start past the delayed rows and the held keys' rows below lowest_due
--   (all of them when it is NULL), which the full pass counts for them (below: their number,
--   and the oldest one's lag, _lag_seconds): a scheduled event held back for
--   a day, or the rows waiting behind a poison event's dead letter, would otherwise have
--   every pass walk the dead entries a held snapshot keeps behind them.
-- - dead keys: the keys of the dead letters, as the claims' frontier reads them (the claims'
--   floor passes their rows too), when there are %(max_held)s such dead letters at most, with
--   %(max_held_bytes)s bytes of keys at most (NULL, none, otherwise): one read of that many
--   entries of the dead-letter key index, and a lookup in a jsonb object per keyed row
--   walked.
WITH dead AS MATERIALIZED (
    SELECT CASE WHEN count(*) <= %(max_held)s
                     AND coalesce(sum(octet_length(d.ordering_key)), 0) <= %(max_held_bytes)s
                THEN coalesce(jsonb_object_agg(d.ordering_key, true), '{{}}') END AS keys
    FROM (SELECT d.ordering_key FROM {dead_letter} AS d
          WHERE d.ordering_key IS NOT NULL
          LIMIT %(max_held)s + 1) AS d
), listed_heads AS MATERIALIZED (
    -- The keys of the listed rows, each with its lowest: its head (every row at or below the
    -- floor is listed). A key's head probe starts there, or at the floor for the other keys,
    -- never below the dead entries a held snapshot keeps of the key's rows.
    SELECT coalesce(jsonb_object_agg(key, low), '{{}}') AS keys
    FROM (SELECT r.key, min(r.id) AS low
          FROM (SELECT o.ordering_key AS key, o.id FROM {outbox} AS o  -- OFFSET 0: by id,
                WHERE o.id = ANY(%(listed)s::bigint[]) OFFSET 0) AS r  -- never the key index
          WHERE r.key IS NOT NULL
          GROUP BY r.key) AS k
), due AS MATERIALIZED (
    -- The listed rows are all below the walk's: the walk runs only when none of them is the
    -- one (coalesce evaluates its second argument only then).
    SELECT coalesce((SELECT min(o.id) FROM {outbox} AS o
                     WHERE o.id = ANY(%(listed)s::bigint[]) AND ({_due_row})),
                    (SELECT o.id FROM {outbox} AS o
                     WHERE o.id > %(floor)s AND ({_due_row})
                     ORDER BY o.id LIMIT 1)) AS id
), unparked AS MATERIALIZED (
    -- lowest_due <= lowest_unparked: from there.
    SELECT coalesce((SELECT min(o.id) FROM {outbox} AS o
                     WHERE o.id = ANY(%(listed)s::bigint[]) AND o.id >= (SELECT id FROM due)
                       AND ({_unparked_row})),
                    (SELECT o.id FROM {outbox} AS o
                     WHERE o.id > %(floor)s AND o.id >= (SELECT id FROM due)
                       AND ({_unparked_row})
                     ORDER BY o.id LIMIT 1)) AS id
), scan AS NOT MATERIALIZED (
    -- Every row of the range, for the two counts below (no order needed).
    SELECT o.id, o.ordering_key, o.attempts, o.available_at, o.created_at FROM {outbox} AS o
    WHERE o.id = ANY(%(listed)s::bigint[])
    UNION ALL
    SELECT o.id, o.ordering_key, o.attempts, o.available_at, o.created_at FROM {outbox} AS o
    WHERE o.id > %(floor)s
), parked_keys AS MATERIALIZED (
    SELECT CASE WHEN count(*) <= %(max_held)s
                     AND coalesce(sum(octet_length(key)), 0) <= %(max_held_bytes)s
                THEN coalesce(jsonb_object_agg(key, low), '{{}}') END AS keys,
           min(low) AS lowest
    FROM (SELECT r.key, min(r.id) AS low
          FROM (SELECT o.ordering_key AS key, o.id FROM scan AS o  -- OFFSET 0: claim_frontier
                WHERE o.id < coalesce((SELECT id FROM unparked), 9223372036854775807)
                OFFSET 0) AS r
          WHERE r.key IS NOT NULL AND NOT coalesce((SELECT keys FROM dead) ? r.key, false)
          GROUP BY r.key) AS k
), below AS MATERIALIZED (
    SELECT count(*) AS rows, {_lag_seconds} AS lag_seconds
    FROM scan AS o
    WHERE o.id < coalesce((SELECT id FROM due), 9223372036854775807)
)
SELECT (SELECT id FROM unparked) AS lowest_unparked,
       (SELECT id FROM due) AS lowest_due,
       (SELECT keys FROM parked_keys) AS parked_keys,
       (SELECT lowest FROM parked_keys) AS lowest_parked_key,
       (SELECT rows FROM below) AS below,
       (SELECT lag_seconds FROM below) AS lag_below;

-- name: _due_row
-- (stats_lowest's lowest_due, in its two reads) A row o that is not a fresh one delayed over
-- the horizon (before the year 10000), not of a dead key, and not of a key whose head is
-- such a delayed row.
(o.attempts > 0 OR o.available_at <= now() + %(park_horizon)s::interval
 OR o.available_at >= '10000-01-01 00:00:00+00')
AND NOT (o.ordering_key IS NOT NULL
         AND (coalesce((SELECT keys FROM dead) ? o.ordering_key, false)
              OR coalesce((SELECT h.attempts <= 0
                                  AND h.available_at > now() + %(park_horizon)s::interval
                                  AND h.available_at < '10000-01-01 00:00:00+00'
                           {_key_head}), false)))

-- name: _unparked_row
-- (stats_lowest's lowest_unparked, in its two reads) A row o that is not parked, not of a
-- dead key and not of a parked key, as claim_frontier's past_keys reads them.
NOT (o.ordering_key IS NULL
     AND (o.attempts > 0 OR o.available_at > now() + %(park_horizon)s::interval))
AND NOT (o.ordering_key IS NOT NULL
         AND (coalesce((SELECT keys FROM dead) ? o.ordering_key, false)
              OR coalesce((SELECT h.attempts > 0
                                  OR h.available_at > now() + %(park_horizon)s::interval
                           {_key_head}), false)))

-- name: _key_head
-- (_due_row's and _unparked_row's) The head h of row o's key: its oldest row, from the key's
-- lowest listed row or from the floor (listed_heads), one probe of outbox_key_idx.
FROM {outbox} AS h
WHERE h.ordering_key IS NOT NULL
  AND (h.ordering_key, h.id)
      > (o.ordering_key,
         coalesce(((SELECT keys FROM listed_heads) ->> o.ordering_key)::bigint - 1, %(floor)s))
  AND (h.ordering_key, h.id) <= (o.ordering_key, o.id)
ORDER BY h.ordering_key, h.id LIMIT 1

-- name: dead_letter_never_due
-- Rows delayed to the year 10000 or later ('infinity' included) are never due: never published,
-- and a keyed one would hold every later row of its key forever, unseen. The relay moves them
-- to the dead-letter table when the stats count some (relay/worker.py), where they are seen
-- (OutboxDeadLettering; a keyed one's key in outbox_blocked_keys) and `dead-letter requeue`
-- makes them due now. Only a key's oldest row (while an older row of its key waits, it holds
-- nothing back yet; it goes once that one is published), at most %(limit)s at a time; rows
-- another session holds are left to it. A pass over the table (no index has available_at for
-- fresh rows), made only when the stats found such rows.
WITH moved AS (
    DELETE FROM {outbox}
    WHERE id = ANY(ARRAY(
        SELECT o.id FROM {outbox} AS o
        WHERE o.available_at >= '10000-01-01 00:00:00+00'
          AND (o.ordering_key IS NULL
               OR NOT EXISTS (SELECT FROM {outbox} AS h
                              WHERE h.ordering_key = o.ordering_key AND h.id < o.id))
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED))
    RETURNING *
), stored AS (
    -- No RETURNING: the relays' role may read only outbox_id and ordering_key there.
    INSERT INTO {dead_letter} (outbox_id, message_id, exchange, routing_key, ordering_key,
                               payload, payload_bytes, headers, content_type, message_type,
                               correlation_id, created_at, attempts, last_error)
    SELECT id, message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers,
           content_type, message_type, correlation_id, created_at, least(attempts, 2147483646) + 1,
           format('available_at %%L is never due (a date before the year 10000 is required)',
                  available_at)
    FROM moved
)
SELECT id, message_id, format('available_at %%L is never due (a date before the year 10000 is '
                              'required)', available_at) AS reason
FROM moved;

-- name: blocked_keys
-- Ordering keys held back behind a dead letter (the claim claims none of their rows until an
-- operator requeues or discards it): the resolver's gauge. An index-only scan of the partial
-- dead-letter key index.
SELECT count(DISTINCT ordering_key) FROM {dead_letter} WHERE ordering_key IS NOT NULL;

-- name: outbox_schema
-- Where an unqualified outbox table is, under the session's own search_path (the role's or
-- the database's setting, or options in the URL): its schema, or, before `migrate` created it,
-- the schema it would be created in. It runs before search_path is pinned (next statement),
-- so every name in it is qualified, its operators too.
SELECT coalesce((SELECT n.nspname::pg_catalog.text
                 FROM pg_catalog.pg_class AS c
                 JOIN pg_catalog.pg_namespace AS n
                   ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
                 WHERE c.oid OPERATOR(pg_catalog.=)
                       pg_catalog.to_regclass(%(outbox)s::pg_catalog.text)),
                pg_catalog.current_schema()::pg_catalog.text) AS schema;

-- name: pin_search_path
-- Every session of both programs resolves functions, operators and types in pg_catalog alone
-- (pg_temp, listed last, holds no function this session did not create); tables are named
-- with their schema. No role but a superuser can create in pg_catalog (create_check).
SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false);

-- name: create_check
-- Who may CREATE in pg_catalog (the sessions' pinned search_path) and in the outbox's schema
-- (not on the programs' path, but on their neighbours': producers, services, psql), besides
-- those trusted anyway: superusers, this session's role, and members of the schema's owner or
-- of the outbox table's owner (who may change the table itself). PUBLIC's grant is
-- public_create (every role then has it: the list is left to that flag).
SELECT n.nspname AS schema,
       EXISTS (SELECT FROM aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) AS a
               WHERE a.grantee = 0 AND a.privilege_type = 'CREATE') AS public_create,
       ARRAY(SELECT r.rolname::text
             FROM pg_roles AS r
             WHERE has_schema_privilege(r.oid, n.oid, 'CREATE')
               AND NOT r.rolsuper AND r.rolname <> current_user
               AND NOT pg_has_role(r.oid, n.nspowner, 'MEMBER')
               AND NOT coalesce(pg_has_role(r.oid, (SELECT relowner FROM pg_class
                                                    WHERE oid = to_regclass(%(outbox)s)),
                                            'MEMBER'), false)
             ORDER BY r.rolname) AS roles
FROM pg_namespace AS n
WHERE n.nspname IN ('pg_catalog', %(schema)s)
ORDER BY n.nspname <> 'pg_catalog';

-- name: server_check
SELECT current_setting('max_prepared_transactions')::int AS max_prepared_transactions,
       to_regclass(%(outbox)s) IS NOT NULL AS has_outbox,
       to_regclass(%(dead_letter)s) IS NOT NULL AS has_dead_letter,
       current_setting('server_version_num')::int AS server_version;

-- name: schema_version
-- The schema's version (outbox_relay/schema.py): the comment `migrate` writes on the outbox
-- table. pg_description is readable by every role; to_regclass needs USAGE on the schema.
SELECT to_regclass(%(outbox)s) IS NOT NULL AND to_regclass(%(dead_letter)s) IS NOT NULL
           AS has_tables,
       obj_description(to_regclass(%(outbox)s), 'pg_class') AS recorded;

-- name: order_check
-- The relay's claim keeps per-key order with the key indexes (`migrate` creates them) and reads
-- the dead-letter table's ordering_key (sql/roles.sql grants it).
SELECT to_regclass(%(key_index)s) IS NOT NULL AND to_regclass(%(dead_letter_key_index)s) IS NOT NULL
           AS has_key_indexes,
       has_column_privilege(%(dead_letter)s, 'ordering_key', 'SELECT') AS reads_dead_letter_keys;

-- name: claim_lock
-- Claims of one table run one at a time, across every relay (one advisory lock per table, its
-- single-key form: the resolver's watch reads only the two-key instance locks). Concurrent
-- claims lock rows they then drop (a key whose oldest row another claim holds), and each makes
-- the others' batches smaller: with 50 keys, 4 relays relayed 0.07x the keyless rate and
-- PostgreSQL burnt over 80 s of CPU on 50,000 events; one claim at a time, 0.42x
-- (benchmarks/NOTEBOOK.md). Taken and released around the claim statement in one
-- pipeline (store.py), so it is never held while the server waits on a relay; the claims
-- themselves are milliseconds, the batches (prepare, publish, commit) still overlap.
SELECT pg_catalog.pg_advisory_lock(%(key)s);

-- name: claim_unlock
SELECT pg_catalog.pg_advisory_unlock(%(key)s);

-- name: try_instance_lock
SELECT pg_catalog.pg_try_advisory_lock(%(class)s, %(instance)s) AS locked;

-- name: instance_unlock
SELECT pg_catalog.pg_advisory_unlock(%(class)s, %(instance)s);

-- name: watch
-- The resolver's watch, every OUTBOX_RESOLVER_WATCH_INTERVAL between its scans: this
-- database's prepared batches with our gid prefix, and the instance locks (key 1: the prefix's
-- lock class) held right now; a batch whose relay holds no lock is one to take over at once.
-- Both are read from shared memory (no table, no row is touched; pg_locks copies the lock
-- table, and only when a batch is prepared: the one-time filter skips it otherwise). A
-- blocking pg_advisory_lock() wait per relay would learn of a death without polling, but a
-- statement waiting on a lock holds its snapshot all along: each watcher would pin the
-- cluster's xmin horizon (VACUUM) for as long as its relay lives (docs/operations.md).
SELECT coalesce((SELECT array_agg(gid) FROM pg_prepared_xacts
                 WHERE database = current_database() AND starts_with(gid, %(prefix)s)),
                '{{}}') AS prepared,
       coalesce((SELECT array_agg(objid::bigint) FROM pg_locks
                 WHERE locktype = 'advisory' AND granted AND objsubid = 2
                   AND classid = %(class)s::oid
                   AND database = (SELECT oid FROM pg_database
                                   WHERE datname = current_database())
                   AND EXISTS (SELECT FROM pg_prepared_xacts
                               WHERE database = current_database()
                                 AND starts_with(gid, %(prefix)s))),
                '{{}}') AS live;

-- name: ledger_key
-- The key that signs ledger records (readable by the relays' role only), and this database's
-- name, which every batch record carries.
SELECT key, current_database() FROM {ledger_key} WHERE singleton;

-- name: key_readers
-- Who else can read the ledger key (ledger_key: the table's quoted name), checked once at
-- start: whoever reads it can sign ledger records that make the resolver commit a batch whose
-- messages were never published. LOGIN roles that can SELECT it themselves, by an inherited
-- membership, through PUBLIC or pg_read_all_data, on the table or on its key column
-- (has_column_privilege counts both), or by SET ROLE to a role it is granted to, or to its
-- owner (pg_has_role MEMBER on each grantee of the table's or the key column's ACL).
-- Left out: this session's role (the relays' and the resolver's), superusers (they read
-- everything), and the table's owner (it can grant itself SELECT at any time: the migrate
-- role of sql/roles.sql, an administrator's). public: whether PUBLIC itself holds SELECT.
-- One has_column_privilege per LOGIN role, once per process.
WITH key AS (
    SELECT c.oid, c.relowner,
           coalesce(c.relacl, acldefault('r', c.relowner)) AS acl
    FROM pg_class c WHERE c.oid = to_regclass(%(ledger_key)s)
), grantees AS (
    SELECT a.grantee FROM key, aclexplode(key.acl) a WHERE a.privilege_type = 'SELECT'
    UNION
    SELECT a.grantee
    FROM key JOIN pg_attribute att ON att.attrelid = key.oid AND att.attname = 'key',
         aclexplode(att.attacl) a
    WHERE a.privilege_type = 'SELECT'
)
SELECT coalesce((SELECT array_agg(r.rolname::text ORDER BY r.rolname)
                 FROM pg_roles r, key
                 WHERE r.rolcanlogin AND NOT r.rolsuper AND r.rolname <> current_user
                   AND r.oid <> key.relowner
                   AND (has_column_privilege(r.oid, key.oid, 'key', 'SELECT')
                        OR EXISTS (SELECT FROM grantees g
                                   WHERE g.grantee <> 0
                                     AND pg_has_role(r.oid, g.grantee, 'MEMBER')))),
                '{{}}') AS roles,
       EXISTS (SELECT FROM grantees WHERE grantee = 0) AS public;

-- name: prepared_of_prefix
-- This database's prepared transactions with our gid prefix (another database's are not ours:
-- COMMIT PREPARED would fail there, and their gids need not even be valid in our encoding).
-- The xid and database are what a batch's ledger record must name. owner_reads_key: whether
-- the preparing role may read the ledger key's key column (ledger_key: its quoted name), as
-- every relay's role must (sql/roles.sql grants the columns, not the table); any role may PREPARE under a gid of our shape, and one that cannot read
-- the key is no relay's (a role dropped since has no name here: false).
SELECT p.gid, p.prepared, p.owner,
       extract(epoch FROM now() - p.prepared)::float8 AS age_seconds,
       p.transaction::text::bigint AS xid, p.database,
       coalesce(has_column_privilege(r.oid, to_regclass(%(ledger_key)s), 'key', 'SELECT'),
                false) AS owner_reads_key
FROM pg_prepared_xacts p LEFT JOIN pg_roles r ON r.rolname = p.owner
WHERE p.database = current_database() AND starts_with(p.gid, %(prefix)s)
ORDER BY p.prepared;

-- name: session_role
-- Who may finish a prepared transaction: the role that prepared it (pg_prepared_xacts.owner is
-- its current_user at PREPARE time) or a superuser; membership in that role is not enough.
SELECT current_user AS role, rolsuper AS superuser FROM pg_roles WHERE rolname = current_user;

-- name: xmin_horizon
-- What holds back VACUUM in this database: for each kind of holder, the oldest transaction id it
-- keeps alive (a running or prepared transaction's own xid, a snapshot's xmin, a replication
-- slot's xmin), as its age in transactions and as the xid itself (as text: the resolver times
-- how long the same xid stays the oldest, which needs no privilege); for prepared transactions,
-- and client sessions' open transactions (from xact_start: a snapshot is never older than its
-- transaction), also in seconds (autovacuum's own snapshots hold back no VACUUM and are not
-- timed; another role's xact_start is NULL without pg_read_all_stats). The database's xmin
-- horizon is the largest of these ages. Sessions in other databases hold back only the shared
-- catalogs here; sessions without a database (walsenders with hot_standby_feedback) hold back
-- every database. pg_stat_activity shows backend_xid and backend_xmin of every role's sessions
-- without extra privileges.
WITH holders AS (
    SELECT CASE WHEN starts_with(gid, %(prefix)s) THEN 'outbox_prepared' ELSE 'other_prepared' END
               AS holder,
           age(transaction) AS xid_age,
           extract(epoch FROM now() - prepared)::float8 AS age_seconds,
           transaction AS xid
    FROM pg_prepared_xacts
    WHERE database = current_database()
    UNION ALL
    SELECT 'session', greatest(age(backend_xid), age(backend_xmin)),
           CASE WHEN backend_type = 'client backend'
                THEN extract(epoch FROM now() - xact_start)::float8 END,
           CASE WHEN backend_xmin IS NULL OR age(backend_xid) > age(backend_xmin)
                THEN backend_xid ELSE backend_xmin END
    FROM pg_stat_activity
    WHERE (datname = current_database() OR datid IS NULL) AND pid <> pg_backend_pid()
      AND coalesce(backend_xid, backend_xmin) IS NOT NULL
    UNION ALL
    SELECT 'replication_slot', age(xmin), NULL, xmin
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL AND (database IS NULL OR database = current_database())
)
SELECT holder, max(xid_age)::bigint AS xid_age, max(age_seconds) AS age_seconds,
       (array_agg(xid::text ORDER BY xid_age DESC))[1] AS oldest_xid
FROM holders
GROUP BY holder;

-- name: prepared_slots
-- The server's prepared transactions, of every database and role, against
-- max_prepared_transactions: the slots are the server's, and once every one is taken each
-- relay's PREPARE TRANSACTION fails (53200, "maximum number of prepared transactions reached")
-- and nothing is published until one is freed. Any role may PREPARE, in any database: another
-- application's two-phase commit, a forgotten test, a hostile role. Shared memory only.
SELECT count(*)::int AS used, current_setting('max_prepared_transactions')::int AS slots
FROM pg_prepared_xacts;

-- name: dead_letter_list
-- `outbox-relay dead-letter list` and `discard`: the oldest dead letters first, with how many
-- match in all. Each filter applies when given, and a NULL one matches every row: the ids, the
-- exchange (equal), the reason (a substring of last_error, in any case), the age (dead_at
-- older or newer than so many seconds). A NULL limit: every matching row.
SELECT id, message_id, exchange, routing_key, attempts, dead_at, last_error,
       count(*) OVER () AS total
FROM {dead_letter}
WHERE (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(exchange)s::text IS NULL OR exchange = %(exchange)s::text)
  AND (%(reason)s::text IS NULL OR strpos(lower(last_error), lower(%(reason)s::text)) > 0)
  AND (%(older_than)s::float8 IS NULL
       OR dead_at < now() - make_interval(secs => %(older_than)s::float8))
  AND (%(newer_than)s::float8 IS NULL
       OR dead_at >= now() - make_interval(secs => %(newer_than)s::float8))
ORDER BY id
LIMIT %(limit)s::bigint;

-- name: dead_letter_discard
-- `outbox-relay dead-letter discard`: delete the dead letters the operator was shown and
-- confirmed (by id: a row that matches the filter only since then is not deleted). A keyed
-- dead letter that goes frees its key: the key's later rows flow again.
DELETE FROM {dead_letter}
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: dead_letter_lock
-- `outbox-relay dead-letter requeue`: lock the chosen rows (all of them, or the given ids) for
-- the transaction that moves them back, in dead-letter order so new outbox ids keep it.
SELECT id, message_id
FROM {dead_letter}
WHERE %(all)s OR id = ANY(%(ids)s)
ORDER BY id
FOR UPDATE;

-- name: dead_letter_requeue
-- Move one locked dead letter back into the outbox as a fresh row: attempts 0, due now, no
-- error; everything the producer wrote is kept. A row with an ordering_key gets its old id
-- back when it is free (the rows of its key that waited behind the dead letter are newer: it
-- goes first, in order); any other row gets a new id. A message_id already in the outbox (or
-- an old id taken meanwhile) leaves it in the dead-letter table (no row returned).
WITH old AS (
    SELECT d.*, d.ordering_key IS NOT NULL AND d.outbox_id IS NOT NULL
                AND NOT EXISTS (SELECT FROM {outbox} AS o WHERE o.id = d.outbox_id) AS in_place
    FROM {dead_letter} AS d
    WHERE d.id = %(id)s
), in_place AS (
    INSERT INTO {outbox} (id, message_id, exchange, routing_key, ordering_key, payload,
                          payload_bytes, headers, content_type, message_type, correlation_id,
                          created_at, attempts, available_at, last_error)
    OVERRIDING SYSTEM VALUE
    SELECT outbox_id, message_id, exchange, routing_key, ordering_key, payload, payload_bytes,
           headers, content_type, message_type, correlation_id, created_at, 0, now(), NULL
    FROM old
    WHERE in_place
    ON CONFLICT DO NOTHING
    RETURNING id
), renumbered AS (
    INSERT INTO {outbox} (message_id, exchange, routing_key, ordering_key, payload, payload_bytes,
                          headers, content_type, message_type, correlation_id, created_at,
                          attempts, available_at, last_error)
    SELECT message_id, exchange, routing_key, ordering_key, payload, payload_bytes, headers,
           content_type, message_type, correlation_id, created_at, 0, now(), NULL
    FROM old
    WHERE NOT in_place
    ON CONFLICT (message_id) DO NOTHING
    RETURNING id
), moved AS (
    SELECT id FROM in_place UNION ALL SELECT id FROM renumbered
)
DELETE FROM {dead_letter}
WHERE id = %(id)s AND EXISTS (SELECT FROM moved)
RETURNING id, (SELECT id FROM moved) AS outbox_id;

-- name: compact_allowed
-- `outbox-relay compact`: may this role REINDEX and CLUSTER the outbox? Its owner (or a member
-- of the owner role) or a superuser may; on PostgreSQL 17 and later also a role granted
-- MAINTAIN on it (the CASE keeps older servers from parsing a privilege they do not know).
-- And may it ALTER the table (put CLUSTER's mark back)? Only the owner or a superuser.
WITH may AS (
    SELECT pg_catalog.pg_has_role(c.relowner, 'USAGE')
           OR (SELECT r.rolsuper FROM pg_catalog.pg_roles AS r WHERE r.rolname = current_user)
           AS alter_table,
           c.oid, c.relowner
    FROM pg_catalog.pg_class AS c
    WHERE c.oid = {outbox_text}::regclass
)
SELECT alter_table
       OR CASE WHEN pg_catalog.current_setting('server_version_num')::integer >= 170000
               THEN pg_catalog.has_table_privilege(oid, 'MAINTAIN') ELSE false END,
       pg_catalog.pg_get_userbyid(relowner),
       alter_table
FROM may;

-- name: compact_indexes
-- `outbox-relay compact`: the outbox's indexes (schema, name) and which is its primary key, which
-- CLUSTER last marked, which are valid. An invalid one named like REINDEX CONCURRENTLY's own
-- (`_ccnew`, `_ccold`, with a number when taken) is what an interrupted one left behind.
SELECT n.nspname, i.relname, x.indisprimary, x.indisclustered,
       NOT x.indisvalid AND i.relname ~ '_cc(new|old)[0-9]*$'
FROM pg_catalog.pg_index AS x
JOIN pg_catalog.pg_class AS i ON i.oid = x.indexrelid
JOIN pg_catalog.pg_namespace AS n ON n.oid = i.relnamespace
WHERE x.indrelid = {outbox_text}::regclass
ORDER BY i.relname;

-- name: table_size
-- `outbox-relay compact`: the outbox's heap (with its TOAST) and indexes in bytes, the dead rows
-- the statistics count, and the live rows VACUUM last counted (reltuples; -1 before any).
SELECT pg_catalog.pg_relation_size(c.oid)
       + coalesce(pg_catalog.pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0),
       pg_catalog.pg_indexes_size(c.oid),
       pg_catalog.pg_stat_get_dead_tuples(c.oid),
       c.reltuples::bigint
FROM pg_catalog.pg_class AS c
WHERE c.oid = {outbox_text}::regclass;
