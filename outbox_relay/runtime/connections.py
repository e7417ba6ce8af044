"""Connection events of both programs: a lost connection is logged once, a connection back is
logged and counted (``*_reconnects_total{server}``)."""

from __future__ import annotations

import logging

from prometheus_client import Counter


class ConnectionEvents:
    """Per server (``postgresql``, ``rabbitmq``): first connection, loss, reconnection."""

    def __init__(self, log: logging.Logger, reconnects: Counter) -> None:
        self._log = log
        self._reconnects = reconnects
        self._ever_connected: set[str] = set()
        self._down: set[str] = set()
        self._failing: set[str] = set()

    def down(self, server: str) -> None:
        """Log a lost connection once, not at every reconnection attempt."""
        if server in self._down:
            return
        self._down.add(server)
        if server in self._ever_connected:
            self._log.warning("%s connection lost; reconnecting", server,
                              extra={"action": "disconnected", "server": server})

    def failed(self, server: str, error: BaseException | None) -> None:
        """A connection attempt failed: say why once per outage (a wrong password, an untrusted
        certificate and a server that is down all look alike otherwise), then only at DEBUG."""
        if server not in self._failing:
            self._failing.add(server)
            self._log.warning("connecting to %s failed, retrying: %s", server, error,
                              extra={"action": "connect_failed", "server": server})
        else:
            self._log.debug("reconnect to %s failed: %s", server, error,
                            extra={"action": "reconnect_failed", "server": server})

    def up(self, server: str) -> None:
        self._down.discard(server)
        self._failing.discard(server)
        if server in self._ever_connected:
            self._reconnects.labels(server).inc()
            self._log.info("%s reconnected", server,
                           extra={"action": "reconnected", "server": server})
        else:
            self._ever_connected.add(server)
            self._log.info("%s connected", server, extra={"action": "connected", "server": server})
