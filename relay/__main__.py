"""python -m outbox_relay.relay: the same as the outbox-relay command."""
import sys

from outbox_relay.relay.cli import main

sys.exit(main())
