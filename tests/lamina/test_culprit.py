"""The culprit search (engine/culprit.py): exact probes over request ids, and, against
an oracle (a step fails iff the culprit is in it), that it names the culprit wherever it
sits among B requests within log2(B) + 3 failed steps, and names no one when no one
request fails the steps alone, nor one that failed alone once (a worker lost to
something else while it ran)."""
import math

import pytest

from lamina.engine.culprit import CulpritSearch


def test_probes_halve_the_suspects_and_clear_those_that_ran():
    s = CulpritSearch([7, 3, 5, 1, 0, 6, 2, 4])
    assert s.suspects == list(range(8)) and s.probe == {0, 1, 2, 3}
    assert s.admits(2) and not s.admits(4) and not s.admits(99)  # 99 came since: held
    s.drew({0, 1, 2, 3})  # the first half ran: cleared, the second half is tried
    assert s.cleared == {0, 1, 2, 3} and s.probe == {4, 5}
    assert s.admits(0) and s.admits(5) and not s.admits(6)
    assert s.failed({0, 1, 2, 3, 4, 5}) is None  # cleared ones ran beside it: not them
    assert s.suspects == [4, 5] and s.probe == {4} and s.failures == 1
    s.drew({0, 1, 4})
    assert s.probe == {5}
    assert s.failed({0, 1, 2, 3, 4, 5}) is None  # 5 is left: it is tried alone
    assert s.probe == {5} and s.cleared == set() and not s.admits(0)
    assert s.failed({5}) is None and s.probe == {5}  # it fails alone: tried again
    assert s.failed({5}) == 5 and s.failures == 4  # and fails again: named


def test_a_request_failing_alone_once_is_not_named():
    """A worker lost to something else (killed, its host gone) while the last suspect
    ran alone: it runs alone again, draws, and is cleared; the search ends naming no
    one. The same holds for the step that is an accused request's alibi."""
    s = CulpritSearch([4, 9])
    assert s.probe == {4}
    assert s.failed({4}) is None and s.probe == {4} and s.suspects == [4, 9]
    s.drew({4})  # ran alone again: not its doing
    assert s.cleared == {4} and s.probe == {9}
    assert s.failed({4, 9}) is None and s.probe == {9} and s.cleared == set()
    assert s.failed({9}) is None  # 9 alone: once
    s.drew({9})
    assert s.done
    s = CulpritSearch([1, 2])
    s.alibi(1, [1, 2])
    assert not s.confirmed({2}) and s.confirmed({2})  # the others failed twice


def test_a_probe_drawing_in_parts_is_cleared_when_all_drew():
    s = CulpritSearch([1, 2, 3, 4])
    s.drew({1})  # 2 still in its (chunked) prompt
    assert s.probe == {2} and s.cleared == {1}
    s.drew({1, 2})
    assert s.probe == {3}


def test_every_suspect_cleared_or_a_failure_without_them_ends_it_naming_no_one():
    s = CulpritSearch([1, 2, 3])
    s.drew({1, 2})
    s.drew({1, 2, 3})
    assert s.done and s.probe == set()
    s = CulpritSearch([1, 2, 3])
    s.drew({1, 2})
    assert s.failed({1, 2}) is None and s.done  # only cleared ones ran: not one request


def test_requests_that_leave_are_no_longer_suspects():
    s = CulpritSearch([1, 2, 3, 4])
    s.forget(1)
    assert s.probe == {2} and s.suspects == [2, 3, 4]
    s.forget(2)  # the probe emptied: the next half of what is left
    assert s.probe == {3}
    s.forget(9)  # never a suspect
    assert s.suspects == [3, 4]


def test_an_alibi_admits_only_the_others():
    s = CulpritSearch([1, 2])
    assert s.failed({1}) is None and s.failed({1}) == 1  # alone in its step, twice
    assert s.alibi(1, [1, 2, 8])
    assert s.accused == 1 and s.probe == {2, 8} and not s.admits(1) and s.admits(8)
    assert not CulpritSearch([1]).alibi(1, [1])  # nobody else to run


def test_no_suspects_refused():
    with pytest.raises(ValueError, match="at least one suspect"):
        CulpritSearch([])


def run(search: CulpritSearch, fails, everyone, late_drawers=frozenset()):
    """Drive a search as the engine does: each step holds every admitted request (the
    probe and the cleared); -> (verdict or None, failed steps). `late_drawers` draw
    only on the second step they run in (a prompt fed in two chunks)."""
    steps = {}
    while not search.done:
        step = {r for r in everyone if search.admits(r)}
        if fails(step):
            culprit = search.failed(step)
            steps.clear()  # a recovery: every request starts over
            if culprit is not None:
                return culprit, search.failures
            continue
        for r in step:
            steps[r] = steps.get(r, 0) + 1
        search.drew({r for r in step if r not in late_drawers or steps[r] >= 2})
    return None, search.failures


@pytest.mark.parametrize("b", [1, 2, 3, 5, 8, 13, 32])
def test_the_culprit_is_named_wherever_it_sits(b):
    for culprit in range(b):
        got, failures = run(CulpritSearch(range(b)), lambda step: culprit in step, range(b),
                            late_drawers={0, b - 1})
        assert got == culprit
        assert failures <= math.ceil(math.log2(b)) + 3


@pytest.mark.parametrize("b", [1, 4, 9])
def test_failures_no_one_request_sets_off_name_no_one(b):
    # two requests together fail the step, each alone runs
    got, _ = run(CulpritSearch(range(b)), lambda step: {0, b - 1} <= step and b > 1,
                 range(b))
    assert got is None
    got, failures = run(CulpritSearch(range(b)), lambda step: False, range(b))  # transient
    assert got is None and failures == 0
