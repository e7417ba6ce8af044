-- outbox-relay: least-privilege roles. Plain SQL for psql, idempotent (run it again after a
-- schema change, or with another table).
--
-- Run it as a superuser (or, on a managed PostgreSQL, as its admin role: see
-- docs/managed-postgresql.md), in the service's database, once the tables exist:
--
--   OUTBOX_DATABASE_URL="$ADMIN_URL" outbox-relay migrate     # or: migrate --print | psql
--   psql "$ADMIN_URL" -v table=outbox -v roles=outbox -f sql/roles.sql
--
-- Variables (-v): table, the outbox table as in OUTBOX_TABLE ([schema.]name; default outbox),
-- roles, the prefix of the role names (default outbox), and public_create: revoke (the
-- default) or keep (see below). It creates:
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
-- Each run sets these roles' privileges on the three tables to exactly what is granted below
-- (REVOKE ALL first): a run after an upgrade also takes back what an older version granted.
--
-- It also revokes CREATE on schema public (and on the outbox's schema) from PUBLIC, which
-- PostgreSQL 13 and 14 grant: whatever a role creates there can run as any role whose
-- search_path names the schema (every role's, by default). The relays and the resolver pin
-- their own search_path and are not affected; your services and psql sessions are. Roles that
-- create objects there and own neither the schema nor the database need their own GRANT
-- CREATE afterwards; -v public_create=keep leaves PUBLIC's grant alone.
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
\if :{?public_create}
\else
    \set public_create revoke
\endif

-- The schema an unqualified table is in is read under this session's own search_path; then
-- the path is pinned to pg_catalog (as the programs do, outbox_relay/postgres.py): this runs
-- as a superuser, and format(text, text, text) created in a writable public would otherwise
-- beat pg_catalog's format(text, VARIADIC "any").
SELECT pg_catalog.set_config('outbox_roles.table', :'table', false) AS table_setting,
       pg_catalog.set_config('outbox_roles.prefix', :'roles', false) AS roles_setting,
       pg_catalog.set_config('outbox_roles.public_create', :'public_create', false)
           AS public_create_setting,
       pg_catalog.set_config('outbox_roles.schema',
                             coalesce(pg_catalog.current_schema()::pg_catalog.text, ''), false)
           AS schema_setting \gset
SET search_path = pg_catalog, pg_temp;

DO $roles$
DECLARE
    parts text[] := string_to_array(current_setting('outbox_roles.table'), '.');
    prefix text := current_setting('outbox_roles.prefix');
    public_create text := current_setting('outbox_roles.public_create');
    nsp text := CASE WHEN cardinality(parts) = 2 THEN parts[1]
                     ELSE nullif(current_setting('outbox_roles.schema'), '') END;
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
    IF public_create NOT IN ('revoke', 'keep') THEN
        RAISE EXCEPTION 'public_create must be revoke or keep, not %', public_create;
    END IF;
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

    -- migrate: owns the tables (and their identity sequences with them). A role that is no
    -- superuser (a managed service's admin: RDS, Aurora, Cloud SQL, Azure) may hand a table to
    -- another role only as a member of it ("must be member of role" on 15, "must be able to SET
    -- ROLE" from 16): it makes itself one first (as CREATEROLE, it has ADMIN on the roles it
    -- created).
    IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
            AND NOT pg_has_role(current_user, migrate_role, 'USAGE') THEN
        EXECUTE format('GRANT %I TO %I', migrate_role, current_user);
    END IF;
    EXECUTE format('GRANT USAGE, CREATE ON SCHEMA %I TO %I', nsp, migrate_role);
    EXECUTE format('ALTER TABLE %s OWNER TO %I', outbox, migrate_role);
    EXECUTE format('ALTER TABLE %s OWNER TO %I', dead_letter, migrate_role);
    EXECUTE format('ALTER TABLE %s OWNER TO %I', ledger_key, migrate_role);

    -- Exactly what is granted below, nothing an older version granted (one transaction: a
    -- program running meanwhile never sees the privileges gone).
    FOREACH role IN ARRAY ARRAY[relay_role, operator_role, producer_role] LOOP
        EXECUTE format('REVOKE ALL ON %s, %s, %s FROM %I', outbox, dead_letter, ledger_key,
                       role);
    END LOOP;

    -- relay and resolver: claim (SELECT ... FOR UPDATE, which takes UPDATE on a column, and
    -- DELETE ... RETURNING *), count failed attempts (UPDATE of attempts, available_at and
    -- last_error: queries.sql, record_failures; nothing else of a row is ever changed), the lag
    -- and backlog (SELECT), dead-letter rows (INSERT of every column but the dead letter's own
    -- id and dead_at; the claim reads ordering_key there, as a key with a dead letter is held
    -- back, and RETURNING outbox_id needs SELECT on that column), sign and check ledger
    -- records (SELECT of the key). Everything else they read (pg_prepared_xacts,
    -- pg_stat_activity, pg_replication_slots, settings) and do (PREPARE TRANSACTION, advisory
    -- locks) needs no grant.
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', nsp, relay_role);
    EXECUTE format('GRANT SELECT, DELETE, UPDATE (attempts, available_at, last_error) ON %s '
                   'TO %I', outbox, relay_role);
    EXECUTE format('GRANT INSERT (outbox_id, message_id, exchange, routing_key, ordering_key, '
                   'payload, payload_bytes, headers, content_type, message_type, '
                   'correlation_id, created_at, attempts, last_error), '
                   'SELECT (outbox_id, ordering_key) ON %s TO %I', dead_letter, relay_role);
    -- The key is the relays' secret: nobody else reads it (a superuser always can).
    EXECUTE format('GRANT SELECT (singleton, key) ON %s TO %I', ledger_key, relay_role);
    -- PostgreSQL 17 and later: MAINTAIN on the outbox, so that the resolver compacts it once a
    -- held snapshot has ended (VACUUM FULL: resolver/compaction.py). Before 17 only the owner
    -- may, and `outbox-relay compact` is run as the migrate role instead.
    IF pg_catalog.current_setting('server_version_num')::integer >= 170000 THEN
        EXECUTE format('GRANT MAINTAIN ON %s TO %I', outbox, relay_role);
    END IF;

    -- operator: list dead letters (SELECT), requeue them (DELETE; requeue's SELECT ... FOR
    -- UPDATE takes UPDATE on a column; INSERT into the outbox, its own id kept for a keyed row,
    -- ... ON CONFLICT (message_id) DO NOTHING RETURNING id: SELECT on those two columns, not
    -- on payloads), and fix what a dead letter would be published with, in place, if need be
    -- (UPDATE of the message's columns; not of its identity: id, outbox_id, which requeue
    -- gives a keyed row back as its outbox id, and message_id, the consumers' dedup key; nor of
    -- attempts, last_error or dead_at, the record of what happened).
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', nsp, operator_role);
    EXECUTE format('GRANT SELECT, DELETE, UPDATE (exchange, routing_key, ordering_key, payload, '
                   'payload_bytes, headers, content_type, message_type, correlation_id, '
                   'created_at) ON %s TO %I', dead_letter, operator_role);
    EXECUTE format('GRANT INSERT, SELECT (id, message_id) ON %s TO %I', outbox, operator_role);

    -- producers: a plain INSERT of the producer's columns. id, created_at, attempts and
    -- last_error are the relay's: a producer cannot set them (no OVERRIDING SYSTEM VALUE, no
    -- 'infinity' created_at, no negative attempts).
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', nsp, producer_role);
    EXECUTE format('GRANT INSERT (message_id, exchange, routing_key, ordering_key, payload, '
                   'payload_bytes, headers, content_type, message_type, correlation_id, '
                   'available_at) ON %s TO %I', outbox, producer_role);

    -- Nobody but the owners creates in public or in the outbox's schema (above).
    IF public_create = 'revoke' THEN
        FOREACH role IN ARRAY ARRAY['public', nsp] LOOP
            IF EXISTS (SELECT FROM pg_namespace WHERE nspname = role) THEN
                EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', role);
            END IF;
        END LOOP;
    END IF;
END
$roles$;
