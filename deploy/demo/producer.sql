-- Named queries of the demo producer (deploy/demo/producer.py). {outbox} is the outbox table,
-- composed with psycopg.sql; %(x)s are bind parameters.

-- name: insert_event
-- What any service does, in any language, in the same transaction as its own change: one plain
-- INSERT. message_id (the dedup key), created_at and available_at take their defaults.
INSERT INTO {outbox} (exchange, routing_key, ordering_key, payload)
VALUES (%(exchange)s, %(routing_key)s, %(ordering_key)s, %(payload)s);
