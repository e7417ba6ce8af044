"""python -m outbox_relay.resolver: the same as the outbox-resolver command."""
import sys

from outbox_relay.resolver.cli import main

sys.exit(main())
