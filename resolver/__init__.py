"""The resolver program (``outbox-resolver``), installed as ``outbox_relay.resolver``: it
finishes the prepared batches of relays that are gone, from what the ledger says."""
