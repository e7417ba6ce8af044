"""The generated reference docs are what the code declares: run ``./dev docs`` after changing a
setting (outbox_relay/runtime/options.py) or a metric (relay/metrics.py), and commit the result."""

from __future__ import annotations

from pathlib import Path

import pytest

from devenv import reference
from outbox_relay.runtime import options


@pytest.mark.parametrize("path", sorted(reference.generated()), ids=lambda p: p.name)
def test_committed_reference_equals_the_generated_one(path: Path) -> None:
    assert path.read_text("utf-8") == reference.generated()[path], (
        f"{path.name} is out of date: run ./dev docs")


def test_every_setting_of_every_command_has_a_row() -> None:
    text = reference.configuration_md()
    for _command, declared in reference.COMMANDS:
        for option in declared:
            assert f"| `{option.env}` (`{option.flag}`)" in text, option.env
    assert "`9460` (relay) / `9461` (resolver)" in text
    for option in (options.DATABASE_URL, options.AMQP_URL):
        assert f"or `{option.env}_FILE` |" in text
