"""libpq TCP defaults: a silent partition is noticed in seconds, and the URL has the last word."""

from __future__ import annotations

from outbox_relay.postgres import TCP_DEFAULTS, connection_options


def test_tcp_defaults_apply_to_a_host_url() -> None:
    assert connection_options("postgresql://relay@db:5432/app") == TCP_DEFAULTS


def test_the_url_overrides_a_default() -> None:
    options = connection_options("postgresql://relay@db/app?keepalives_idle=60&tcp_user_timeout=0")
    assert "keepalives_idle" not in options and "tcp_user_timeout" not in options
    assert options["keepalives_count"] == TCP_DEFAULTS["keepalives_count"]


def test_a_unix_socket_gets_no_tcp_options() -> None:
    assert connection_options("postgresql:///app?host=/var/run/postgresql") == {}
