"""The claim's mark and floor (relay/marks.py) as pure bookkeeping; against PostgreSQL, every
way a row comes back below the mark is in tests/integration/test_claim_marks.py."""

from __future__ import annotations

from outbox_relay.model import OutboxStats
from outbox_relay.relay.marks import MAX_PENDING, ClaimMarks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_claim_looks_from_the_start_then_every_interval() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    assert marks.start() == (0, True)
    marks.observe(after=0, full=True, writers=[], writers_after=[],
                  claimed=[(1, True), (2, True)],
                  waiting=None, first=None)
    assert (marks.mark, marks.floor) == (2, 0)  # 1 and 2 are ours, in flight
    assert marks.start() == (2, False)
    clock.now += 1.0
    assert marks.start() == (0, True) and marks.full_looks == 2  # from the floor


def test_the_mark_stays_below_a_held_row_and_the_floor_below_the_first_row() -> None:
    marks = ClaimMarks(interval=1.0, clock=Clock())
    marks.start()
    # claimed 5..7; row 3 is not due (first), row 9 is in another relay's batch (waiting)
    marks.observe(after=0, full=True, writers=[], writers_after=[],
                  claimed=[(5, True), (6, True), (7, True)],
                  waiting=9, first=3)
    assert (marks.mark, marks.floor) == (7, 2)  # no higher than the highest claimed


def test_the_floor_stays_below_our_own_rows_in_flight_retried_ones_too() -> None:
    marks = ClaimMarks(interval=1.0, clock=Clock())
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[],
                  claimed=[(4, False), (6, True)], waiting=None,
                  first=10)
    assert (marks.mark, marks.floor) == (6, 3)


def test_marks_move_only_once_the_writers_seen_before_the_claim_have_ended() -> None:
    marks = ClaimMarks(interval=3600.0, clock=Clock())
    marks.start()
    marks.observe(after=0, full=True, writers=["3/7"], writers_after=["3/7"],
                  claimed=[(1, True)], waiting=None,
                  first=None)
    assert (marks.mark, marks.floor) == (0, 0)  # 3/7 may hold an id below 1
    marks.start()
    marks.observe(after=0, full=False, writers=["3/7", "4/2"], writers_after=["3/7", "4/2"],
                  claimed=[(2, True)],
                  waiting=None, first=None)
    assert marks.mark == 0
    marks.start()
    marks.observe(after=0, full=False, writers=["4/2"], writers_after=["4/2"],
                  claimed=[], waiting=None, first=None)
    assert (marks.mark, marks.floor) == (1, 0)  # 3/7 ended: the first candidate holds
    marks.start()
    marks.observe(after=1, full=False, writers=[], writers_after=[],
                  claimed=[], waiting=None, first=None)
    assert marks.mark == 2


def test_a_rewind_drops_what_was_waiting_and_goes_back_to_the_floor() -> None:
    marks = ClaimMarks(interval=3600.0, clock=Clock())
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[],
                  claimed=[(3, True)], waiting=None, first=2)
    assert (marks.mark, marks.floor) == (3, 1)  # row 2 is there, not due
    marks.start()
    marks.observe(after=1, full=False, writers=["1/1"], writers_after=["1/1"],
                  claimed=[(5, True)], waiting=None,
                  first=None)
    marks.rewind()
    assert marks.mark == marks.floor == 1
    marks.start()
    marks.observe(after=1, full=False, writers=[], writers_after=[],
                  claimed=[], waiting=None, first=None)
    assert marks.mark == 1  # the candidate of the rolled-back claim is gone


def test_a_writer_that_stays_keeps_a_bounded_queue() -> None:
    marks = ClaimMarks(interval=3600.0, clock=Clock())
    for n in range(1, 10 * MAX_PENDING):
        marks.start()
        marks.observe(after=0, full=False, writers=["9/9"], writers_after=["9/9"],
                  claimed=[(n, True)], waiting=None,
                      first=None)
    assert len(marks._pending) == MAX_PENDING and marks.mark == 0
    marks.start()
    marks.observe(after=0, full=False, writers=[], writers_after=[],
                  claimed=[], waiting=None, first=None)
    assert marks.mark == MAX_PENDING


def test_a_claim_that_takes_nothing_moves_nothing() -> None:
    marks = ClaimMarks(interval=3600.0, clock=Clock())
    marks.start()
    # rows 5 and 9 are seen only by the frontier, read after the claim's snapshot: an INSERT
    # that began after the second writers read may hold an id below them
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[], waiting=9,
                  first=5)
    assert (marks.mark, marks.floor) == (0, 0)


def test_marks_move_no_higher_than_the_highest_row_claimed() -> None:
    marks = ClaimMarks(interval=3600.0, clock=Clock())
    marks.start()
    # claimed 3 and 4; the frontier saw 20 first and nothing waiting: 5..19 may be ids of
    # INSERTs that began after the claim's snapshot and before a later id committed
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(3, True), (4, True)],
                  waiting=20, first=20)
    assert (marks.mark, marks.floor) == (4, 2)


def test_a_writer_seen_only_after_the_claim_holds_the_candidate() -> None:
    marks = ClaimMarks(interval=3600.0, clock=Clock())
    marks.start()
    # 5/1 began its INSERT between the first read and the claim's snapshot: its id may be below 7
    marks.observe(after=0, full=False, writers=[], writers_after=["5/1"], claimed=[(7, True)],
                  waiting=None, first=None)
    assert marks.mark == 0
    marks.start()
    marks.observe(after=0, full=False, writers=["5/1"], writers_after=["5/1"], claimed=[],
                  waiting=None, first=None)
    assert marks.mark == 0
    marks.start()
    marks.observe(after=0, full=False, writers=[], writers_after=[], claimed=[], waiting=None,
                  first=None)
    assert marks.mark == 7


def test_lower_floor_makes_the_next_claim_a_full_look_from_below_the_row() -> None:
    """A full stats pass (outbox_relay/runtime/stats.py) saw row 41 at or below the floor (it
    came back there): the next claim looks from 40, whatever the interval says."""
    clock = Clock()
    marks = ClaimMarks(interval=3600.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[],
                  claimed=[(101, True), (102, True)], waiting=None, first=None)
    assert (marks.mark, marks.floor) == (102, 100)
    marks.lower_floor(45)
    marks.lower_floor(40)  # two requests before a claim: the lower one holds
    assert (marks.mark, marks.floor) == (102, 100)  # applied by the claim thread, in start()
    assert marks.start() == (40, True) and (marks.mark, marks.floor) == (40, 40)
    assert marks.full_looks == 2
    marks.observe(after=40, full=True, writers=[], writers_after=[], claimed=[(41, True)],
                  waiting=None, first=None)
    assert marks.floor == 40  # 41 is ours, in flight
    assert marks.start() == (41, False)  # the request was applied once


def test_lower_floor_above_the_floor_changes_only_the_look() -> None:
    marks = ClaimMarks(interval=3600.0, clock=Clock())
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(11, True)],
                  waiting=None, first=None)
    marks.lower_floor(20)
    assert marks.start() == (10, True) and marks.floor == 10


def test_lower_floor_is_safe_from_another_thread() -> None:
    import threading

    marks = ClaimMarks(interval=3600.0, clock=Clock())
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(1001, True)],
                  waiting=None, first=None)
    threads = [threading.Thread(target=lambda n=n: [marks.lower_floor(1000 - n - i)
                                                    for i in range(100)]) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert marks.start() == (1000 - 3 - 99, True)


def test_a_claim_reads_where_the_marks_move_once_enough_rows_went_unread() -> None:
    marks = ClaimMarks(interval=3600.0, read_rows=10, clock=Clock())
    after, full = marks.start()
    assert marks.reads(full)  # the first claim of a session
    marks.observe(after=after, full=full, writers=[], writers_after=[],
                  claimed=[(1, True)], waiting=None, first=None)
    reads = []
    for _ in range(6):  # 3 rows a claim from here on
        reads.append(marks.reads(marks.start()[1]))
        if not reads[-1]:
            marks.claimed_unread(3)
    assert reads == [False, False, False, False, True, False]  # after 12 >= 10 unread
    assert marks.mark == 1  # nothing observed since: the mark moved nowhere


def test_a_rewind_and_a_look_from_the_floor_read_at_once() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, read_rows=100, clock=clock)
    assert marks.reads(marks.start()[1])
    assert not marks.reads(marks.start()[1])
    marks.rewind()  # rows of ours came back: move the mark up again soon
    assert marks.reads(marks.start()[1])
    assert not marks.reads(marks.start()[1])
    clock.now += 1.0
    _after, full = marks.start()
    assert full and marks.reads(full)
    marks.restart()
    assert marks.reads(marks.start()[1])


def test_every_claim_reads_at_zero() -> None:
    marks = ClaimMarks(interval=3600.0, read_rows=0, clock=Clock())
    assert all(marks.reads(marks.start()[1]) for _ in range(5))


def test_at_the_floor_with_a_candidate_waiting_the_next_claim_reads() -> None:
    # A look from the floor while our batch is in flight (a writer): its candidate waits, and
    # the mark stays at the floor until a read sees that writer gone.
    marks = ClaimMarks(interval=3600.0, read_rows=100, clock=Clock())
    after, full = marks.start()
    assert marks.reads(full)
    marks.observe(after=after, full=full, writers=["-1/700"], writers_after=["-1/700"],
                  claimed=[(5, True)], waiting=None, first=None)
    assert (marks.mark, marks.floor) == (0, 0)
    after, full = marks.start()
    assert marks.reads(full)  # at the floor, a candidate waiting: read again
    marks.observe(after=after, full=full, writers=["-1/701"], writers_after=["-1/701"],
                  claimed=[(6, True)], waiting=None, first=None)
    assert (marks.mark, marks.floor) == (5, 4)  # the first candidate applied
    assert not marks.reads(marks.start()[1])  # above the floor: back to the cadence


def test_the_floor_passes_a_parked_row_and_comes_back_below_it_once_due() -> None:
    """Row 3 has no ordering key and is due in 10 s (a scheduled event): the floor passes it,
    so the looks until then do not walk from it, and the first look after its time starts
    below it."""
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    assert marks.start() == (0, True)
    marks.observe(after=0, full=True, writers=[], writers_after=[],
                  claimed=[(5, True), (6, True)], waiting=None, first=None,
                  parked=(3, 10.0))
    assert (marks.mark, marks.floor) == (6, 4)  # below our rows in flight only
    clock.now += 1.0
    assert marks.start() == (4, True)
    marks.observe(after=4, full=True, writers=[], writers_after=[], claimed=[(7, True)],
                  waiting=None, first=None)
    assert marks.floor == 6
    clock.now += 8.5  # 9.5 s: not due yet
    assert marks.start() == (6, True)
    marks.observe(after=6, full=True, writers=[], writers_after=[], claimed=[(8, True)],
                  waiting=None, first=None)
    clock.now += 0.4  # due at 10 s, but no look is due before 10.5 s
    assert marks.start() == (8, False)
    clock.now += 0.6
    assert marks.start() == (2, True)  # below it: the look finds it
    clock.now += 1.0
    assert marks.start() == (2, True)  # told nothing since: it stays there


def test_parked_rows_seen_by_several_looks_keep_the_lowest_and_the_earliest() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(20, True)],
                  waiting=None, first=None, parked=(10, 100.0))
    clock.now += 1.0
    marks.start()
    marks.observe(after=19, full=True, writers=[], writers_after=[], claimed=[(30, True)],
                  waiting=None, first=None, parked=(25, 5.0))
    marks.observe(after=29, full=False, writers=[], writers_after=[], claimed=[(31, True)],
                  waiting=None, first=None, parked=(26, 0.0))  # only a full look's counts
    clock.now += 4.0
    assert marks.start() == (29, True)  # 4 s after the second look: none is due
    clock.now += 1.0
    assert marks.start() == (9, True)  # 25 is due: from below the lowest, 10


def test_a_new_session_forgets_the_parked_rows() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(20, True)],
                  waiting=None, first=None, parked=(10, 0.5))
    marks.restart()  # its first claim looks from the start anyway
    assert marks.start() == (0, True)
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(21, True)],
                  waiting=None, first=None)
    clock.now += 1.0
    assert marks.start() == (20, True)


def test_a_dead_keys_rows_are_passed_and_its_head_reads_start_below_them() -> None:
    """Key k has a dead letter (its rows 3 and 4 wait behind it): the look's first row is past
    them, and k's head reads start where the floor was when k was first seen dead."""
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    assert marks.start() == (0, True)
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(5, True)],
                  waiting=None, first=None, dead_keys={"k": None})
    assert marks.held == {"k": 0} and marks.floor == 4  # below our row in flight only
    clock.now += 1.0
    assert marks.start() == (4, True)
    marks.observe(after=4, full=True, writers=[], writers_after=[], claimed=[(6, True)],
                  waiting=None, first=None, dead_keys={"k": None, "j": None})
    assert marks.held == {"k": 0, "j": 4}  # k's bound is kept, j's is this look's floor
    assert marks.floor == 5
    marks.observe(after=5, full=False, writers=[], writers_after=[], claimed=[(7, True)],
                  waiting=None, first=None, dead_keys={})  # only a full look's count
    assert marks.held == {"k": 0, "j": 4}


def test_a_key_no_longer_dead_brings_the_floor_and_mark_below_its_rows() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(5, True)],
                  waiting=None, first=None, dead_keys={"k": None})
    clock.now += 1.0
    marks.start()
    marks.observe(after=4, full=True, writers=[], writers_after=[], claimed=[(20, True)],
                  waiting=None, first=30, dead_keys={"k": None, "j": None})
    marks.observe(after=20, full=False, writers=["w"], writers_after=["w"],
                  claimed=[(25, True)], waiting=None, first=None)  # waits for w
    assert (marks.mark, marks.floor) == (20, 19)
    clock.now += 1.0
    assert marks.start() == (19, True)
    # k's dead letter is gone (requeued at its old id, 1): from below k's rows, at once; what
    # waited to move the marks past them is dropped, and this look moves nothing
    marks.observe(after=19, full=True, writers=[], writers_after=[], claimed=[(40, True)],
                  waiting=None, first=50, dead_keys={"j": None})
    assert marks.held == {"j": 4} and (marks.mark, marks.floor) == (0, 0)
    assert marks.start() == (0, False)


def test_more_dead_keys_than_held_let_every_key_go() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(9, True)],
                  waiting=None, first=None, dead_keys={"k": None})
    clock.now += 1.0
    assert marks.start() == (8, True)
    marks.observe(after=8, full=True, writers=[], writers_after=[], claimed=[(12, True)],
                  waiting=None, first=10, dead_keys=None)  # over the bound: none held
    assert marks.held == {} and marks.floor == 0


def test_a_new_session_holds_no_key() -> None:
    marks = ClaimMarks(interval=1.0, clock=Clock())
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(9, True)],
                  waiting=None, first=None, dead_keys={"k": None})
    marks.restart()
    assert marks.held == {} and marks.start() == (0, True)


def test_a_held_keys_head_reads_start_below_the_id_its_dead_letter_gets_back() -> None:
    """A dead letter's key may change (an operator's fix): when requeued, it gets its old id
    back, which may lie below the floor, and its new key's head reads must see it."""
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(50, True)],
                  waiting=None, first=None, dead_keys={})
    clock.now += 1.0
    assert marks.start() == (49, True)
    marks.observe(after=49, full=True, writers=[], writers_after=[], claimed=[(60, True)],
                  waiting=None, first=None, dead_keys={"j": 7, "k": 55})
    assert marks.held == {"j": 6, "k": 49}


def test_a_parked_keys_rows_are_passed_and_it_is_let_go_once_its_head_is_not() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(20, True)],
                  waiting=None, first=None, dead_keys={"d": 3}, parked_keys=["d", "k"])
    assert marks.held == {"d": 0, "k": 0} and marks.floor == 19
    clock.now += 1.0
    assert marks.start() == (19, True)
    marks.observe(after=19, full=True, writers=[], writers_after=[], claimed=[(30, True)],
                  waiting=None, first=None, dead_keys={"d": 3}, parked_keys=[])
    assert marks.held == {"d": 0} and (marks.floor, marks.mark) == (0, 0)  # k: from below


def test_more_parked_keys_than_held_let_them_go() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(9, True)],
                  waiting=None, first=None, dead_keys={}, parked_keys=["k"])
    clock.now += 1.0
    marks.start()
    marks.observe(after=8, full=True, writers=[], writers_after=[], claimed=[(12, True)],
                  waiting=None, first=10, dead_keys={}, parked_keys=None)
    assert marks.held == {} and marks.floor == 0


def stats(*, unparked: int | None = None, parked_keys: dict[str, int] | None = None,
          lowest_parked_key: int | None = None) -> OutboxStats:
    return OutboxStats(0, 0.0, 0, None, unparked, parked_keys=parked_keys,
                       lowest_parked_key=lowest_parked_key)


def test_check_floor_lowers_it_under_a_row_no_look_from_it_would_see() -> None:
    clock = Clock()
    marks = ClaimMarks(interval=1.0, clock=clock)
    marks.start()
    marks.observe(after=0, full=True, writers=[], writers_after=[], claimed=[(20, True)],
                  waiting=None, first=None, dead_keys={}, parked_keys=["held"])
    assert marks.floor == 19
    marks.check_floor(stats(parked_keys={"held": 5}, lowest_parked_key=5))
    assert marks.start() == (20, False)  # a key held: its rows are passed on purpose
    marks.check_floor(stats(unparked=25, parked_keys={"held": 5, "new": 30}))
    assert marks.start() == (20, False)  # above the floor: the looks see them
    marks.check_floor(stats(unparked=25, parked_keys={"held": 5, "new": 7}))
    assert marks.start() == (6, True)  # a parked key not held, below the floor
    marks.check_floor(stats(unparked=4, parked_keys={}))
    assert marks.start() == (3, True)
    marks.check_floor(stats(parked_keys=None, lowest_parked_key=2))  # over the bound
    assert marks.start() == (1, True)
