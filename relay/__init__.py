"""The relay program (``outbox-relay``), installed as ``outbox_relay.relay``.

``worker.Relay.run_batch`` is the protocol's five steps, top to bottom; ``store`` is its
PostgreSQL side (steps 1, 2, 5) and ``publisher`` its RabbitMQ side (steps 3, 4).
"""
