"""BlockAllocator: a hypothesis state machine against a model of who holds which id."""

import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from graphrunner.engine.block_allocator import BlockAllocator


class AllocatorMachine(RuleBasedStateMachine):
    """Model: `held` maps an allocation handle to the ids it got; every id is held at most once."""

    allocations = Bundle("allocations")

    @initialize(num_blocks=st.integers(1, 24))
    def setup(self, num_blocks):
        self.alloc = BlockAllocator(num_blocks)
        self.num_blocks = num_blocks
        self.held: dict[int, list[int]] = {}
        self.freed: list[int] = []  # ids freed and not re-allocated since
        self.next_handle = 0

    @rule(target=allocations, n=st.integers(0, 30))
    def allocate(self, n):
        if not self.alloc.can_allocate(n):
            assert n > self.alloc.num_free
            with pytest.raises(ValueError, match=f"n={n}"):
                self.alloc.allocate(n)
            return None
        ids = self.alloc.allocate(n)
        assert len(ids) == n and len(set(ids)) == n
        currently_held = {b for blocks in self.held.values() for b in blocks}
        assert not currently_held & set(ids), "an id was handed out twice"
        assert all(0 <= b < self.num_blocks for b in ids)
        handle = self.next_handle
        self.next_handle += 1
        self.held[handle] = ids
        self.freed = [b for b in self.freed if b not in ids]
        return handle

    @rule(target=allocations, handle=consumes(allocations), data=st.data())
    def free_some(self, handle, data):
        """Free a random subset of one allocation; the rest stays held under the same handle."""
        assume(handle is not None)
        ids = self.held.pop(handle)
        chosen = data.draw(st.lists(st.sampled_from(ids), unique=True) if ids else st.just([]))
        before = self.alloc.num_free
        self.alloc.free(chosen)
        assert self.alloc.num_free == before + len(chosen)
        assert not any(self.alloc.is_allocated(b) for b in chosen)
        self.freed += chosen
        rest = [b for b in ids if b not in chosen]
        if not rest:
            return None
        self.held[handle] = rest
        return handle

    @rule(data=st.data())
    def double_free_is_rejected(self, data):
        assume(self.freed)
        block_id = data.draw(st.sampled_from(self.freed))
        before = self.alloc.num_free
        with pytest.raises(ValueError, match=f"block id {block_id} is not allocated"):
            self.alloc.free([block_id])
        assert self.alloc.num_free == before

    @rule(block_id=st.one_of(st.integers(-5, -1), st.integers(24, 40)))
    def foreign_id_is_rejected(self, block_id):
        with pytest.raises(ValueError, match=f"block id {block_id} is not in"):
            self.alloc.free([block_id])

    @rule(data=st.data())
    def bad_call_frees_nothing(self, data):
        """A call mixing a held id with a bad one is rejected as a whole."""
        assume(self.held)
        handle = data.draw(st.sampled_from(sorted(self.held)))
        ids = self.held[handle]
        assume(ids)
        before = self.alloc.num_free
        with pytest.raises(ValueError):
            self.alloc.free([ids[0], ids[0]])  # listed twice in one call
        with pytest.raises(ValueError):
            self.alloc.free([ids[0], self.num_blocks])
        assert self.alloc.num_free == before
        assert all(self.alloc.is_allocated(b) for b in ids)

    @invariant()
    def counts_are_consistent(self):
        num_held = sum(len(b) for b in self.held.values())
        assert self.alloc.num_used == num_held
        assert self.alloc.num_free + num_held == self.num_blocks
        for blocks in self.held.values():
            assert all(self.alloc.is_allocated(b) for b in blocks)


AllocatorMachine.TestCase.settings = settings(stateful_step_count=30, deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase


def test_all_ids_come_back_and_order_is_deterministic():
    a = BlockAllocator(8)
    first = a.allocate(5)
    assert first == [0, 1, 2, 3, 4]
    a.free(first)
    assert a.num_free == 8
    assert sorted(a.allocate(8)) == list(range(8))
    assert not a.can_allocate(1) and a.can_allocate(0)


@pytest.mark.parametrize("n", [0, -3])
def test_bad_sizes(n):
    with pytest.raises(ValueError, match=f"num_blocks={n}"):
        BlockAllocator(n)
    with pytest.raises(ValueError, match="n=-1"):
        BlockAllocator(4).allocate(-1)
