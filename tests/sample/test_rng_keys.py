"""rng_keys.row_keys_triton against rng.row_keys (the torch reference), bit for bit: under the
Triton interpreter on CPU (hypothesis over the whole int64 seed range, with and without the row
gather) and natively on GPU, where it also replays inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample import rng
from graphrunner.sample.rng_keys import row_keys, row_keys_triton
from tests.cuda_graphs import capture_cuda_graph

int64s = st.integers(-(2**63), 2**63 - 1)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")


@needs_triton
@given(st.lists(st.tuples(int64s, st.integers(0, 2**31 - 1)), min_size=1, max_size=300), st.data())
def test_kernel_equals_the_torch_keys(rows, data):
    seeds = torch.tensor([s for s, _ in rows], dtype=torch.int64)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int32)
    assert torch.equal(row_keys_triton(seeds, positions), rng.row_keys(seeds, positions.long()))
    index = torch.tensor(data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=len(rows), max_size=len(rows))))
    assert torch.equal(row_keys_triton(seeds, positions, index), rng.row_keys(seeds[index], positions.long()))


def test_cpu_dispatch_is_the_torch_reference():
    seeds = torch.tensor([3, -5, 2**40], dtype=torch.int64)
    positions, index = torch.tensor([0, 7, 9]), torch.tensor([2, 2, 0])
    assert torch.equal(row_keys(seeds, positions, index), rng.row_keys(seeds[index], positions))
    assert row_keys_triton(seeds, positions[:0]).shape == (0,)


@pytest.mark.gpu
def test_gpu_kernel_matches_and_replays_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (1000,), generator=g, dtype=torch.int64).cuda()
    positions = torch.randint(0, 2**31 - 1, (256,), generator=g).cuda()
    index = torch.randint(0, 1000, (256,), generator=g).cuda()
    expected = rng.row_keys(seeds[index], positions)
    assert torch.equal(row_keys(seeds, positions, index), expected)
    out = torch.empty_like(expected)
    graph = capture_cuda_graph(lambda: out.copy_(row_keys(seeds, positions, index)))
    positions.add_(1)  # new inputs, same addresses
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rng.row_keys(seeds[index], positions))
