"""The fused mixture-of-experts kernels (graphrunner.layers.moe.kernels) against the torch reference.

- `route` against `route_reference`: the same ids (distinct probabilities), weights to fp32 rounding;
  ties go to the lowest expert index.
- `moe_align_block_size` structurally: every valid slot exactly once, each block one expert, the
  sentinel everywhere else, the padded count the sum of the padded group sizes.
- `fused_moe` against `fused_moe_reference` over token counts 1..512, 2..128 experts, top-k 1..8,
  odd hidden and intermediate sizes, with and without an expert map (some experts elsewhere); and
  bitwise determinism, also over a workspace left full of NaN by something else.

CPU: Triton runs interpreted (TRITON_INTERPRET=1 from conftest) in fp32 with small H and I, where the
kernels do the reference's arithmetic up to summation order. GPU (`gpu` mark): bf16 and fp16
natively at Qwen3-30B-A3B and Mixtral shapes, CUDA-graph replay with new routings equal to eager,
and batch-1 decode reading only the active experts' weights.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.moe.reference import fused_moe_reference, route_reference

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:
    from graphrunner.layers.moe.kernels import (
        MoEWorkspace,
        fused_moe,
        max_padded_slots,
        moe_align_block_size,
        moe_config,
        route,
    )

pytestmark = [needs_triton, pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]
ATOL = RTOL = 1e-4  # fp32 under the interpreter: summation order only


def _distinct_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Each row a permutation of 0, 1/8, 2/8, ...: exact in bf16 and fp16 up to 256 experts, and no two
    probabilities of a row tie (they differ by factors of e^(1/8)), so the top-k is unambiguous."""
    rows = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)])
    return (rows.float() / 8).to(dtype)


def _moe_case(num_tokens, num_global, top_k, hidden, inter, num_local, seed, *, dtype=torch.float32,
              device="cpu"):
    """x, w13, w2 (scaled so outputs are O(1)), a routing of distinct experts per token, and an expert map
    placing `num_local` random experts on this rank (None when all are local)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_local, hidden, inter, generator=g) / inter**0.5
    weights, ids = route_reference(torch.randn(num_tokens, num_global, generator=g), top_k, renormalize=True)
    expert_map = None
    if num_local < num_global:
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[torch.randperm(num_global, generator=g)[:num_local]] = torch.randperm(num_local, generator=g).int()
        expert_map = expert_map.to(device)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(device), ids.to(device), expert_map


def _local_ids(ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int) -> torch.Tensor:
    """[T * k] local expert of each slot, -1 where it is not on this rank."""
    local = ids.long().flatten()
    if expert_map is not None:
        local = expert_map.long()[local]
    return torch.where((local >= 0) & (local < num_local), local, -1)


# --------------------------------------------------------------------------- routing


@given(
    num_tokens=st.integers(1, 512),
    num_experts=st.integers(2, 256),
    data=st.data(),
    renormalize=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_route_matches_reference(num_tokens, num_experts, data, renormalize, dtype, seed):
    top_k = data.draw(st.integers(1, min(8, num_experts)), label="top_k")
    logits = _distinct_logits(num_tokens, num_experts, dtype, torch.Generator().manual_seed(seed))
    weights, ids = route(logits, top_k, renormalize)
    weights_ref, ids_ref = route_reference(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(weights, weights_ref, atol=1e-6, rtol=1e-5)


def test_route_ties_go_to_the_lowest_expert():
    logits = torch.zeros(3, 10)
    logits[1, [7, 2, 5]] = 1.0  # three equal maxima: 2, 5, 7 in that order, then 0, 1, ...
    weights, ids = route(logits, 5, renormalize=False)
    assert ids[0].tolist() == [0, 1, 2, 3, 4] and ids[2].tolist() == [0, 1, 2, 3, 4]
    assert ids[1].tolist() == [2, 5, 7, 0, 1]
    torch.testing.assert_close(weights[0], torch.full((5,), 0.1))


def test_route_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k=5 must be in"):
        route(torch.zeros(2, 4), 5, renormalize=True)
    with pytest.raises(ValueError, match="num_experts=300 must be <= 256"):
        route(torch.zeros(2, 300), 2, renormalize=True)


# --------------------------------------------------------------------------- alignment


def _check_alignment(ids, expert_map, num_local, block_m, sorted_slots, block_experts, num_padded):
    num_tokens, top_k = ids.shape
    num_slots = num_tokens * top_k
    sentinel = num_slots
    local = _local_ids(ids, expert_map, num_local).cpu()
    sorted_slots, block_experts = sorted_slots.cpu().long(), block_experts.cpu().long()
    counts = torch.bincount(local[local >= 0], minlength=num_local)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    total = int(padded_counts.sum())
    assert sorted_slots.shape == (max_padded_slots(num_tokens, top_k, num_local, block_m),)
    assert block_experts.shape == (sorted_slots.shape[0] // block_m,)
    assert int(num_padded.item()) == total <= sorted_slots.shape[0]
    # Each group: its expert's slots in ascending order, then the sentinel up to the padded size.
    starts = torch.cumsum(padded_counts, 0) - padded_counts
    for e in range(num_local):
        group = sorted_slots[starts[e]:starts[e] + padded_counts[e]]
        want = torch.nonzero(local == e).flatten()
        assert torch.equal(group[:counts[e]], want)
        assert (group[counts[e]:] == sentinel).all()
        assert (block_experts[starts[e] // block_m:(starts[e] + padded_counts[e]) // block_m] == e).all()
    assert (sorted_slots[total:] == sentinel).all()
    assert (block_experts[total // block_m:] == -1).all()
    # So: every valid slot exactly once, no invalid one, each block a single expert.
    real = sorted_slots[sorted_slots != sentinel]
    assert torch.equal(torch.sort(real).values, torch.nonzero(local >= 0).flatten())


@given(
    num_tokens=st.integers(1, 512),
    num_global=st.integers(1, 128),
    data=st.data(),
    block_m=st.sampled_from([16, 32, 64, 128]),
    seed=st.integers(0, 2**16),
)
def test_alignment_structure(num_tokens, num_global, data, block_m, seed):
    top_k = data.draw(st.integers(1, min(8, num_global)), label="top_k")
    num_local = data.draw(st.integers(1, num_global), label="num_local")
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_global, generator=g)[:top_k] for _ in range(num_tokens)]).int()
    expert_map = None
    if num_local < num_global:
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[torch.randperm(num_global, generator=g)[:num_local]] = torch.arange(num_local, dtype=torch.int32)
    # Buffers full of garbage: every element must be written.
    padded = max_padded_slots(num_tokens, top_k, num_local, block_m)
    out = (torch.full((padded,), 12345, dtype=torch.int32), torch.full((padded // block_m,), 777, dtype=torch.int32),
           torch.full((1,), -5, dtype=torch.int32))
    moe_align_block_size(ids, num_local, block_m, expert_map, out=out)
    _check_alignment(ids, expert_map, num_local, block_m, *out)


@pytest.mark.parametrize("case", ["one_expert", "all_elsewhere", "out_of_range"])
def test_alignment_edge_cases(case):
    ids = torch.full((37, 2), 3, dtype=torch.int32)
    ids[:, 1] = 5
    expert_map = None
    num_local = 8
    if case == "all_elsewhere":
        expert_map = torch.full((8,), -1, dtype=torch.int32)
    if case == "out_of_range":
        ids[::3, 1] = 9  # not a local expert without a map: dropped like an expert elsewhere
    out = moe_align_block_size(ids, num_local, 16, expert_map)
    _check_alignment(ids, expert_map, num_local, 16, *out)


# --------------------------------------------------------------------------- fused MoE


@given(
    num_tokens=st.integers(1, 512),
    num_global=st.integers(2, 128),
    hidden=st.sampled_from([16, 32, 20]),
    inter=st.sampled_from([16, 32, 12]),
    data=st.data(),
    use_workspace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_moe_matches_reference(num_tokens, num_global, hidden, inter, data, use_workspace, seed):
    top_k = data.draw(st.integers(1, min(8, num_global)), label="top_k")
    num_local = data.draw(st.sampled_from([num_global, max(1, num_global // 2), 1]), label="num_local")
    x, w13, w2, weights, ids, expert_map = _moe_case(num_tokens, num_global, top_k, hidden, inter, num_local, seed)
    workspace = None
    if use_workspace:  # larger than needed, sliced by T
        workspace = MoEWorkspace(num_tokens + 7, top_k, num_local, hidden, inter, x.dtype, x.device)
    out = fused_moe(x, w13, w2, weights, ids, expert_map, workspace)
    ref = fused_moe_reference(x, w13, w2, weights, ids, expert_map)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "case",
    ["one_token_top8_of_128", "every_token_on_one_expert", "empty_experts", "all_experts_elsewhere",
     "top1_with_map", "duplicate_experts_in_a_row", "512_tokens_top8_of_128_with_map", "512_tokens_top2_of_8"],
)
def test_fused_moe_explicit_cases(case):
    num_tokens, num_global, top_k, num_local = {
        "one_token_top8_of_128": (1, 128, 8, 128),
        "every_token_on_one_expert": (70, 16, 2, 16),
        "empty_experts": (3, 64, 2, 64),
        "all_experts_elsewhere": (5, 16, 4, 8),
        "top1_with_map": (40, 32, 1, 20),
        "duplicate_experts_in_a_row": (9, 8, 3, 8),
        "512_tokens_top8_of_128_with_map": (512, 128, 8, 96),  # BLOCK_M 32, some experts elsewhere
        "512_tokens_top2_of_8": (512, 8, 2, 8),  # BLOCK_M 128, grouped block order
    }[case]
    x, w13, w2, weights, ids, expert_map = _moe_case(num_tokens, num_global, top_k, 32, 16, num_local, 7)
    if case == "every_token_on_one_expert":
        ids[:, 0] = 11  # slot 0 of every token on expert 11; slot 1 routed as drawn (never 11 again)
        ids[:, 1] = torch.where(ids[:, 1] == 11, 4, ids[:, 1])
    if case == "all_experts_elsewhere":
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    if case == "duplicate_experts_in_a_row":
        ids[:, 2] = ids[:, 0]  # the reference sums the two weights: the same contribution
    out = fused_moe(x, w13, w2, weights, ids, expert_map)
    ref = fused_moe_reference(x, w13, w2, weights, ids, expert_map)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    if case == "all_experts_elsewhere":
        assert torch.equal(out, torch.zeros_like(out))


def _fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] weights -> (float8_e4m3fn codes, [E, N] fp32 row scales), per output row."""
    from graphrunner.layers.fp8 import quantize_weight_fp8

    e, n, k = w.shape
    q, scale = quantize_weight_fp8(w.reshape(e * n, k))
    return q.view(e, n, k), scale.view(e, n)


@given(
    num_tokens=st.integers(1, 96),
    num_global=st.integers(2, 32),
    hidden=st.sampled_from([16, 20]),
    inter=st.sampled_from([16, 12]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_fused_moe_fp8_experts_match_reference(num_tokens, num_global, hidden, inter, data, seed):
    """Weight-only fp8 experts: the kernels convert the codes on load and scale the accumulators per
    output row; the reference dequantizes first. fp32 activations: summation order apart."""
    top_k = data.draw(st.integers(1, min(4, num_global)), label="top_k")
    num_local = data.draw(st.sampled_from([num_global, max(1, num_global // 2)]), label="num_local")
    x, w13, w2, weights, ids, expert_map = _moe_case(num_tokens, num_global, top_k, hidden, inter, num_local, seed)
    (q13, s13), (q2, s2) = _fp8_experts(w13 * 40), _fp8_experts(w2 / 30)  # scales far from 1
    out = fused_moe(x, q13, q2, weights, ids, expert_map, w13_scale=s13, w2_scale=s2)
    ref = fused_moe_reference(x, q13, q2, weights, ids, expert_map, s13, s2)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    plain = fused_moe_reference(x, w13 * 40, w2 / 30, weights, ids, expert_map)
    assert (ref - plain).norm() <= 0.1 * plain.norm() + 1e-6  # e4m3 weights: 2^-4 relative each, at most


def test_fused_moe_fp8_refuses_missing_scales():
    x, w13, w2, weights, ids, _ = _moe_case(4, 8, 2, 16, 16, 8, 0)
    (q13, s13), (q2, s2) = _fp8_experts(w13), _fp8_experts(w2)
    with pytest.raises(ValueError, match="fp8 experts need w13_scale and w2_scale"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="w2_scale has shape"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2[:, :4])


def test_fused_moe_is_deterministic_over_a_dirty_workspace():
    """Bitwise the same result twice, the second time after another user left NaN in every buffer:
    nothing read is left over from before the call."""
    x, w13, w2, weights, ids, expert_map = _moe_case(45, 24, 3, 32, 16, 16, 3)
    workspace = MoEWorkspace(64, 3, 16, 32, 16, x.dtype, x.device)
    first = fused_moe(x, w13, w2, weights, ids, expert_map, workspace)
    workspace.activation.fill_(float("nan"))
    workspace.slot_out.fill_(float("nan"))
    workspace.sorted_slots.fill_(-7)
    workspace.block_experts.fill_(3)
    second = fused_moe(x, w13, w2, weights, ids, expert_map, workspace)
    assert torch.equal(first, second)


def test_fused_moe_rejects_what_does_not_fit():
    x, w13, w2, weights, ids, _ = _moe_case(10, 8, 2, 16, 16, 8, 0)
    small = MoEWorkspace(4, 2, 8, 16, 16, x.dtype, x.device)
    with pytest.raises(ValueError, match="num_tokens=10 exceeds the workspace's max_num_tokens=4"):
        fused_moe(x, w13, w2, weights, ids, workspace=small)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights, ids.long())
    with pytest.raises(ValueError, match="w2 has shape"):
        fused_moe(x, w13, w2[:, :8], weights, ids)
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        MoEWorkspace(4, 9, 16, 16, 16, x.dtype, x.device)


@given(
    num_tokens=st.integers(1, 8192),
    hidden=st.sampled_from([16, 896, 2048, 4096, 7168]),
    inter=st.sampled_from([16, 768, 1408, 14336]),
    num_experts=st.sampled_from([1, 8, 60, 128, 256]),
    top_k=st.integers(1, 8),
)
def test_moe_config_is_sound(num_tokens, hidden, inter, num_experts, top_k):
    """Power-of-two tiles between 16 and the dimension's next power of two, BLOCK_M 16 at decode, and
    pipeline stages that fit the shared-memory budget of two programs per SM."""
    config = moe_config(num_tokens, hidden, inter, num_experts, top_k)
    if num_tokens * top_k <= num_experts:
        assert config.block_m == 16
    for tile, n, k, b_tiles in ((config.gate_up, inter, hidden, 2), (config.down, hidden, inter, 1)):
        for size, dim in ((tile.block_n, n), (tile.block_k, k)):
            assert size >= 16 and size & (size - 1) == 0 and size <= max(16, 1 << (dim - 1).bit_length())
        assert 2 <= tile.num_stages <= 4
        assert (config.block_m + b_tiles * tile.block_n) * tile.block_k * 2 * tile.num_stages <= 2 * 96 * 1024


# --------------------------------------------------------------------------- GPU

QWEN3_30B_A3B = dict(hidden=2048, inter=768, num_experts=128, top_k=8)
MIXTRAL = dict(hidden=4096, inter=14336, num_experts=8, top_k=2)


def _gpu_case(num_tokens, hidden, inter, num_experts, top_k, dtype, seed, num_local=None):
    """Random weights made on the GPU (the Mixtral ones are 2.8 GB in bf16) and router logits without ties."""
    num_local = num_local or num_experts
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device="cuda").to(dtype)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=g, device="cuda") / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_local, hidden, inter, generator=g, device="cuda") / inter**0.5).to(dtype)
    logits = _distinct_logits(num_tokens, num_experts, dtype, torch.Generator().manual_seed(seed)).cuda()
    return x, w13, w2, logits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256, 512])
@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, MIXTRAL], ids=["qwen3-30b-a3b", "mixtral"])
def test_gpu_fused_moe_native(shape, num_tokens, dtype):
    """bf16 / fp16 on CUDA: the kernels (fp32 accumulation, one rounding of the activation and of each
    expert's output) are at least about as close to an fp32 computation as the reference in the same
    dtype (which rounds gate|up and the SiLU product too), and within the dtype's tolerance of it."""
    x, w13, w2, logits = _gpu_case(num_tokens, **shape, dtype=dtype, seed=num_tokens)
    weights, ids = route(logits, shape["top_k"], renormalize=True)
    weights_ref, ids_ref = route_reference(logits, shape["top_k"], renormalize=True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(weights, weights_ref, atol=1e-6, rtol=1e-5)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    exact = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    kernel_err = (out.float() - exact).abs().max().item()
    ref_err = (ref.float() - exact).abs().max().item()
    assert kernel_err <= 1.5 * ref_err + 1e-3, (kernel_err, ref_err)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_gpu_fused_moe_fp8_experts(num_tokens):
    """bf16 activations over fp8 experts at the Qwen3-30B-A3B shape: within bf16's tolerance of the
    reference over the dequantized experts, and as close to its fp32 evaluation as that reference is;
    a CUDA graph of the call replays it bit for bit."""
    x, w13, w2, logits = _gpu_case(num_tokens, **QWEN3_30B_A3B, dtype=torch.bfloat16, seed=num_tokens)
    (q13, s13), (q2, s2) = _fp8_experts(w13.float()), _fp8_experts(w2.float())
    weights, ids = route(logits, QWEN3_30B_A3B["top_k"], renormalize=True)
    out = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    ref = fused_moe_reference(x, q13, q2, weights, ids, None, s13, s2)
    exact = fused_moe_reference(x.float(), q13, q2, weights, ids, None, s13, s2)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert (out.float() - exact).abs().max() <= 1.5 * (ref.float() - exact).abs().max() + 1e-3
    workspace = MoEWorkspace(num_tokens, QWEN3_30B_A3B["top_k"], q13.shape[0], x.shape[1], q2.shape[2], x.dtype,
                             x.device)
    fused_moe(x, q13, q2, weights, ids, None, workspace, s13, s2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe(x, q13, q2, weights, ids, None, workspace, s13, s2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


@pytest.mark.gpu
@pytest.mark.parametrize("num_local", [128, 48])
def test_gpu_graph_replay_with_new_routings_equals_eager(num_local):
    """One capture at T = 8 (route + fused_moe over a shared workspace) replayed with new router logits
    gives bitwise the eager result each time: nothing in the graph depends on the routing it saw."""
    from tests.cuda_graphs import capture_cuda_graph

    shape = QWEN3_30B_A3B
    num_tokens, top_k = 8, shape["top_k"]
    x, w13, w2, logits = _gpu_case(num_tokens, **shape, dtype=torch.bfloat16, seed=1, num_local=num_local)
    expert_map = None
    if num_local < shape["num_experts"]:
        g = torch.Generator().manual_seed(2)
        expert_map = torch.full((shape["num_experts"],), -1, dtype=torch.int32)
        expert_map[torch.randperm(shape["num_experts"], generator=g)[:num_local]] = torch.arange(
            num_local, dtype=torch.int32)
        expert_map = expert_map.cuda()
    workspace = MoEWorkspace(64, top_k, num_local, shape["hidden"], shape["inter"], torch.bfloat16, "cuda")
    result = {}

    def step():
        weights, ids = route(logits, top_k, renormalize=True)
        result["out"] = fused_moe(x, w13, w2, weights, ids, expert_map, workspace)

    graph = capture_cuda_graph(step)
    graph_out = result["out"]
    for seed in range(5):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        new_logits = torch.randn(logits.shape, generator=g, device="cuda")
        if seed == 4:
            new_logits[:, 0] += 100.0  # every token's top choice on one expert
        logits.copy_(new_logits.to(logits.dtype))
        graph.replay()
        weights, ids = route(logits, top_k, renormalize=True)
        eager = fused_moe(x, w13, w2, weights, ids, expert_map, workspace)
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager)
        ref = fused_moe_reference(x, w13, w2, weights, ids, expert_map)
        torch.testing.assert_close(graph_out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_decode_reads_only_the_active_experts():
    """Batch-1 decode at Qwen3-30B-A3B shapes is bound by the bytes of its 8 experts: replayed from a
    graph, it moves them at well over 1 TB/s. Reading every expert (16x the bytes) could not reach
    0.35 TB/s in those terms even at an H200's 4.8 TB/s."""
    from tests.cuda_graphs import capture_cuda_graph

    shape = QWEN3_30B_A3B
    x, w13, w2, logits = _gpu_case(1, **shape, dtype=torch.bfloat16, seed=5)
    workspace = MoEWorkspace(1, shape["top_k"], shape["num_experts"], shape["hidden"], shape["inter"],
                             torch.bfloat16, "cuda")

    def step():
        weights, ids = route(logits, shape["top_k"], renormalize=True)
        fused_moe(x, w13, w2, weights, ids, workspace=workspace)

    graph = capture_cuda_graph(step)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 50
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / replays
    active_bytes = shape["top_k"] * (w13[0].numel() + w2[0].numel()) * 2
    rate = active_bytes / seconds
    assert rate > 1.0e12, f"{seconds * 1e6:.1f} us per layer, {rate / 1e12:.2f} TB/s of the active experts"


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_gpu_pdl_chain_equals_plain_launches(num_tokens):
    """Routing and the four expert launches with programmatic dependent launch (each starting while
    the one before drains) give bitwise the plain launches' output, eagerly and replayed from a CUDA
    graph over a shared workspace, with a slow producer of the router logits just before them."""
    from tests.cuda_graphs import capture_cuda_graph

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    shape = QWEN3_30B_A3B
    x, w13, w2, logits = _gpu_case(num_tokens, **shape, dtype=torch.bfloat16, seed=7)
    workspace = MoEWorkspace(8, shape["top_k"], shape["num_experts"], shape["hidden"], shape["inter"],
                             torch.bfloat16, "cuda")
    source = logits.clone()

    def step(pdl_rows):
        logits.copy_(source * 1.0)  # an ATen producer of what the first PDL launch reads
        weights, ids = route(logits, shape["top_k"], True, pdl_rows)
        return fused_moe(x, w13, w2, weights, ids, None, workspace, pdl_rows=pdl_rows)

    plain = step(0).clone()
    assert torch.equal(step(8), plain)
    result = {}
    graph = capture_cuda_graph(lambda: result.__setitem__("out", step(8)))
    for seed in range(3):
        source.copy_(torch.randn(source.shape, generator=torch.Generator(device="cuda").manual_seed(seed),
                                 device="cuda").to(source.dtype))
        graph.replay()
        expected = step(0)
        torch.cuda.synchronize()
        assert torch.equal(result["out"], expected)
