"""Prefix caching: the content-keyed block pool and the engine that uses it.

The pool is checked against a model of what each block holds; the engine against itself without
the cache: greedy and seeded tokens are identical while later requests skip their shared prefix
(the runner receives new requests with num_computed_tokens > 0 and prefills only the rest), in
eager mode and with (CPU-emulated) graphs, sync and async, through preemption.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.engine.prefix_cache import PrefixCachingAllocator

BS = 4


@given(ops=st.lists(st.tuples(st.sampled_from(["req", "free"]), st.lists(st.integers(0, 3), min_size=1,
                                                                             max_size=14)), max_size=40))
def test_pool_hits_hold_the_prefix_they_are_keyed_by(ops) -> None:
    pool = PrefixCachingAllocator(12, BS)
    content: dict[int, tuple[int, ...]] = {}  # block -> the tokens of the whole prefix it ends
    held: list[list[int]] = []
    for op, tokens in ops:
        if op == "free":
            if held:
                pool.free(held.pop(0))
            continue
        hit = pool.lookup(tokens, (len(tokens) - 1) // BS)
        for i, block in enumerate(hit):  # a hit is exactly the prefix that block was keyed with
            assert content[block] == tuple(tokens[: (i + 1) * BS])
        need = -(-len(tokens) // BS) - len(hit)
        reclaimed = sum(not pool.is_allocated(b) for b in hit)
        if not pool.can_allocate(need + reclaimed):
            continue
        pool.touch(hit)
        blocks = hit + pool.allocate(need)
        for block in blocks[len(hit):]:
            content.pop(block, None)  # reused: its old content is gone
        full = len(tokens) // BS
        pool.register(tokens, blocks, full)
        for i in range(full):
            content.setdefault(blocks[i], tuple(tokens[: (i + 1) * BS]))
        held.append(blocks)
        assert len(set(blocks)) == len(blocks)
    assert pool.num_free + pool.num_used == pool.num_blocks
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])


@given(reqs=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=20),
                               st.lists(st.integers(1, 3), min_size=1, max_size=6), st.booleans()), max_size=12))
def test_registering_a_filled_block_at_a_time_keys_what_one_whole_walk_keys(reqs) -> None:
    """`register(..., start)` resumes a request's chain where its last call stopped: the pool's keys and
    hits equal those of a pool that walks every block from the first on each call."""
    whole, resumed = PrefixCachingAllocator(16, BS), PrefixCachingAllocator(16, BS)
    held: list[list[int]] = []
    for tokens, steps, free_first in reqs:
        if free_first and held:
            blocks = held.pop(0)
            whole.free(blocks)
            resumed.free(blocks)
        hit = whole.lookup(tokens, (len(tokens) - 1) // BS)
        assert resumed.lookup(tokens, (len(tokens) - 1) // BS) == hit
        need = -(-len(tokens) // BS) - len(hit)
        if not whole.can_allocate(need + sum(not whole.is_allocated(b) for b in hit)):
            continue
        for pool in (whole, resumed):
            pool.touch(hit)
        blocks = hit + whole.allocate(need)
        assert resumed.allocate(need) == blocks[len(hit):]
        full, done = len(tokens) // BS, 0
        for step in steps:  # the blocks fill a few at a time, as decoding fills them
            upto = min(full, done + step)
            whole.register(tokens, blocks, upto)
            resumed.register(tokens, blocks, upto, start=done)
            done = upto
        whole.register(tokens, blocks, full)
        resumed.register(tokens, blocks, full, start=done)
        assert resumed._key_of == whole._key_of and resumed._block_of == whole._block_of
        held.append(blocks)


ARGS = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, block_size=4, seed=3)
GRAPHS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])
SHARED = [(5 * j) % 97 + 1 for j in range(27)]
PROMPTS = [SHARED + [100 + i, 7, i + 1] for i in range(5)] + [SHARED[:9], SHARED + [3]]


def _run(prefix: bool, **extra) -> tuple[list, object]:
    from graphrunner.engine import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM("builtin:tiny-llama", enable_prefix_caching=prefix, **{**ARGS, **extra})
    params = [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    first = [o.token_ids for o in llm.generate(PROMPTS[:2], params[:2])]  # fills the cache
    rest = [o.token_ids for o in llm.generate(PROMPTS, params)]  # hits it
    pool = llm.scheduler.block_allocator
    llm.shutdown()
    return first + rest, pool


@pytest.mark.parametrize("extra", [{"num_kv_blocks": 96}, {"num_kv_blocks": 96, **GRAPHS},
                                   {"num_kv_blocks": 96, "async_scheduling": True}, {"num_kv_blocks": 20}],
                         ids=["eager", "graphs", "async", "preempting"])
def test_engine_tokens_equal_without_the_cache_while_prefixes_hit(extra) -> None:
    cached, pool = _run(True, **extra)
    plain, _ = _run(False, **extra)
    assert cached == plain
    assert isinstance(pool, PrefixCachingAllocator) and pool.num_hit_tokens >= 5 * 24  # most prompts skip 24+
    assert pool.num_free == pool.num_blocks  # every reference given back


def test_reset_forgets_every_prefix() -> None:
    pool = PrefixCachingAllocator(8, BS)
    tokens = list(range(9))
    blocks = pool.allocate(3)
    pool.register(tokens, blocks, 2)
    assert pool.lookup(tokens, 2) == blocks[:2]
    pool.reset()
    assert pool.lookup(tokens, 2) == [] and pool.num_hit_tokens == 0
    pool.free(blocks)
    assert pool.num_free == 8


@given(head=st.lists(st.integers(0, 9), max_size=8), tail=st.lists(st.integers(0, 9), max_size=8),
       start=st.integers(-10, 12), stop=st.integers(-10, 12), step=st.sampled_from([None, 1, 2, -1]))
def test_the_token_view_the_cache_slices_is_prompt_plus_output(head, tail, start, stop, step) -> None:
    from graphrunner.engine.request import TokenChain

    chain, joined = TokenChain(head, tail), head + tail
    assert len(chain) == len(joined) and list(chain) == joined
    assert chain[start:stop:step] == joined[start:stop:step]
    if joined:
        assert chain[start % len(joined)] == joined[start % len(joined)] and chain[-1] == joined[-1]
