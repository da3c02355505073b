"""row_params.gather_row_params: the one-launch gather of a sampled step's per-row settings and
keys against the torch gathers and rng.row_keys, bit for bit (under the Triton interpreter on
CPU, with int32 and int64 idx_mapping, repeated and unordered rows; natively on GPU, inside a
CUDA graph)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample import rng
from graphrunner.sample.row_params import gather_row_params
from graphrunner.state.sampling import SamplingStates
from tests.cuda_graphs import capture_cuda_graph


def _states(num_rows: int, device: str, seed: int) -> SamplingStates:
    states = SamplingStates(num_rows, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    states.temperature.copy_(torch.rand(num_rows, generator=g) * 2)
    states.top_k.copy_(torch.randint(0, 1000, (num_rows,), generator=g, dtype=torch.int32))
    states.top_p.copy_(torch.rand(num_rows, generator=g))
    states.min_p.copy_(torch.rand(num_rows, generator=g))
    states.seed.copy_(torch.randint(-(2**63), 2**63 - 1, (num_rows,), generator=g, dtype=torch.int64))
    return states


def _expected(states: SamplingStates, idx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    rows = idx.long()
    return (states.temperature[rows], rng.row_keys(states.seed[rows], positions.long()), states.top_k[rows],
            states.top_p[rows], states.min_p[rows])


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")
@given(num_rows=st.integers(1, 20), data=st.data(), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_kernel_equals_the_torch_gathers(num_rows, data, dtype):
    states = _states(num_rows, "cpu", num_rows)
    n = data.draw(st.integers(1, 300))
    idx = torch.tensor(data.draw(st.lists(st.integers(0, num_rows - 1), min_size=n, max_size=n)), dtype=dtype)
    positions = torch.tensor(data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), dtype=torch.int32)
    got = gather_row_params(states, idx, positions, kernel=True)
    for a, b in zip(got, _expected(states, idx, positions), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    torch_path = gather_row_params(states, idx, positions, kernel=False)
    assert all(torch.equal(a, b) for a, b in zip(got, torch_path, strict=True))


@pytest.mark.gpu
def test_gpu_kernel_matches_and_replays_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    states = _states(1000, "cuda", 0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 1000, (256,), generator=g, dtype=torch.int32).cuda()
    positions = torch.randint(0, 2**31 - 1, (256,), generator=g).cuda()
    outs = [torch.empty_like(t) for t in _expected(states, idx, positions)]
    graph = capture_cuda_graph(lambda: [o.copy_(t) for o, t in zip(outs, gather_row_params(states, idx, positions),
                                                                     strict=True)])
    positions.add_(1)
    idx.copy_(idx.flip(0))  # new inputs, same addresses
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, t) for o, t in zip(outs, _expected(states, idx, positions), strict=True))
