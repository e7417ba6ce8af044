"""The schema through the services' own migration tools, against the real PostgreSQL (issue 34):
Alembic's autogenerate proposes to drop the outbox, dead-letter, ledger-key and inbox tables
unless ``outbox_relay.alembic.include_object`` leaves them out, and a migration of
docs/python-api.md upgrades and downgrades; the Django migration of docs/python-api.md runs
forwards and backwards, and its downgrade is refused while an event waits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from psycopg import sql

from outbox_relay.alembic import include_object_for
from outbox_relay.schema import SCHEMA_VERSION, schema_version
from outbox_relay.tables import Tables
from tests.conftest import ROOT, Env

DOCS = (ROOT / "docs" / "python-api.md").read_text("utf-8")

ENV_PY = '''
from alembic import context

config = context.config
with config.attributes["engine"].connect() as connection:
    context.configure(connection=connection, target_metadata=config.attributes["metadata"],
                      include_object=config.attributes["include_object"],
                      version_table=config.attributes["version_table"])
    with context.begin_transaction():
        context.run_migrations()
'''


def tables_there(env: Env, *names: str) -> list[bool]:
    with env.connect() as conn:
        return [conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                             (sql.Identifier(name).as_string(None),)).fetchone() == (True,)
                for name in names]


def docs_block(after: str) -> str:
    """The first Python block of docs/python-api.md after the line ``after``."""
    rest = DOCS.split(after, 1)[1]
    return rest.split("```python\n", 1)[1].split("```", 1)[0]


def alembic_config(tmp_path: Path, env: Env, metadata: sa.MetaData, hook: Any) -> Config:
    config = Config(str(tmp_path / "alembic.ini"))
    command.init(config, str(tmp_path / "migrations"))
    (tmp_path / "migrations" / "env.py").write_text(ENV_PY)
    config.attributes.update(
        engine=sa.create_engine(env.db_url.replace("postgresql://", "postgresql+psycopg://", 1),
                                poolclass=sa.pool.NullPool),
        metadata=metadata, include_object=hook, version_table=f"alembic_version_{env.gid_prefix}")
    return config


def test_alembic_autogenerate_leaves_the_outbox_tables_alone_with_the_filter(
        env: Env, tmp_path: Path) -> None:
    outbox, inbox = f"alembic_{env.gid_prefix}", f"inbox_{env.gid_prefix}"
    owned = [outbox, f"{outbox}_dead_letter", f"{outbox}_ledger_key", inbox, f"{inbox}_keys"]
    # The service's own model: a table autogenerate must still propose to create.
    metadata = sa.MetaData()
    sa.Table(f"orders_{env.gid_prefix}", metadata, sa.Column("id", sa.Integer, primary_key=True))
    config = alembic_config(tmp_path, env, metadata,
                            include_object_for(outbox=[outbox], inbox=[inbox]))
    # The migration of docs/python-api.md, for this test's table; the inbox's tables too.
    migration = docs_block("Alembic: a migration that applies it").split("# migrations/env.py")[0]
    migration = migration.replace('"outbox"', repr(outbox)).replace(
        "    op.execute(outbox_relay.schema_sql(", f"    op.execute(outbox_relay.inbox_schema_sql("
        f"{inbox!r}))\n    op.execute(outbox_relay.schema_sql(").replace(
        "    op.execute(drop_schema_sql(", f"    op.execute('DROP TABLE {inbox}_keys, {inbox}')\n"
        "    op.execute(drop_schema_sql(")
    (tmp_path / "migrations" / "versions" / "0001_outbox.py").write_text(
        'revision = "0001"\ndown_revision = None\n' + migration)
    try:
        command.upgrade(config, "head")
        assert tables_there(env, *owned) == [True] * len(owned)
        with env.connect() as conn:
            found = schema_version(conn, Tables(outbox))
        assert (found.version, found.problem) == (SCHEMA_VERSION, None)

        filtered = Path(command.revision(config, autogenerate=True, message="with",
                                         rev_id="0002").path).read_text()
        assert f"op.create_table('orders_{env.gid_prefix}'" in filtered  # autogenerate ran
        for name in owned:
            assert f"'{name}'" not in filtered, (name, filtered)
        Path(tmp_path / "migrations" / "versions" / "0002_with.py").unlink()

        # Without the filter, autogenerate proposes to drop every one of them.
        config.attributes["include_object"] = None
        unfiltered = Path(command.revision(config, autogenerate=True, message="without",
                                           rev_id="0003").path).read_text()
        for name in owned:
            assert f"op.drop_table('{name}')" in unfiltered, name
        Path(tmp_path / "migrations" / "versions" / "0003_without.py").unlink()

        # The downgrade drops them; refused while the outbox holds an event.
        with env.connect() as conn:
            conn.execute(sql.SQL("INSERT INTO {} (routing_key, payload) VALUES ('k', '1')").format(
                sql.Identifier(outbox)))
        with pytest.raises(sa.exc.DBAPIError, match="holds events not delivered yet"):
            command.downgrade(config, "base")
        assert tables_there(env, *owned) == [True] * len(owned)
        with env.connect() as conn:
            conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(outbox)))
        command.downgrade(config, "base")
        assert tables_there(env, *owned) == [False] * len(owned)
    finally:
        config.attributes["engine"].dispose()
        with env.connect() as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                sql.Identifier(f"alembic_version_{env.gid_prefix}")))
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(
                sql.SQL(", ").join(sql.Identifier(name) for name in owned)))


DJANGO = '''
import json, sys
import django
from django.conf import settings

settings.configure(DATABASES={"default": json.loads(sys.argv[1])}, INSTALLED_APPS=["shop"],
                   USE_TZ=True)
django.setup()
from django.core.management import call_command
call_command("migrate", "shop", *sys.argv[2:], verbosity=0)
'''


def test_the_django_migration_of_the_docs_is_reversible(env: Env, tmp_path: Path) -> None:
    table = f"django_{env.gid_prefix}"
    names = [table, f"{table}_dead_letter", f"{table}_ledger_key"]
    migrations = tmp_path / "shop" / "migrations"
    migrations.mkdir(parents=True)
    (tmp_path / "shop" / "__init__.py").write_text("")
    (migrations / "__init__.py").write_text("")
    (migrations / "0001_initial.py").write_text(
        "from django.db import migrations\n\n\nclass Migration(migrations.Migration):\n"
        "    initial = True\n    operations: list[object] = []\n")
    documented = docs_block("Django: a reversible migration in one of your apps")
    assert "reverse_sql=drop_schema_sql(" in documented
    (migrations / "0002_outbox.py").write_text(
        documented.replace('"outbox"', repr(table)).replace('"yourapp"', '"shop"'))
    url = urlsplit(env.db_url)
    database = json.dumps({"ENGINE": "django.db.backends.postgresql",
                           "NAME": url.path.lstrip("/"), "USER": url.username,
                           "PASSWORD": url.password or "", "HOST": url.hostname,
                           "PORT": str(url.port)})

    def migrate(*target: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(DJANGO), database, *target],
                              cwd=tmp_path, env={"PYTHONPATH": f"{tmp_path}:{ROOT}"},
                              capture_output=True, text=True, timeout=120)

    try:
        done = migrate()
        assert done.returncode == 0, done.stderr
        assert tables_there(env, *names) == [True, True, True]
        with env.connect() as conn:
            assert schema_version(conn, Tables(table)).problem is None
            conn.execute(sql.SQL("INSERT INTO {} (routing_key, payload) VALUES ('k', '1')").format(
                sql.Identifier(table)))
        refused = migrate("0001_initial")
        assert refused.returncode != 0
        assert re.search(r'table "django_\w+" holds events not delivered yet: not dropped',
                         refused.stderr), refused.stderr
        assert tables_there(env, *names) == [True, True, True]
        with env.connect() as conn:
            conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(table)))
        for target, there in (("0001_initial", False), ("0002", True), ("zero", False)):
            done = migrate(target)
            assert done.returncode == 0, done.stderr
            assert tables_there(env, *names) == [there] * 3, target
    finally:
        with psycopg.connect(env.db_url, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass('django_migrations')").fetchone() != (None,):
                conn.execute("DELETE FROM django_migrations WHERE app = 'shop'")
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                sql.SQL(", ").join(sql.Identifier(name) for name in names)))
