"""The global transaction id (gid) of a prepared batch: ``<prefix>:<instance>:<sequence>``.

The instance part names the relay process that prepared the batch. The resolver turns it back
into the advisory lock that process holds while it lives, which is how a dead relay is told
from a slow one in milliseconds.
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


@dataclass(frozen=True)
class Gid:
    prefix: str
    instance: int
    sequence: int

    def __str__(self) -> str:
        return f"{self.prefix}:{self.instance:08x}:{self.sequence}"

    @classmethod
    def parse(cls, text: str) -> Gid | None:
        """Parse a gid of ours; ``None`` for any other string (foreign transactions)."""
        match = _GID_RE.fullmatch(text)
        if match is None:
            return None
        return cls(match["prefix"], int(match["instance"], 16), int(match["seq"]))


def new_instance_id() -> int:
    """A random 31-bit id for one relay process: it fits PostgreSQL's int4 advisory lock key."""
    return secrets.randbits(31)


def lock_class(prefix: str) -> int:
    """The first key of the instance advisory lock: one namespace per gid prefix."""
    return zlib.crc32(prefix.encode()) & 0x7FFFFFFF
