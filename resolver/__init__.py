"""outbox-resolver: finishes prepared batches whose relay is gone, from what the ledger says."""
