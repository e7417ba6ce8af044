"""Fixture: loopback TCP proxies (devenv/proxy.py) that a test can cut, black-hole or refuse."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devenv.proxy import Proxy


class ProxyFactory:
    """Proxies made by one test, all closed at its end."""

    def __init__(self) -> None:
        self.proxies: list[Proxy] = []

    def __call__(self, url: str) -> Proxy:
        proxy = Proxy.to(url)
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()


@pytest.fixture
def proxies() -> Iterator[ProxyFactory]:
    factory = ProxyFactory()
    try:
        yield factory
    finally:
        factory.close()
