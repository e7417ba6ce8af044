"""The HTTP endpoint of both programs: /metrics, /healthz and /readyz on one port, served from a
daemon thread."""

from __future__ import annotations

import json
import socket
import threading
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from outbox_relay.errors import ConfigError
from outbox_relay.runtime.health import Health

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment
    from _typeshed.wsgi import WSGIApplication as WSGIApp

# Seconds a client of the metrics port may take to send its request or read the answer: a
# stuck or malicious client holds one thread for at most this long, never the port.
CONNECTION_TIMEOUT = 10.0


def serve(registry: CollectorRegistry, host: str, port: int,
          health: Health | None = None) -> WSGIServer | None:
    """Serve /metrics (prometheus_client's own WSGI app: content negotiation, ``name[]``, gzip)
    and, given ``health``, /healthz and /readyz, from a daemon thread.

    Port 0 disables it. Returns the server (tests shut it down), or None when disabled.
    """
    if not port:
        return None
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]

        class Server(_Server):
            address_family = family  # IPv4 or IPv6, whichever the host is

        server: WSGIServer = make_server(host, port, app(registry, health), Server, _Handler)
    except OSError as exc:
        raise ConfigError(
            f"OUTBOX_METRICS_PORT {port} on {host!r} cannot be served: {exc.strerror}") from exc
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server


def app(registry: CollectorRegistry, health: Health | None) -> WSGIApp:
    """The WSGI application: /metrics, /healthz and /readyz, 404 elsewhere."""
    metrics_app = make_wsgi_app(registry)

    def application(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if health is not None and path in ("/healthz", "/readyz"):
            if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
                return _answer(start_response, "405 Method Not Allowed", "text/plain; charset=utf-8",
                               b"use GET\n", [("Allow", "GET, HEAD")])
            if path == "/healthz":
                live, detail = health.liveness()
                return _answer(start_response, "200 OK" if live else "503 Service Unavailable",
                               "text/plain; charset=utf-8", (detail + "\n").encode())
            ready, checks = health.readiness()
            body = json.dumps({"ready": ready, "checks": checks}, sort_keys=True) + "\n"
            return _answer(start_response, "200 OK" if ready else "503 Service Unavailable",
                           "application/json", body.encode())
        return _answer(start_response, "404 Not Found", "text/plain; charset=utf-8",
                       b"not found: try /metrics\n")

    return application


def _answer(start_response: StartResponse, status: str, content_type: str, body: bytes,
            headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))),
                            *(headers or [])])
    return [body]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck client never keeps the program from exiting

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is not worth a traceback on stderr."""


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not worth a log line each."""
