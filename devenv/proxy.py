"""A loopback TCP proxy for network faults: the tests (tests/fix_proxy.py) and the chaos run.

One thread runs a selector over the listening socket and every forwarded connection, so the
controls act on all connections at once and ``close()`` leaves no thread behind:

- ``cut()``: close every current connection (both sides) at once; new ones are still accepted.
- ``blackhole()``: stop forwarding in both directions; current connections stay open, new ones
  are accepted and never answered (the bytes sit in the kernel buffers, as in a partition).
- ``heal()``: forward normally again. Connections black-holed meanwhile are dropped (the
  default, like a NAT that forgot them) or, with ``drop=False``, resume where they stopped.
- ``refuse()``: close the listening socket, so connects are refused; ``heal()`` listens again
  on the same port.
- ``close()``: everything closed, thread joined.

Only loopback addresses are accepted, for both the listening side and the target.
"""

from __future__ import annotations

import contextlib
import ipaddress
import selectors
import socket
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

LOOPBACK = "127.0.0.1"
_CHUNK = 65536


def _check_loopback(host: str) -> None:
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError) as exc:
        raise ValueError(f"not a loopback address: {host!r}") from exc
    if not address.is_loopback:
        raise ValueError(f"not a loopback address: {host!r}")


class _Pair:
    """One proxied connection: the client's socket and (once connected) the target's."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.held = False  # black-holed: registered for nothing, buffers left in the kernel

    def sockets(self) -> list[socket.socket]:
        return [s for s in (self.client, self.upstream) if s is not None]


class Proxy:
    """Forwards 127.0.0.1:<port> to ``target_host:target_port``, with fault controls."""

    def __init__(self, target_host: str, target_port: int, *, port: int = 0) -> None:
        _check_loopback(target_host)
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pairs: list[_Pair] = []
        self._mode = "forward"  # or "blackhole"
        self._commands: list[tuple[str, Any]] = []
        self._done: list[threading.Event] = []
        self._stopping = False
        self.accepted = 0
        self._listener: socket.socket | None = None
        self.port = self._listen(port)
        self._thread = threading.Thread(target=self._run, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()

    # -- public controls (thread-safe; each returns once the proxy thread has applied it) ---

    @classmethod
    def to(cls, url: str) -> Proxy:
        """A proxy in front of the server of ``url`` (postgresql:// or amqp://)."""
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError("the URL needs a host and a port")
        return cls(parts.hostname, parts.port)

    @property
    def address(self) -> tuple[str, int]:
        return (LOOPBACK, self.port)

    def url(self, url: str) -> str:
        """``url`` with its host:port replaced by the proxy's (user info kept)."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{LOOPBACK}:{self.port}" if userinfo else f"{LOOPBACK}:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def cut(self) -> None:
        self._command("cut")

    def blackhole(self) -> None:
        self._command("blackhole")

    def heal(self, *, drop: bool = True) -> None:
        self._command("heal", drop)

    def refuse(self) -> None:
        self._command("refuse")

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with self._lock:
            self._stopping = True
        self._wake()
        self._thread.join(10)
        assert not self._thread.is_alive(), "proxy thread did not stop"

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the proxy thread ---------------------------------------------------------------------

    def _command(self, name: str, arg: Any = None) -> None:
        done = threading.Event()
        with self._lock:
            if self._stopping:
                raise RuntimeError("proxy closed")
            self._commands.append((name, arg))
            self._done.append(done)
        self._wake()
        if not done.wait(10):
            raise RuntimeError(f"proxy did not apply {name!r}")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _listen(self, port: int) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "listen")
        return int(listener.getsockname()[1])

    def _unlisten(self) -> None:
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    stopping = self._stopping
                    commands, self._commands = self._commands, []
                    done, self._done = self._done, []
                if stopping:
                    break
                for name, arg in commands:
                    self._apply(name, arg)
                for event in done:
                    event.set()
                for key, _mask in self._selector.select(timeout=0.5):
                    if key.data is None:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif key.data == "listen":
                        self._accept()
                    else:
                        self._forward(*key.data)
        finally:
            self._unlisten()
            for pair in list(self._pairs):
                self._drop(pair)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()
            with self._lock:
                for event in self._done:
                    event.set()

    def _apply(self, name: str, arg: Any) -> None:
        if name == "cut":
            for pair in list(self._pairs):
                self._drop(pair)
        elif name == "blackhole":
            self._mode = "blackhole"
            for pair in self._pairs:
                self._hold(pair)
        elif name == "heal":
            self._mode = "forward"
            if self._listener is None:
                self._listen(self.port)
            for pair in list(self._pairs):
                if not pair.held:
                    continue
                if arg:  # drop what was black-holed
                    self._drop(pair)
                    continue
                pair.held = False
                if pair.upstream is None and not self._connect_upstream(pair):
                    continue
                self._watch(pair)
        elif name == "refuse":
            self._unlisten()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            client, _addr = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self.accepted += 1
        client.setblocking(False)
        _no_delay(client)
        pair = _Pair(client)
        with self._lock:
            self._pairs.append(pair)
        if self._mode == "blackhole":
            pair.held = True  # accepted, never answered
            return
        if self._connect_upstream(pair):
            self._watch(pair)

    def _connect_upstream(self, pair: _Pair) -> bool:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            self._drop(pair)
            return False
        upstream.setblocking(False)
        _no_delay(upstream)
        pair.upstream = upstream
        return True

    def _watch(self, pair: _Pair) -> None:
        assert pair.upstream is not None
        self._selector.register(pair.client, selectors.EVENT_READ, (pair, pair.upstream))
        self._selector.register(pair.upstream, selectors.EVENT_READ, (pair, pair.client))

    def _hold(self, pair: _Pair) -> None:
        if pair.held:
            return
        pair.held = True
        for sock in pair.sockets():
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)

    def _drop(self, pair: _Pair) -> None:
        for sock in pair.sockets():
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()
        with self._lock:
            if pair in self._pairs:
                self._pairs.remove(pair)

    def _forward(self, pair: _Pair, destination: socket.socket) -> None:
        source = pair.upstream if destination is pair.client else pair.client
        assert source is not None
        try:
            data = source.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(pair)
            return
        try:
            # Loopback peers read fast; a short blocking send keeps the bytes in order.
            destination.setblocking(True)
            destination.settimeout(5)
            destination.sendall(data)
            destination.setblocking(False)
        except OSError:
            self._drop(pair)


def _no_delay(sock: socket.socket) -> None:
    """Forward each chunk at once, as the peers' own sockets do (psycopg's libpq and pika set
    TCP_NODELAY): with Nagle's algorithm on the proxy's sockets, a small write waits for the
    ACK of the last one, which the peer delays by up to 40 ms, several times per batch."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
