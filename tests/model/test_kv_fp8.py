"""fp8 KV cache (`kv_cache_dtype="fp8"`): quantizing writes, dequantizing attention, scales, sizing.

The contract: the KV write stores `clamp(x / scale, -448, 448)` rounded to float8_e4m3fn, and
every attention path over that cache equals the same path over a cache holding the dequantized
values `element * scale` (fp32) exactly. CPU: the torch reference and the Triton kernels
interpreted on tiny shapes; the whole model against its unquantized run and across graph
modes. GPU (`gpu` mark): an fp32 model with fp8 KV, FULL graphs against eager, and the bf16 Triton
kernels against the torch reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.attention.torch_ref import (
    FP8_KV_DTYPE,
    TorchReferenceBackend,
    paged_attention_torch,
    quantize_kv_torch,
    rope_write_kv_torch,
    write_kv_torch,
)
from graphrunner.config import KV_CACHE_DTYPES, CacheConfig, kv_cache_dtype
from graphrunner.kernels import HAS_TRITON
from graphrunner.kv_shape import KVCacheShape
from graphrunner.layers.rotary import RotaryEmbedding
from tests.model.test_attention import DEVICE, expected_cache, heads, make_batch, request_lists

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:
    from graphrunner.attention.kv_write import rope_write_kv_triton, write_kv_triton
    from graphrunner.attention.triton_attn import RopeKV, paged_attention_triton

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# Scales a checkpoint may carry: 1.0 (no calibration), powers of two and arbitrary values, small
# ones that push |x| / scale past 448 (the clamp) and large ones that push values into subnormals.
scales = st.sampled_from([1.0, 0.5, 0.37, 0.01, 2.0, 3.1, 40.0])


def _quantize_cache(cache: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """A [2, ...] cache's K half / k_scale and V half / v_scale as e4m3 (the write's formula)."""
    return torch.stack([quantize_kv_torch(cache[0], kv_scale[0]), quantize_kv_torch(cache[1], kv_scale[1])])


def _dequantize(cache: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """fp32 `element * scale`: the cache every fp8 reader sees."""
    return torch.stack([cache[0].float() * kv_scale[0], cache[1].float() * kv_scale[1]])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8_KV_DTYPE and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _fp8_batch(reqs, hk, block_size, pad_reqs, pad_tokens, seed, k_scale, v_scale, magnitude=4.0):
    """A test_attention batch whose context (and SENTINEL slots) sit quantized in an fp8 cache; its new
    k/v scaled by `magnitude` so that small scales reach the clamp."""
    num_heads, num_kv_heads = hk
    batch = make_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=block_size,
                       pad_reqs=pad_reqs, pad_tokens=pad_tokens, dtype=torch.float32, device=DEVICE, seed=seed)
    batch.k.mul_(magnitude)
    batch.v.mul_(magnitude)
    kv_scale = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=DEVICE)
    return batch, kv_scale, _quantize_cache(batch.kv_cache, kv_scale)


# --------------------------------------------------------------------------- the KV write


@settings(deadline=None)
@given(reqs=request_lists(max_reqs=3, max_ctx=8, max_qlen=6, max_tokens=12), hk=heads,
       block_size=st.sampled_from([1, 4]), pad_tokens=st.integers(0, 2), k_scale=scales, v_scale=scales,
       seed=st.integers(0, 2**16))
def test_write_quantizes_value_over_scale_clamped(reqs, hk, block_size, pad_tokens, k_scale, v_scale, seed):
    """The torch write and the Triton write store the same bytes: each live token's k / k_scale and
    v / v_scale clamped to +-448 in e4m3, nothing at slot -1 or elsewhere."""
    batch, kv_scale, cache = _fp8_batch(reqs, hk, block_size, 0, pad_tokens, seed, k_scale, v_scale, magnitude=300.0)
    slots = batch.metadata.slot_mapping
    want = _quantize_cache(expected_cache(batch), kv_scale)
    got = cache.clone()
    write_kv_torch(batch.k, batch.v, got, slots, kv_scale)
    assert _same_bytes(got, want)
    assert (got.float().abs() <= 448).all()  # the clamp: no NaN from an overflowing cast
    if HAS_TRITON:
        got_triton = cache.clone()
        write_kv_triton(batch.k, batch.v, got_triton, slots, kv_scale)
        assert _same_bytes(got_triton, want)


@needs_triton
@settings(deadline=None)
@given(reqs=request_lists(max_reqs=3, max_ctx=8, max_qlen=6, max_tokens=12), hk=heads,
       k_scale=scales, v_scale=scales, seed=st.integers(0, 2**16))
def test_rope_write_quantizes_like_the_reference(reqs, hk, k_scale, v_scale, seed):
    """The rotary + KV-write kernel quantizes the rotated key exactly as the torch rotation + write."""
    batch, kv_scale, cache = _fp8_batch(reqs, hk, 4, 0, 1, seed, k_scale, v_scale)
    positions = torch.randint(0, 32, (batch.q.shape[0],), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    cos_sin = RotaryEmbedding(16, 32, 10000.0, device=DEVICE).cos_sin_cache
    slots = batch.metadata.slot_mapping
    ref, got = cache.clone(), cache.clone()
    q_ref = rope_write_kv_torch(batch.q, batch.k, batch.v, positions, cos_sin, ref, slots, kv_scale)
    q_got = rope_write_kv_triton(batch.q, batch.k, batch.v, positions, cos_sin, got, slots, kv_scale=kv_scale)
    assert _same_bytes(got, ref)
    assert torch.equal(q_got, q_ref)


def test_write_without_scales_is_scale_one():
    batch, one, cache = _fp8_batch([(2, 3)], (2, 1), 4, 0, 0, 0, 1.0, 1.0)
    a, b = cache.clone(), cache.clone()
    write_kv_torch(batch.k, batch.v, a, batch.metadata.slot_mapping)
    write_kv_torch(batch.k, batch.v, b, batch.metadata.slot_mapping, one)
    assert _same_bytes(a, b)


# --------------------------------------------------------------------------- attention


@settings(deadline=None)
@given(reqs=request_lists(max_reqs=3, max_ctx=20, max_qlen=8, max_tokens=16), hk=heads,
       block_size=st.sampled_from([1, 4, 16]), pad_reqs=st.integers(0, 1), pad_tokens=st.integers(0, 2),
       k_scale=scales, v_scale=scales, seed=st.integers(0, 2**16))
def test_torch_reference_attends_over_the_dequantized_cache(reqs, hk, block_size, pad_reqs, pad_tokens, k_scale,
                                                            v_scale, seed):
    """Write + attend on the fp8 cache equals attention on an fp32 cache holding the dequantized
    values, bit for bit (the same fp32 arithmetic after the same loads)."""
    batch, kv_scale, cache = _fp8_batch(reqs, hk, block_size, pad_reqs, pad_tokens, seed, k_scale, v_scale)
    md = batch.metadata
    out = TorchReferenceBackend().forward(batch.q, batch.k, batch.v, cache, md, 0.3, out=torch.empty_like(batch.q),
                                          kv_scale=kv_scale)
    assert _same_bytes(cache, _quantize_cache(expected_cache(batch), kv_scale))
    ref = paged_attention_torch(batch.q, _dequantize(cache, kv_scale), md, 0.3, torch.empty_like(batch.q))
    assert torch.equal(out, ref)


@needs_triton
@settings(deadline=None)
@given(reqs=request_lists(max_reqs=3, max_ctx=20, max_qlen=8, max_tokens=12), hk=heads,
       block_size=st.sampled_from([1, 4, 16]), pad_reqs=st.integers(0, 1), pad_tokens=st.integers(0, 2),
       splits=st.sampled_from([1, 2]), decode_grid=st.booleans(), with_lse=st.booleans(), k_scale=scales,
       v_scale=scales, seed=st.integers(0, 2**16))
def test_triton_attends_over_the_dequantized_cache(reqs, hk, block_size, pad_reqs, pad_tokens, splits, decode_grid,
                                                   with_lse, k_scale, v_scale, seed):
    """fp32 (interpreted on a CPU): the Triton kernel over the fp8 cache equals the same kernel over the
    dequantized fp32 cache exactly (outputs and LSE), and the torch reference up to summation order."""
    batch, kv_scale, cache = _fp8_batch(reqs, hk, block_size, pad_reqs, pad_tokens, seed, k_scale, v_scale)
    md = batch.metadata
    write_kv_triton(batch.k, batch.v, cache, md.slot_mapping, kv_scale)
    deq = _dequantize(cache, kv_scale)
    T, H = batch.q.shape[:2]
    lse_got, lse_ref = (torch.empty(T, H, device=DEVICE) for _ in range(2)) if with_lse else (None, None)
    kw = dict(num_kv_splits=splits, decode_grid=decode_grid)
    got = paged_attention_triton(batch.q, cache, md, 0.3, torch.empty_like(batch.q), lse_got, kv_scale=kv_scale, **kw)
    ref = paged_attention_triton(batch.q, deq, md, 0.3, torch.empty_like(batch.q), lse_ref, **kw)
    assert torch.equal(got, ref)
    if with_lse:
        assert torch.equal(lse_got, lse_ref)
    torch_ref = paged_attention_torch(batch.q, cache, md, 0.3, torch.empty_like(batch.q), kv_scale=kv_scale)
    torch.testing.assert_close(got, torch_ref, rtol=2e-5, atol=2e-5)


@needs_triton
@settings(deadline=None)
@given(reqs=request_lists(max_reqs=3, max_ctx=12, max_qlen=1, max_tokens=3), hk=heads,
       splits=st.sampled_from([1, 2]), k_scale=scales, v_scale=scales, seed=st.integers(0, 2**16))
def test_fused_rope_write_attend_quantizes_and_dequantizes(reqs, hk, splits, k_scale, v_scale, seed):
    """The decode launch that rotates, writes and attends (RopeKV) stores the bytes the torch
    rotation + write stores, and attends like the plain launch over that cache."""
    batch, kv_scale, cache = _fp8_batch(reqs, hk, 4, 0, 1, seed, k_scale, v_scale)
    md = batch.metadata
    positions = torch.tensor([c for c, _ in batch.reqs] + [0], dtype=torch.int64, device=DEVICE)
    cos_sin = RotaryEmbedding(16, 64, 10000.0, device=DEVICE).cos_sin_cache
    slots = md.slot_mapping
    ref_cache = cache.clone()
    q_rot = rope_write_kv_torch(batch.q, batch.k, batch.v, positions, cos_sin, ref_cache, slots, kv_scale)
    ref = paged_attention_triton(q_rot, ref_cache, md, 0.3, torch.empty_like(batch.q), num_kv_splits=splits,
                                 kv_scale=kv_scale)
    got = paged_attention_triton(batch.q, cache, md, 0.3, torch.empty_like(batch.q), num_kv_splits=splits,
                                 rope_kv=RopeKV(batch.k, batch.v, positions, cos_sin, slots), kv_scale=kv_scale)
    assert _same_bytes(cache, ref_cache)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bad_scale_tensor_is_refused():
    batch, _, cache = _fp8_batch([(2, 1)], (2, 1), 4, 0, 0, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="kv_scale is torch.float64"):
        write_kv_torch(batch.k, batch.v, cache, batch.metadata.slot_mapping,
                       torch.ones(2, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"float32 \[2\]"):
        paged_attention_torch(batch.q, cache, batch.metadata, 0.3, torch.empty_like(batch.q),
                              kv_scale=torch.ones(3, device=DEVICE))


# --------------------------------------------------------------------------- config and sizing


def test_cache_dtype_values_and_error():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.float32) == FP8_KV_DTYPE
    for bad in ("fp16", "int8", "fp8_e5m2", "FP8"):
        with pytest.raises(ValueError, match=rf"cache_dtype={bad!r} is not supported; allowed: \['auto', 'fp8', "
                                             r"'fp8_e4m3'\]"):
            CacheConfig(cache_dtype=bad)


def test_llm_refuses_a_bad_kv_cache_dtype_before_loading():
    from graphrunner import LLM

    with pytest.raises(ValueError, match="cache_dtype='int4'"):
        LLM("builtin:tiny-llama", device="cpu", kv_cache_dtype="int4", num_kv_blocks=8, max_model_len=32)


def test_cli_choices_are_the_config_values():
    from graphrunner.cli_args import KV_CACHE_DTYPE_CHOICES

    assert tuple(KV_CACHE_DTYPE_CHOICES) == KV_CACHE_DTYPES


def test_same_budget_holds_twice_the_blocks():
    from graphrunner.kv_cache import determine_num_kv_blocks

    budget = 3 << 20
    counts = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_KV_DTYPE)):
        shape = KVCacheShape(4, 16, 2, 64, dtype)
        counts[name] = determine_num_kv_blocks(
            shape, CacheConfig(cpu_kv_cache_bytes=budget), None, torch.device("cpu"),  # type: ignore[arg-type]
            max_blocks=10**6, max_num_blocks_per_req=1, max_model_len=16, agree=lambda n: n)
    assert counts["fp8"] == 2 * counts["bf16"] == 2 * (budget // (2 * 4 * 16 * 2 * 64 * 2))
    assert KVCacheShape(4, 16, 2, 64, FP8_KV_DTYPE).element_size == 1


# --------------------------------------------------------------------------- the whole model

PROMPTS = [[(i * 37 + j * 11) % 1900 + 5 for j in range(9 + 5 * i)] for i in range(4)]
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              block_size=4, num_kv_blocks=64, seed=0)


def _run(kv_cache_dtype: str, mode: str = "NONE", max_tokens: int = 8):
    from graphrunner import LLM, SamplingParams

    graphs = (dict(enforce_eager=True) if mode == "NONE" else
              dict(enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=(1, 2, 4, 8, 16),
                   compile_backend="eager"))
    llm = LLM("builtin:tiny-llama", kv_cache_dtype=kv_cache_dtype, **ENGINE, **graphs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    result = [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
              for o in outs]
    return llm, result


@pytest.fixture(scope="module")
def eager_fp8():
    return _run("fp8")


def test_model_fp8_tokens_are_close_to_the_unquantized_run(eager_fp8):
    """Dummy weights give near-uniform logits (logprobs about -6.9 over 2048 tokens), so later tokens
    may flip on near-ties; the first token and every agreeing token's logprob stay close."""
    llm, fp8 = eager_fp8
    assert all(c.dtype == FP8_KV_DTYPE for c in llm.runner.buffers.kv_caches)
    _, full = _run("auto")
    for (tokens, lps), (ref_tokens, ref_lps) in zip(fp8, full, strict=True):
        assert tokens[0] == ref_tokens[0]
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), len(tokens))
        for lp, ref_lp in zip(lps[:agree], ref_lps[:agree], strict=True):
            assert abs(lp - ref_lp) < 0.05  # the same token's logprob, through quantized K and V


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_model_fp8_graph_modes_equal_eager(eager_fp8, mode):
    """The same quantized arithmetic in every mode: FULL (emulated on a CPU) and PIECEWISE (the
    compiled pieces pass the layers' kv_scale buffers to the attention op) give eager's tokens."""
    _, want = eager_fp8
    _, got = _run("fp8", mode)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lps), (_, ref) in zip(got, want, strict=True):
        assert lps == pytest.approx(ref, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "model": "builtin:tiny-llama", "num_speculative_tokens": 2},
    {"method": "eagle3", "model": "builtin:eagle3-tiny-llama", "num_speculative_tokens": 2},
])
def test_speculative_drafters_store_their_kv_in_fp8_too(eager_fp8, spec):
    """A draft model's or EAGLE head's cache follows the target's dtype, and greedy verification
    keeps the fp8 run's tokens."""
    from graphrunner import LLM, SamplingParams

    _, want = eager_fp8
    llm = LLM("builtin:tiny-llama", kv_cache_dtype="fp8", speculative_config=spec, enforce_eager=True, **ENGINE)
    assert llm.runner.buffers.draft_kv_caches and all(
        c.dtype == FP8_KV_DTYPE for c in llm.runner.buffers.draft_kv_caches)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [t for t, _ in want]


# --------------------------------------------------------------------------- checkpoint scales


def _add_tensors(folder, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(str(path))
    weights.update(tensors)
    save_file(weights, str(path))


def test_scales_load_from_a_checkpoint(tmp_path):
    from graphrunner import LLM
    from tests.hf_fixtures import make_hf_checkpoint

    folder = make_hf_checkpoint("llama", tmp_path / "ckpt", seed=3)
    _add_tensors(folder, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
        "model.layers.1.self_attn.attn.k_scale": torch.tensor(2.0, dtype=torch.bfloat16),  # compressed-tensors form
        "model.layers.1.self_attn.q_scale": torch.tensor(3.0),  # accepted, unused
    })
    from graphrunner import SamplingParams

    args = dict(device="cpu", num_kv_blocks=16, max_model_len=32, block_size=4, skip_tokenizer_init=True)
    llm = LLM(str(folder), kv_cache_dtype="fp8", **args)
    layers = llm.runner.model.model.layers
    assert layers[0].self_attn.kv_scale.tolist() == [0.25, 0.5]
    assert layers[1].self_attn.kv_scale.tolist() == [2.0, 1.0]  # v_scale absent: 1.0
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(3, 12))], params, use_tqdm=False)
    plain = LLM(str(folder), **args)
    plain.generate([list(range(3, 12))], params, use_tqdm=False)
    # Layer 0's cache holds the keys over 0.25 and the values over 0.5: times the scales, they are
    # the unquantized run's within e4m3's precision (half a step: 1/16 relative).
    want = plain.runner.buffers.kv_caches[0]
    written = want != 0
    got = _dequantize(llm.runner.buffers.kv_caches[0], torch.tensor([0.25, 0.5]))
    assert written.sum() > 0
    torch.testing.assert_close(got[written], want[written], rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("name, value, match", [
    ("model.layers.0.self_attn.k_scale", torch.tensor(-1.0), "must be a finite number > 0"),
    ("model.layers.0.self_attn.v_scale", torch.ones(4), r"expected one floating point number"),
    ("model.layers.7.self_attn.k_scale", torch.tensor(1.0), "names layer 7 of a model with 2 layers"),
])
def test_bad_checkpoint_scales_are_named(tmp_path, name, value, match):
    from graphrunner.models.loader import CheckpointError
    from tests.hf_fixtures import make_hf_checkpoint

    folder = make_hf_checkpoint("llama", tmp_path / "ckpt", seed=3)
    _add_tensors(folder, {name: value})
    from graphrunner.config import LoadConfig
    from graphrunner.models import load_model, load_model_config

    with pytest.raises(CheckpointError, match=match) as err:
        load_model(load_model_config(str(folder)), LoadConfig(model=str(folder)), attn_backend=TorchReferenceBackend(),
                   dtype=torch.float32, device="cpu")
    assert name in str(err.value)


def test_both_scale_names_for_one_layer_are_refused(tmp_path):
    from graphrunner.config import LoadConfig
    from graphrunner.models import load_model, load_model_config
    from graphrunner.models.loader import CheckpointError
    from tests.hf_fixtures import make_hf_checkpoint

    folder = make_hf_checkpoint("llama", tmp_path / "ckpt", seed=3)
    _add_tensors(folder, {"model.layers.0.self_attn.k_scale": torch.tensor(1.0),
                          "model.layers.0.self_attn.attn.k_scale": torch.tensor(1.0)})
    with pytest.raises(CheckpointError, match="repeats"):
        load_model(load_model_config(str(folder)), LoadConfig(model=str(folder)), attn_backend=TorchReferenceBackend(),
                   dtype=torch.float32, device="cpu")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_model_fp8_kv_full_graphs_equal_eager():
    """fp32 activations, so eager and graphs must agree token for token (bf16 greedy decoding of
    dummy weights meets near-ties that summation order decides); the bf16 kernels are compared with
    the torch reference below."""
    from graphrunner import LLM, SamplingParams

    args = dict(device="cuda", dtype="float32", kv_cache_dtype="fp8", max_num_seqs=8, max_num_batched_tokens=256,
                max_model_len=256, num_kv_blocks=128, seed=0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 31 + j * 7) % 30000 + 5 for j in range(20 + 9 * i)] for i in range(6)]
    eager = LLM("builtin:qwen2.5-0.5b", enforce_eager=True, **args)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    full = LLM("builtin:qwen2.5-0.5b", enforce_eager=False, cudagraph_mode="FULL", **args)
    assert all(c.dtype == FP8_KV_DTYPE for c in full.runner.buffers.kv_caches)
    got = [o.outputs[0].token_ids for o in full.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_triton_fp8_matches_the_torch_reference(splits):
    """bf16 queries over an fp8 cache on the GPU: the Triton write stores the torch write's bytes;
    the Triton attention is the torch reference's (fp32) within bf16's dot tolerance."""
    torch.manual_seed(0)
    reqs = [(300, 1), (17, 1), (0, 40), (90, 12)]
    batch = make_batch(reqs, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16,
                       device="cuda", seed=1)
    kv_scale = torch.tensor([0.02, 0.05], device="cuda")
    cache = _quantize_cache(batch.kv_cache, kv_scale)
    md = batch.metadata
    ref_cache = cache.clone()
    write_kv_torch(batch.k, batch.v, ref_cache, md.slot_mapping, kv_scale)
    write_kv_triton(batch.k, batch.v, cache, md.slot_mapping, kv_scale)
    assert _same_bytes(cache, ref_cache)
    got = paged_attention_triton(batch.q, cache, md, 0.088, torch.empty_like(batch.q), num_kv_splits=splits,
                                 kv_scale=kv_scale)
    ref = paged_attention_torch(batch.q, cache, md, 0.088, torch.empty_like(batch.q), kv_scale=kv_scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
