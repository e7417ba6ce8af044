"""How the chaos runs judge their hostile neighbours (devenv/chaos_neighbours.py): what the
resolver's JSON log says, and which counts must be 0."""

from __future__ import annotations

import json
from pathlib import Path

from devenv.chaos_neighbours import Attacks, ResolverLog, Takeover

HELD = "outbox:0000abcd:1"
OWNER = "outbox:7ffffffe:1"
BY_GID = "outbox:ffffffff:1"


def resolver_log(path: Path, *entries: dict[str, object]) -> Path:
    lines = ["outbox-resolver: a line before logging began", "Traceback (most recent call last):"]
    lines += [json.dumps(entry) for entry in entries]
    path.write_text("\n".join(lines) + "\n{not json\n")
    return path


def said(tmp_path: Path) -> ResolverLog:
    return ResolverLog.read(resolver_log(
        tmp_path / "resolver.log",
        {"action": "ledger_record_rejected", "reason": "unauthenticated", "gid": HELD},
        {"action": "ledger_record_rejected", "reason": "malformed", "gid": None},
        {"action": "ledger_records_rejected_unlogged", "count": 3,
         "reasons": {"oversized": 2, "malformed": 1}},
        {"action": "resolved_rolled_back", "gid": HELD},
        {"action": "foreign_prepared", "gid": OWNER, "reason": "owner"},
        {"action": "foreign_prepared", "gid": BY_GID, "reason": "gid"}))


def attacks(*takeovers: Takeover) -> Attacks:
    a = Attacks(poisoned_records=22, poisoned_naming_in_doubt=2, takeovers=list(takeovers),
                foreign={OWNER: "owner", BY_GID: "gid"})
    a.confirmed = {OWNER, BY_GID}
    return a


def test_the_log_counts_each_rejection_once_logged_or_not(tmp_path: Path) -> None:
    log = said(tmp_path)
    assert log.rejected == {"unauthenticated": 1, "malformed": 2, "oversized": 2}
    assert log.rejected_naming == {HELD: 1}
    assert log.outcomes == {HELD: {"resolved_rolled_back"}}
    assert log.foreign == {OWNER: {"owner"}, BY_GID: {"gid"}}
    assert ResolverLog.read(tmp_path / "missing.log") == ResolverLog()


def test_every_attack_held_off_is_nothing_to_count(tmp_path: Path) -> None:
    figures, zero = attacks(Takeover(HELD, 5, 0.4)).verdict(said(tmp_path), {OWNER, BY_GID})
    assert not any(zero.values()), zero
    assert figures["poisoned_takeovers"] == figures["poisoned_takeovers_rolled_back"] == 1
    assert figures["ledger_records_rejected"] == 5
    assert figures["foreign_prepared_by_reason"] == {"gid": 1, "owner": 1}
    assert figures["foreign_reported"] == figures["foreign_left_prepared"] == 2


def test_a_foreign_transaction_finished_or_unreported_is_counted(tmp_path: Path) -> None:
    log = said(tmp_path)
    del log.foreign[BY_GID]
    _figures, zero = attacks().verdict(log, {OWNER})
    assert zero["foreign_finished"] == 1 and zero["foreign_unreported"] == 1, zero


def test_a_foreign_prepare_cut_off_counts_only_if_it_happened(tmp_path: Path) -> None:
    a = attacks()
    a.confirmed = {OWNER}  # the PREPARE of BY_GID failed: it may or may not have happened
    figures, zero = a.verdict(said(tmp_path), {OWNER})
    assert figures["foreign_prepared"] == 1 and not any(zero.values()), (figures, zero)
    figures, zero = a.verdict(said(tmp_path), {OWNER, BY_GID})
    assert figures["foreign_prepared"] == 2 and not any(zero.values()), (figures, zero)


def test_a_takeover_committed_unrejected_or_short_of_rejections_fails(tmp_path: Path) -> None:
    log = said(tmp_path)
    log.outcomes[HELD] = {"resolved_committed"}
    other = "outbox:0000abce:1"
    _figures, zero = attacks(Takeover(HELD, 20, 0.4), Takeover(other, 20, None)).verdict(
        log, {OWNER, BY_GID})
    assert zero["takeovers_committed"] == 1, zero
    assert zero["takeovers_unrejected"] == 1, zero  # nothing rejected named the other
    assert zero["rejections_missing"] == 40 - 5, zero
