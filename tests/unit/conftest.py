"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

from tests.unit.relay_rig import Rig, make_rig


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    """A relay on the fakes with the default settings, connected, its journal empty."""
    return make_rig(monkeypatch)
