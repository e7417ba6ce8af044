"""Every SQL file of outbox-relay, shipped inside the wheel as ``outbox_relay.sql``.

``schema.sql`` (the outbox, its dead-letter table, the ledger key) and ``inbox.sql`` (the
consumers' inbox) are templates any service can apply, ``drop_schema.sql`` undoes the first (a
migration's downgrade); ``roles.sql`` is run with psql;
``queries.sql`` holds the programs' named queries and ``api.sql`` the services' (the producer's
INSERT, the inbox's statements). Identifiers are filled in by ``outbox_relay.tables.Tables``.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME_RE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def text(name: str) -> str:
    """The text of one SQL file of this folder."""
    return resources.files(__name__).joinpath(name).read_text("utf-8")


def parse_named(text: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` sections into {name: SQL text}."""
    parts = _NAME_RE.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def expand_fragments(named: dict[str, str]) -> dict[str, str]:
    """The sections whose name does not start with ``_``, each ``{_name}`` in them replaced by
    the section ``_name`` (a fragment: a predicate two walks share, written once), which may
    name fragments too."""
    fragments = {name: body for name, body in named.items() if name.startswith("_")}

    def expand(body: str) -> str:
        for _ in range(len(fragments) + 1):
            named_here = [name for name in fragments if f"{{{name}}}" in body]
            if not named_here:
                return body
            for name in named_here:
                body = body.replace(f"{{{name}}}", fragments[name])
        raise ValueError("queries.sql: fragments that name each other in a cycle")

    return {name: expand(body) for name, body in named.items() if not name.startswith("_")}


@cache
def queries() -> dict[str, str]:
    """The programs' named queries (``queries.sql``), their fragments in place."""
    return expand_fragments(parse_named(text("queries.sql")))


@cache
def api_queries() -> dict[str, str]:
    """The named queries of the services' API (``api.sql``: the producer, the inbox) without
    their full-line comments: they also run through SQLAlchemy's text(), which would read a
    ``:word`` inside a comment as a parameter."""
    return {name: "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))
            for name, body in parse_named(text("api.sql")).items()}
