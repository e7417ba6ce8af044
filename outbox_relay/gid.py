"""The global transaction id (gid) of a prepared batch: ``<prefix>:<instance>:<sequence>``.

The instance part names the relay process that prepared the batch. The resolver turns it back
into the advisory lock that process holds while it lives, which is how a dead relay is told
from a slow one in milliseconds.

Any PostgreSQL role may PREPARE a transaction under any gid, one shaped like ours included, so
``Gid.parse`` accepts only what a relay makes: an instance below 2^31 (``new_instance_id``; it
is an int4 lock key) and a sequence below 2^63. Anything else is foreign, never parsed into a
lock key or a statement.
"""

from __future__ import annotations

import re
import secrets
import zlib
from dataclasses import dataclass

# A gid is a string literal under 200 bytes that cannot be a bind parameter: keep the
# alphabet boring so quoting can never matter, and keep it short.
# \A and \Z, never ^ and $: "$" also matches before a trailing newline.
PREFIX_RE = re.compile(r"\A[a-z][a-z0-9_-]{0,31}\Z")
_GID_RE = re.compile(r"\A(?P<prefix>[a-z][a-z0-9_-]{0,31}):(?P<instance>[0-9a-f]{8}):(?P<seq>[0-9]{1,19})\Z")
# What a relay makes: new_instance_id() is 31 bits (an int4 advisory lock key; an instance
# above it made pg_try_advisory_lock(integer, bigint) fail, issue 32), and a relay's sequence
# counts batches from 1.
INSTANCE_LIMIT = 1 << 31
SEQUENCE_LIMIT = 1 << 63


@dataclass(frozen=True)
class Gid:
    prefix: str
    instance: int
    sequence: int

    def __str__(self) -> str:
        return f"{self.prefix}:{self.instance:08x}:{self.sequence}"

    @classmethod
    def parse(cls, text: str) -> Gid | None:
        """Parse a gid a relay could have made; ``None`` for any other string (foreign
        transactions, an out-of-range instance or sequence included)."""
        match = _GID_RE.fullmatch(text)
        if match is None:
            return None
        instance, sequence = int(match["instance"], 16), int(match["seq"])
        if instance >= INSTANCE_LIMIT or sequence >= SEQUENCE_LIMIT:
            return None
        return cls(match["prefix"], instance, sequence)


def new_instance_id() -> int:
    """A random 31-bit id for one relay process: it fits PostgreSQL's int4 advisory lock key."""
    return secrets.randbelow(INSTANCE_LIMIT)


def lock_class(prefix: str) -> int:
    """The first key of the instance advisory lock: one namespace per gid prefix."""
    return zlib.crc32(prefix.encode()) & 0x7FFFFFFF
