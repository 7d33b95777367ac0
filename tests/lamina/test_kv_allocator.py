"""KV allocator: exact slot ids, LIFO reuse, refcounts, copy-on-write, no leaks."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lamina.memory.allocator import CopySlot, KVAllocator, KVAllocatorConfig, KVPoolExhausted


def alloc(n=8, **kw):
    return KVAllocator(KVAllocatorConfig(num_slots=n, **kw))


def test_fresh_pool_hands_out_slots_in_order():
    a = alloc()
    assert a.free_list() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert a.allocate("r0", 3) == [0, 1, 2]
    assert a.append("r0") == 3
    assert a.allocate("r1", 2) == [4, 5]
    assert a.slots("r0") == [0, 1, 2, 3]
    assert a.free_list() == [6, 7]
    assert [a.refcount(s) for s in range(8)] == [1, 1, 1, 1, 1, 1, 0, 0]


def test_free_is_lifo_and_reuses_in_position_order():
    a = alloc()
    a.allocate("r0", 3)  # 0 1 2
    a.allocate("r1", 2)  # 3 4
    assert a.free("r0") == [2, 1, 0]  # pushed last-position first
    assert a.free_list() == [0, 1, 2, 5, 6, 7]
    assert a.allocate("r2", 4) == [0, 1, 2, 5]
    a.free("r1")
    assert a.free_list() == [3, 4, 6, 7]
    assert a.append("r2") == 3


def test_fork_shares_slots_and_counts_references():
    a = alloc()
    a.allocate("p", 3)
    assert a.fork("p", "c") == [0, 1, 2]
    assert [a.refcount(s) for s in (0, 1, 2)] == [2, 2, 2]
    assert a.append("c") == 3 and a.append("p") == 4  # new positions are never shared
    assert a.slots("p") == [0, 1, 2, 4] and a.slots("c") == [0, 1, 2, 3]
    assert a.stats().shared == 3
    assert a.free("p") == [4]  # shared slots survive the parent
    assert [a.refcount(s) for s in (0, 1, 2, 3, 4)] == [1, 1, 1, 1, 0]
    assert a.free("c") == [3, 2, 1, 0]
    assert a.free_list() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_copy_on_write_into_shared_position():
    a = alloc()
    a.allocate("p", 3)
    a.fork("p", "c")
    assert a.write("c", 2) == CopySlot(src=2, dst=3)
    assert a.slots("c") == [0, 1, 3] and a.slots("p") == [0, 1, 2]
    assert [a.refcount(s) for s in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert a.write("p", 2) is None  # now exclusive: written in place
    assert a.write("c", -1) is None


def test_exhaustion_is_typed_and_changes_nothing():
    a = alloc(4)
    a.allocate("r0", 3)
    assert a.can_allocate(1) and not a.can_allocate(2)
    before = (a.free_list(), a.slots("r0"))
    with pytest.raises(KVPoolExhausted) as e:
        a.extend("r0", 2)
    assert (e.value.needed, e.value.free) == (2, 1)
    with pytest.raises(KVPoolExhausted):
        a.allocate("r1", 5)
    assert "r1" not in a.requests()
    assert (a.free_list(), a.slots("r0")) == before
    a.fork("r0", "r2")
    a.append("r0")
    with pytest.raises(KVPoolExhausted):  # CoW needs a slot too
        a.write("r2", 0)
    assert a.slots("r2") == [0, 1, 2]


def test_bad_calls():
    a = alloc()
    a.allocate("r", 1)
    with pytest.raises(ValueError, match="already has slots"):
        a.allocate("r", 1)
    with pytest.raises(KeyError, match="unknown request"):
        a.free("nope")
    with pytest.raises(IndexError):
        a.write("r", 5)
    with pytest.raises(ValueError):
        a.allocate("s", -1)


def test_config_validation_and_overcommit_accounting():
    with pytest.raises(ValueError, match="num_slots"):
        KVAllocatorConfig(num_slots=0)
    with pytest.raises(ValueError, match="overcommit=True"):
        KVAllocatorConfig(num_slots=10, device_budget_slots=4)
    a = alloc(10, device_budget_slots=4, overcommit=True)
    a.allocate("r", 6)
    s = a.stats()
    assert (s.used, s.free, s.over_budget) == (6, 4, 2)


class AllocatorMachine(RuleBasedStateMachine):
    """Random operation sequences: no leak, no double free, no slot owned twice."""

    def __init__(self):
        super().__init__()
        self.a = alloc(16)
        self.n = 0

    reqs = property(lambda self: self.a.requests())

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        if self.a.can_allocate(n):
            self.a.allocate(self.n, n)
            self.n += 1
        else:
            with pytest.raises(KVPoolExhausted):
                self.a.allocate(self.n, n)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def append(self, data):
        r = data.draw(st.sampled_from(self.reqs))
        if self.a.can_allocate(1):
            s = self.a.append(r)
            assert self.a.refcount(s) == 1
        else:
            with pytest.raises(KVPoolExhausted):
                self.a.append(r)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        self.a.fork(data.draw(st.sampled_from(self.reqs)), self.n)
        self.n += 1

    @precondition(lambda self: any(self.a.slots(r) for r in self.reqs))
    @rule(data=st.data())
    def write(self, data):
        r = data.draw(st.sampled_from([r for r in self.reqs if self.a.slots(r)]))
        pos = data.draw(st.integers(0, len(self.a.slots(r)) - 1))
        old = self.a.slots(r)[pos]
        if self.a.refcount(old) > 1 and not self.a.can_allocate(1):
            with pytest.raises(KVPoolExhausted):
                self.a.write(r, pos)
            return
        cp = self.a.write(r, pos)
        assert self.a.refcount(self.a.slots(r)[pos]) == 1
        assert (cp is None) == (old == self.a.slots(r)[pos])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        self.a.free(data.draw(st.sampled_from(self.reqs)))

    @invariant()
    def consistent(self):
        owners = {}
        for r in self.reqs:
            for s in self.a.slots(r):
                owners[s] = owners.get(s, 0) + 1
        free = self.a.free_list()
        assert len(free) == len(set(free))  # no double free
        assert not set(free) & set(owners)  # no live slot on the free list
        assert len(free) + len(owners) == 16  # no leak
        for s in range(16):
            assert self.a.refcount(s) == owners.get(s, 0)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_drop_gives_back_a_range_and_leaves_holes():
    a = alloc()
    a.allocate("r", 6)  # 0..5
    assert a.drop("r", 1, 4) == [3, 2, 1]  # pushed last position first: 1 is reused first
    assert a.slots("r") == [0, -1, -1, -1, 4, 5]
    assert a.free_list() == [1, 2, 3, 6, 7]
    assert [a.refcount(s) for s in range(6)] == [1, 0, 0, 0, 1, 1]
    assert a.drop("r", 0, 4) == [0]  # holes are skipped
    assert a.append("r") == 0  # the slot dropped last is on top
    assert a.slots("r") == [-1, -1, -1, -1, 4, 5, 0]
    with pytest.raises(IndexError, match="cannot drop 5..7"):
        a.drop("r", 5, 8)
    with pytest.raises(IndexError, match="position 1 was dropped"):
        a.write("r", 1)
    assert a.free("r") == [0, 5, 4]
    assert a.free_list() == [4, 5, 0, 1, 2, 3, 6, 7]
    assert a.stats().used == 0


def test_drop_in_a_forked_table_frees_only_unshared_slots():
    a = alloc()
    a.allocate("p", 4)
    a.fork("p", "c")
    assert a.drop("p", 1, 3) == []  # the child still holds 1 and 2
    assert [a.refcount(s) for s in range(4)] == [2, 1, 1, 2]
    a.fork("p", "g")  # a fork of a table with holes keeps them
    assert a.slots("g") == [0, -1, -1, 3] and a.refcount(0) == 3
    assert a.drop("c", 0, 4) == [2, 1]
    assert a.free("g") == [] and a.free("p") == [3, 0]
    assert a.stats().used == 0


def test_drop_positions_gives_back_any_set():
    a = alloc()
    a.allocate("r", 6)  # 0..5
    a.fork("r", "c")
    a.free("c")  # refcounts back to 1
    assert a.drop_positions("r", [4, 1, 2, 1]) == [4, 2, 1]  # the first position's on top
    assert a.slots("r") == [0, -1, -1, 3, -1, 5]
    assert a.free_list() == [1, 2, 4, 6, 7]
    assert a.drop_positions("r", [1, 3]) == [3]  # holes are skipped
    assert a.append("r") == 3
    assert a.drop_positions("r", []) == []
    with pytest.raises(IndexError, match="cannot drop positions 2..9"):
        a.drop_positions("r", [2, 9])
    assert a.slots("r") == [0, -1, -1, -1, -1, 5, 3]  # a refused drop changed nothing
    a.fork("r", "k")
    assert a.drop_positions("r", [0, 5]) == []  # the fork still holds them
    assert [a.refcount(s) for s in (0, 3, 5)] == [1, 2, 1]
    assert a.free("k") == [5, 0] and a.free("r") == [3]
    assert a.stats().used == 0
