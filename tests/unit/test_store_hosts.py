"""Which other hosts of a libpq multi-host URL the start-up check visits (outbox_relay.relay.store)."""

from __future__ import annotations

import socket
from typing import Any

from outbox_relay.postgres import check_standbys, other_hosts


class On:
    """A connection's info: the host and port it is on."""

    def __init__(self, host: str, port: int) -> None:
        self.info = type("Info", (), {"host": host, "port": port})()


def hosts(url: str, host: str, port: int) -> list[tuple[str, int]]:
    conn: Any = On(host, port)
    return other_hosts(url, conn)


def test_each_host_with_its_own_port_but_the_one_connected_to() -> None:
    url = "postgresql://u:secret@a:5433,b:5434,c:5435/db?target_session_attrs=read-write"
    assert hosts(url, "b", 5434) == [("a", 5433), ("c", 5435)]


def test_one_port_is_every_hosts_and_none_is_5432() -> None:
    assert hosts("host=a,b port=6000 dbname=db", "a", 6000) == [("b", 6000)]
    assert hosts("postgresql://a,b/db", "b", 5432) == [("a", 5432)]


def test_a_single_host_has_no_other() -> None:
    assert hosts("postgresql://u@a:5433/db", "a", 5433) == []


class Primary(On):
    """The primary's session: answers the one query check_standbys asks it, or none."""

    def __init__(self, host: str, port: int, *, queried: bool = True) -> None:
        super().__init__(host, port)
        self.queried = queried

    def execute(self, query: str) -> Any:
        assert self.queried, f"a single-host URL must cost nothing: {query}"
        return type("Cursor", (), {"fetchone": lambda _self: (64,)})()


def test_a_single_host_url_is_not_checked() -> None:
    conn: Any = Primary("a", 5432, queried=False)
    assert check_standbys("postgresql://u:secret@a/db", conn, 1.0) == []


def test_an_unreachable_host_is_a_warning_without_the_password() -> None:
    # Bound but not listening: the connection is refused at once (no timeout to wait).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        conn: Any = Primary("127.0.0.1", 1)
        url = f"postgresql://u:secret@127.0.0.1:1,127.0.0.1:{port}/db"
        warnings = check_standbys(url, conn, 1.0)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"standby 127.0.0.1:{port} not checked: "), warnings
    assert "secret" not in warnings[0]
