"""outbox-relay: a transactional outbox relay for PostgreSQL and RabbitMQ (two-phase commit)."""

__version__ = "0.1.0"
