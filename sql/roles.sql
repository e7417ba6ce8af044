-- outbox-relay: least-privilege roles. Plain SQL for psql, idempotent (run it again after a
-- schema change, or with another table).
--
-- Run it as a superuser, in the service's database, once the tables exist:
--
--   OUTBOX_DATABASE_URL="$ADMIN_URL" outbox-relay migrate     # or: migrate --print | psql
--   psql "$ADMIN_URL" -v table=outbox -v roles=outbox -f sql/roles.sql
--
-- Variables (-v): table, the outbox table as in OUTBOX_TABLE ([schema.]name; default outbox),
-- and roles, the prefix of the role names (default outbox). It creates:
--
--   <roles>_migrate   LOGIN    owns the three tables, may create in their schema: runs
--                              `outbox-relay migrate` from now on
--   <roles>_relay     LOGIN    the relay AND the resolver: COMMIT/ROLLBACK PREPARED is allowed
--                              only to the role that prepared the transaction (or a superuser),
--                              so the resolver must log in as the relays' role. The only role
--                              that reads the ledger key (<table>_ledger_key): a ledger record
--                              is believed only if it was signed with it.
--   <roles>_operator  LOGIN    `outbox-relay dead-letter list|requeue`
--   <roles>_producer  NOLOGIN  INSERT into the outbox (the producer's columns only):
--                              GRANT <roles>_producer TO your service
--
-- Passwords are not set here: `\password <role>` in psql, or ALTER ROLE ... PASSWORD from your
-- secret store. tests/integration/test_roles.py runs both programs and the operator command as
-- exactly these roles.

\set ON_ERROR_STOP on
\if :{?table}
\else
    \set table outbox
\endif
\if :{?roles}
\else
    \set roles outbox
\endif

SELECT set_config('outbox_roles.table', :'table', false) AS table_setting,
       set_config('outbox_roles.prefix', :'roles', false) AS roles_setting \gset

DO $roles$
DECLARE
    parts text[] := string_to_array(current_setting('outbox_roles.table'), '.');
    prefix text := current_setting('outbox_roles.prefix');
    nsp text := CASE WHEN cardinality(parts) = 2 THEN parts[1] ELSE current_schema() END;
    name text := parts[cardinality(parts)];
    outbox text := format('%I.%I', nsp, name);
    dead_letter text := format('%I.%I', nsp, name || '_dead_letter');
    ledger_key text := format('%I.%I', nsp, name || '_ledger_key');
    migrate_role text := prefix || '_migrate';
    relay_role text := prefix || '_relay';
    operator_role text := prefix || '_operator';
    producer_role text := prefix || '_producer';
    role text;
BEGIN
    IF to_regclass(outbox) IS NULL OR to_regclass(dead_letter) IS NULL
            OR to_regclass(ledger_key) IS NULL THEN
        RAISE EXCEPTION '%, % or % does not exist: run `outbox-relay migrate` first', outbox,
            dead_letter, ledger_key;
    END IF;
    FOREACH role IN ARRAY ARRAY[migrate_role, relay_role, operator_role] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role) THEN
            EXECUTE format('CREATE ROLE %I LOGIN', role);
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = producer_role) THEN
        EXECUTE format('CREATE ROLE %I NOLOGIN', producer_role);
    END IF;

    -- migrate: owns the tables (and their identity sequences with them).
    EXECUTE format('GRANT USAGE, CREATE ON SCHEMA %I TO %I', nsp, migrate_role);
    EXECUTE format('ALTER TABLE %s OWNER TO %I', outbox, migrate_role);
    EXECUTE format('ALTER TABLE %s OWNER TO %I', dead_letter, migrate_role);
    EXECUTE format('ALTER TABLE %s OWNER TO %I', ledger_key, migrate_role);

    -- relay and resolver: claim (SELECT ... FOR UPDATE, DELETE ... RETURNING), count failed
    -- attempts (UPDATE), the lag and backlog (SELECT), dead-letter rows (INSERT; RETURNING
    -- outbox_id needs SELECT on that column; the claim reads ordering_key there, as a key with
    -- a dead letter is held back), sign and check ledger records (SELECT on the key).
    -- Everything else they read (pg_prepared_xacts, pg_stat_activity, pg_replication_slots,
    -- settings) and do (PREPARE TRANSACTION, advisory locks) needs no grant.
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', nsp, relay_role);
    EXECUTE format('GRANT SELECT, UPDATE, DELETE ON %s TO %I', outbox, relay_role);
    EXECUTE format('GRANT INSERT, SELECT (outbox_id, ordering_key) ON %s TO %I', dead_letter,
                   relay_role);
    EXECUTE format('GRANT SELECT ON %s TO %I', ledger_key, relay_role);
    -- The key is the relays' secret: nobody else reads it (a superuser always can).
    FOREACH role IN ARRAY ARRAY[operator_role, producer_role] LOOP
        EXECUTE format('REVOKE ALL ON %s FROM %I', ledger_key, role);
    END LOOP;

    -- operator: list dead letters (SELECT), fix them in place if need be (UPDATE; requeue's
    -- SELECT ... FOR UPDATE needs it too) and requeue them (DELETE; INSERT into the outbox ... ON
    -- CONFLICT (message_id) DO NOTHING RETURNING id: SELECT on those two columns, not on payloads).
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', nsp, operator_role);
    EXECUTE format('GRANT SELECT, UPDATE, DELETE ON %s TO %I', dead_letter, operator_role);
    EXECUTE format('GRANT INSERT, SELECT (id, message_id) ON %s TO %I', outbox, operator_role);

    -- producers: a plain INSERT of the producer's columns. id, created_at, attempts and
    -- last_error are the relay's: a producer cannot set them (no OVERRIDING SYSTEM VALUE, no
    -- 'infinity' created_at, no negative attempts).
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', nsp, producer_role);
    EXECUTE format('REVOKE INSERT ON %s FROM %I', outbox, producer_role);
    EXECUTE format('GRANT INSERT (message_id, exchange, routing_key, ordering_key, payload, '
                   'payload_bytes, headers, content_type, available_at) ON %s TO %I',
                   outbox, producer_role);
END
$roles$;
