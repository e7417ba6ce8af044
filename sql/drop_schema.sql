-- outbox-relay: undo sql/schema.sql, for the downgrade of an Alembic or Django migration that
-- applied it (outbox_relay.schema.drop_schema_sql). Drops the outbox, dead-letter and ledger-key
-- tables, and refuses while the outbox or the dead-letter table holds a row: those are events
-- not delivered yet, or given up on and not looked at yet (deliver, requeue or discard them
-- first). Idempotent: tables already gone are not an error.

DO $drop$
BEGIN
    IF to_regclass({outbox_text}) IS NOT NULL THEN
        IF EXISTS (SELECT FROM {outbox}) THEN
            RAISE EXCEPTION USING MESSAGE = 'table ' || {outbox_text} || ' holds events not '
                || 'delivered yet: not dropped';
        END IF;
    END IF;
    IF to_regclass({dead_letter_text}) IS NOT NULL THEN
        IF EXISTS (SELECT FROM {dead_letter}) THEN
            RAISE EXCEPTION USING MESSAGE = 'table ' || {dead_letter_text} || ' holds dead '
                || 'letters: not dropped (outbox-relay dead-letter list, requeue or discard)';
        END IF;
    END IF;
END
$drop$;

DROP TABLE IF EXISTS {ledger_key}, {dead_letter}, {outbox};
