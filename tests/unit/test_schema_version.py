"""The schema's version: what sql/schema.sql records is what the programs expect, and which
recorded versions a program runs on (the integration side: tests/integration/test_migrate_upgrade.py)."""

from __future__ import annotations

import re

import pytest

from outbox_relay import schema
from outbox_relay.schema import SCHEMA_USABLE_FROM, SCHEMA_VERSION, SchemaVersion, parse_recorded
from tests.conftest import ROOT


def recorded_by_schema_sql() -> str:
    [comment] = re.findall(r"(?m)^COMMENT ON TABLE \"outbox\" IS '([^']*)';$",
                           schema.schema_sql("outbox"))
    return comment


def test_schema_sql_records_the_programs_version() -> None:
    found = parse_recorded("outbox", recorded_by_schema_sql())
    assert (found.version, found.usable_from) == (SCHEMA_VERSION, SCHEMA_USABLE_FROM)
    assert found.problem is None
    assert found.describe() == f"table 'outbox' has schema version {SCHEMA_VERSION} (current)"


def test_schema_sql_refuses_exactly_the_versions_above_its_own() -> None:
    text = schema.schema_sql("outbox")
    assert f"::numeric, 0) > {SCHEMA_VERSION} THEN" in text
    assert f"has a newer schema than '\n            || 'version {SCHEMA_VERSION} (" in text
    assert (ROOT / "sql" / "schema.sql").read_text("utf-8").startswith(
        f"-- outbox-relay schema, version {SCHEMA_VERSION} ")


def test_the_schema_has_no_percent_and_no_colon_word() -> None:
    """It runs through psycopg without parameters, Django's RunSQL and SQLAlchemy's text():
    a ``%`` or a ``:word`` would be read as a parameter by one of them."""
    text = schema.schema_sql("outbox")
    assert "%" not in text
    assert not re.search(r"(?<![:\w]):\w", text)


def with_version(version: int, usable_from: int) -> str:
    return (f"outbox-relay schema version {version}, usable by programs of schema version "
            f"{usable_from} or newer; written by outbox-relay migrate")


@pytest.mark.parametrize(("recorded", "problem"), [
    (None, "records no outbox-relay schema version (made by outbox-relay 0.1.0, or its comment "
           "was changed): run `outbox-relay migrate`"),
    ("the orders outbox", "records no outbox-relay schema version"),
    (with_version(1, 1), f"has schema version 1, this outbox-relay needs version {SCHEMA_VERSION}"
                         ": run `outbox-relay migrate` (upgrade notes: CHANGELOG.md)"),
    (with_version(SCHEMA_VERSION + 1, SCHEMA_VERSION + 1),
     f"has schema version {SCHEMA_VERSION + 1}, usable by programs of schema version "
     f"{SCHEMA_VERSION + 1} or newer; this outbox-relay's is {SCHEMA_VERSION}: upgrade outbox-relay"),
    (with_version(SCHEMA_VERSION + 1, SCHEMA_VERSION), None),
    (with_version(SCHEMA_VERSION, SCHEMA_VERSION), None),
    (with_version(10**12, 1), "records no outbox-relay schema version"),  # not ours: too long
])
def test_which_recorded_versions_a_program_runs_on(recorded: str | None, problem: str | None) -> None:
    found = parse_recorded("outbox", recorded)
    if problem is None:
        assert found.problem is None
    else:
        assert found.problem is not None and problem in found.problem
        assert found.problem.startswith("table 'outbox' ")
        assert "\n" not in found.problem


def test_missing_tables_say_run_migrate() -> None:
    assert SchemaVersion("app.events", exists=False).problem == (
        "table 'app.events' or 'app.events_dead_letter' does not exist: run `outbox-relay "
        "migrate` first")


def test_roles_sql_is_the_packaged_file() -> None:
    assert schema.roles_sql() == (ROOT / "sql" / "roles.sql").read_text("utf-8")


def test_the_drop_script_has_no_percent_and_no_colon_word() -> None:
    text = schema.drop_schema_sql("app.events")
    assert "%" not in text and not re.search(r"(?<![:\w]):\w", text)
    assert 'DROP TABLE IF EXISTS "app"."events_ledger_key", "app"."events_dead_letter", ' \
           '"app"."events";' in text


# -- Alembic's include_object ------------------------------------------------------------------


class Table:
    def __init__(self, name: str, schema: str | None = None) -> None:
        self.name, self.schema = name, schema


class OnTable:
    """A column, index or constraint: it names its table."""

    def __init__(self, table: Table) -> None:
        self.table = table


def test_include_object_leaves_out_the_tables_outbox_relay_owns() -> None:
    from outbox_relay.alembic import include_object, include_object_for, owned_tables

    for name in ("outbox", "outbox_dead_letter", "outbox_ledger_key", "inbox", "inbox_keys"):
        assert not include_object(Table(name), name, "table", True, None), name
        assert not include_object(OnTable(Table(name)), "ix", "index", True, None), name
    for name in ("orders", "outbox_archive"):
        assert include_object(Table(name), name, "table", True, None)
    # outbox is the default schema's: another schema's table of that name is the service's.
    assert include_object(Table("outbox", "billing"), "outbox", "table", True, None)
    assert include_object(object(), "x", "schema", True, None)  # no table: not ours to judge

    hook = include_object_for(outbox=["billing.events"], inbox=[])
    assert not hook(Table("events_dead_letter", "billing"), "events_dead_letter", "table", True,
                    None)
    assert hook(Table("events_dead_letter"), "events_dead_letter", "table", True, None)
    assert hook(Table("inbox"), "inbox", "table", True, None)
    assert owned_tables(["a"], ["b.c"]) == {(None, "a"), (None, "a_dead_letter"),
                                            (None, "a_ledger_key"), ("b", "c"), ("b", "c_keys")}
    with pytest.raises(ValueError, match="must be a table name"):
        include_object_for(outbox=['x"; DROP'])
