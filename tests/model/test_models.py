"""Llama-family model: Hugging Face parity per architecture, layers, and dummy builtins.

Parity: tiny checkpoints from tests/hf_fixtures.py are loaded by our loader and by
transformers (fp32, CPU, eager attention); a prefill of 12-20 tokens at an arbitrary
position offset must give the same logits within atol 1e-4 / rtol 1e-4.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.config import LoadConfig, ModelConfig
from graphrunner.layers.linear import ColumnLinear, MergedColumnLinear, QKVLinear, RowLinear
from graphrunner.layers.norm import RMSNorm
from graphrunner.layers.rotary import RotaryEmbedding, compute_inv_freq, normalize_rope_scaling
from graphrunner.models import BUILTIN_MODELS, LlamaForCausalLM, load_model, load_model_config
from tests.hf_fixtures import load_hf_model, make_hf_checkpoint

ATOL = RTOL = 1e-4


class DenseCausalBackend:
    """Test-only AttentionBackend: ignores the KV cache and attends causally over the
    whole batch as one request (a prefill), expanding KV heads for GQA."""

    name = "test-dense"

    def forward(self, q, k, v, kv_cache, metadata, scale, out=None):
        # q: [T, H, D]; k, v: [T, Hkv, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
        ).transpose(0, 1)  # [T, H, D]
        if out is None:
            return o
        out.copy_(o)
        return out


def _load(cfg: ModelConfig, load_config: LoadConfig, dtype=torch.float32, device="cpu") -> LlamaForCausalLM:
    return load_model(cfg, load_config, attn_backend=DenseCausalBackend(), dtype=dtype, device=device)


def _run(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Prefill through our model; returns fp32 logits [T, vocab]."""
    n = model.config.num_hidden_layers
    with torch.inference_mode():
        hidden = model(input_ids.to(torch.int32), positions.to(torch.int64), [torch.empty(0)] * n, None)
        return model.compute_logits(hidden)


# ------------------------------------------------------------------------ HF parity

PARITY_CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True}),  # bias on q/k/v and o
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    "llama3": ("llama3", {}),
    "llama3-tied": ("llama3", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2-tied": ("qwen2", {}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", {}),
    "qwen2-moe": ("qwen2_moe", {}),
    "qwen2-moe-sparse-step": ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-unnormalised": ("qwen3_moe", {"norm_topk_prob": False}),
}


@pytest.fixture(scope="module", params=sorted(PARITY_CASES))
def parity_pair(request, tmp_path_factory):
    arch, overrides = PARITY_CASES[request.param]
    path = make_hf_checkpoint(arch, tmp_path_factory.mktemp(request.param), seed=1, **overrides)
    hf = load_hf_model(path)
    cfg = load_model_config(str(path))
    ours = _load(cfg, LoadConfig(model=str(path)))
    return hf, ours


@settings(deadline=None)
@given(num_tokens=st.integers(12, 20), offset=st.integers(0, 1500), seed=st.integers(0, 2**16))
def test_logits_match_hf(parity_pair, num_tokens, offset, seed):
    hf, ours = parity_pair
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, ours.config.vocab_size, (num_tokens,), generator=gen)
    positions = torch.arange(offset, offset + num_tokens)
    with torch.inference_mode():
        ref = hf(input_ids[None], position_ids=positions[None]).logits[0].float()
    got = _run(ours, input_ids, positions)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ref.std() > 0.1, "fixture logits are too flat for the tolerance to mean anything"
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_forward_is_graph_safe_under_dynamo(tmp_path):
    """The forward traces as ONE graph (fullgraph=True): no host syncs, no data-dependent
    Python branching; positions beyond the prompt's length work unchanged."""
    path = make_hf_checkpoint("qwen3", tmp_path, seed=2)
    cfg = load_model_config(str(path))
    model = _load(cfg, LoadConfig(model=str(path)))
    ids, pos = torch.randint(0, cfg.vocab_size, (8,), dtype=torch.int32), torch.arange(3, 11)
    eager = _run(model, ids, pos)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    with torch.inference_mode():
        got = model.compute_logits(compiled(ids, pos, [torch.empty(0)] * cfg.num_hidden_layers, None))
    torch._dynamo.reset()
    torch.testing.assert_close(got, eager)


# --------------------------------------------------------------------------- layers


def _hf_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Independent reference: transformers' own rope init functions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_parameters=params)
    if params["rope_type"] == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")[0]


@settings(deadline=None)
@given(
    head_dim=st.sampled_from([16, 32, 64, 128]),
    theta=st.sampled_from([10000.0, 500000.0, 1e6]),
    rope_type=st.sampled_from(["default", "linear", "llama3"]),
    factor=st.floats(1.0, 64.0),
    low=st.floats(0.5, 2.0),
    high_minus_low=st.floats(0.5, 8.0),
    orig=st.sampled_from([64, 1024, 8192]),
)
def test_inv_freq_matches_hf(head_dim, theta, rope_type, factor, low, high_minus_low, orig):
    scaling = {
        "default": None,
        "linear": {"rope_type": "linear", "factor": factor},
        "llama3": {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": low + high_minus_low,
            "original_max_position_embeddings": orig,
        },
    }[rope_type]
    got = compute_inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(got, _hf_inv_freq(head_dim, theta, scaling), rtol=1e-6, atol=0)


@settings(deadline=None)
@given(positions=st.lists(st.integers(0, 255), min_size=1, max_size=9), seed=st.integers(0, 2**16))
def test_rotary_is_a_rotation_and_relative(positions, seed):
    """Each pair (i, i + D/2) is rotated by angle pos * inv_freq[i]: norms are kept, and
    q.k after rotation depends only on the position difference."""
    rope = RotaryEmbedding(32, 512, 10000.0)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(positions), 2, 32, generator=gen, dtype=torch.float64).float()
    k = q.clone()
    pos = torch.tensor(positions)
    rq, rk = rope(pos, q, k[:, :1])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # Shifting every position by the same amount leaves every q_i . k_j unchanged.
    sq, sk = rope(pos + 100, q, k[:, :1])
    torch.testing.assert_close(rq[:, 0] @ rk[:, 0].T, sq[:, 0] @ sk[:, 0].T, atol=1e-4, rtol=1e-4)
    # Explicit angle check on the first frequency (inv_freq[0] = 1).
    angle = pos.float()
    exp1 = q[:, 0, 0] * angle.cos() - q[:, 0, 16] * angle.sin()
    torch.testing.assert_close(rq[:, 0, 0], exp1, atol=1e-4, rtol=1e-4)


def test_unknown_rope_type_names_it_and_allowed_set():
    with pytest.raises(ValueError, match=r"'yarn'.*allowed.*llama3"):
        normalize_rope_scaling({"rope_type": "yarn", "factor": 2.0}, max_position_embeddings=4096)
    with pytest.raises(ValueError, match=r"'dynamic'.*allowed"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"llama3.*low_freq_factor"):
        normalize_rope_scaling({"rope_type": "llama3", "factor": 8.0}, max_position_embeddings=4096)


@settings(deadline=None)
@given(
    rows=st.integers(1, 6), hidden=st.sampled_from([8, 64]), eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 99)
)
def test_rms_norm_and_fused_add(rows, hidden, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x, r = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    norm = RMSNorm(hidden, eps, dtype=torch.float32)
    norm.weight.copy_(torch.randn(hidden, generator=gen))
    x64 = x.double()
    ref = norm.weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(norm(x), ref.float(), atol=1e-5, rtol=1e-5)
    out, res = norm.add_norm(x, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, norm(x + r))


@settings(deadline=None)
@given(tp=st.sampled_from([1, 2]), tokens=st.integers(1, 5), bias=st.booleans(), seed=st.integers(0, 99))
def test_linear_tp_shards_recombine_to_full(tp, tokens, bias, seed):
    """The tensor-parallel seam: loading each rank's share of the full HF tensors and
    combining rank outputs (concat for column, sum for row) equals the full layer."""
    gen = torch.Generator().manual_seed(seed)
    hidden, d, heads, kv = 16, 4, 4, 2

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    x = rnd(tokens, hidden)
    wq, wk, wv = rnd(heads * d, hidden), rnd(kv * d, hidden), rnd(kv * d, hidden)
    bq, bk, bv = rnd(heads * d), rnd(kv * d), rnd(kv * d)
    wg, wu, wd, bd = rnd(24, hidden), rnd(24, hidden), rnd(hidden, 24), rnd(hidden)
    qs, ks, vs, gs, us, ds = [], [], [], [], [], []
    for rank in range(tp):
        kw = dict(dtype=torch.float32, tp_size=tp, tp_rank=rank)
        qkv = QKVLinear(hidden, d, heads, kv, bias=bias, **kw)
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            assert qkv.checkpoint_shape("weight", sid) == tuple(w.shape)
            qkv.load_shard("weight", w, sid)
            if bias:
                qkv.load_shard("bias", b, sid)
        q, k, v = qkv.split_qkv(qkv(x))
        qs.append(q), ks.append(k), vs.append(v)
        gu = MergedColumnLinear(hidden, [24, 24], **kw)
        gu.load_shard("weight", wg, 0), gu.load_shard("weight", wu, 1)
        g, u = gu(x).chunk(2, dim=-1)
        gs.append(g), us.append(u)
        row = RowLinear(24, hidden, bias=True, all_reduce=(lambda t: t) if tp > 1 else None, **kw)
        row.load_shard("weight", wd), row.load_shard("bias", bd)
        inter = (x @ wg.T)[:, rank * 24 // tp : (rank + 1) * 24 // tp]  # this rank's input columns
        ds.append(row(inter) - bd)  # partial sum; with an identity all_reduce each rank adds the bias
    qb = (lambda b: b) if bias else (lambda b: 0)
    torch.testing.assert_close(torch.cat(qs, 1), (x @ wq.T + qb(bq)).view(tokens, heads, d))
    torch.testing.assert_close(torch.cat(ks, 1), (x @ wk.T + qb(bk)).view(tokens, kv, d))
    torch.testing.assert_close(torch.cat(vs, 1), (x @ wv.T + qb(bv)).view(tokens, kv, d))
    torch.testing.assert_close(torch.cat(gs, 1), x @ wg.T)
    torch.testing.assert_close(torch.cat(us, 1), x @ wu.T)
    torch.testing.assert_close(sum(ds) + bd, (x @ wg.T) @ wd.T + bd, atol=1e-4, rtol=1e-4)


def test_linear_tp_errors_name_values():
    with pytest.raises(ValueError, match="num_kv_heads=2.*tp_size=4"):
        QKVLinear(16, 4, 4, 2, dtype=torch.float32, tp_size=4, tp_rank=0)
    with pytest.raises(ValueError, match="tp_size=2.*all_reduce"):
        RowLinear(8, 8, dtype=torch.float32, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="tp_rank=2"):
        ColumnLinear(8, 8, dtype=torch.float32, tp_size=2, tp_rank=2)


# -------------------------------------------------------------------- dummy builtins


def _scaled_down(cfg: ModelConfig) -> ModelConfig:
    """Same flags (bias, tying, rope scaling, GQA ratio, head_dim; expert count, top-k, shared expert), CPU-sized."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    heads = group  # one KV head
    moe = cfg.moe
    if moe is not None:
        # Narrow experts: at full width qwen3-30b-a3b's 2 layers of 128 experts were 0.6 B fp32 parameters
        # (~8 s to fill and run, mixtral's ~5 s); the routing depends on the count and top-k, kept.
        moe = dataclasses.replace(
            moe, moe_intermediate_size=min(moe.moe_intermediate_size, 64),
            shared_expert_intermediate_size=min(moe.shared_expert_intermediate_size, 128),
        )
    return dataclasses.replace(
        cfg,
        moe=moe,
        vocab_size=1024,
        hidden_size=heads * cfg.head_dim,
        intermediate_size=2 * heads * cfg.head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=1,
        max_position_embeddings=min(cfg.max_position_embeddings, 8192),
        name=cfg.name + "-scaled",
    )


def _check_dummy_model(cfg: ModelConfig, device, dtype, num_tokens: int = 16) -> None:
    model = _load(cfg, LoadConfig(model=cfg.name, load_format="dummy", seed=3), dtype, device)
    assert all(p.device.type == torch.device(device).type and p.dtype == dtype for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=device)
    pos = torch.arange(num_tokens, device=device) + 7
    logits = _run(model, ids, pos)
    assert logits.shape == (num_tokens, cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # Not constant: varies across the vocabulary and across tokens.
    assert logits.std(dim=-1).min() > 0 and (logits[0] - logits[1:]).abs().max() > 0


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_shapes_build_with_dummy_weights_cpu(name):
    cfg = BUILTIN_MODELS[name]
    _check_dummy_model(cfg if name == "builtin:tiny-llama" else _scaled_down(cfg), "cpu", torch.float32)


def test_dummy_weights_are_seeded():
    cfg = BUILTIN_MODELS["builtin:tiny-llama"]

    def params(seed):
        m = _load(cfg, LoadConfig(model=cfg.name, seed=seed))
        return dict(m.named_parameters())

    a, b, c = params(0), params(0), params(1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    norm = a["model.norm.weight"]
    assert (norm - 1).abs().max() < 0.2 and a["model.layers.0.mlp.down_proj.weight"].std() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["builtin:qwen2.5-0.5b", "builtin:llama-3.2-1b"])
def test_builtin_full_size_on_gpu(name):
    _check_dummy_model(BUILTIN_MODELS[name], "cuda", torch.bfloat16, num_tokens=64)


@pytest.mark.gpu
@pytest.mark.slow
def test_builtin_8b_on_gpu():
    _check_dummy_model(BUILTIN_MODELS["builtin:llama-3.1-8b"], "cuda", torch.bfloat16, num_tokens=64)


@pytest.mark.gpu
def test_parity_on_gpu_bf16(tmp_path):
    """Our bf16 CUDA model against HF fp32 on CPU: loose, but catches device/dtype bugs."""
    path = make_hf_checkpoint("llama3", tmp_path, seed=4)
    hf = load_hf_model(path)
    cfg = load_model_config(str(path))
    ours = _load(cfg, LoadConfig(model=str(path)), torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(4)
    ids, pos = torch.randint(0, cfg.vocab_size, (16,), generator=gen), torch.arange(100, 116)
    with torch.inference_mode():
        ref = hf(ids[None], position_ids=pos[None]).logits[0]
    got = _run(ours, ids.cuda(), pos.cuda()).cpu()
    assert math.isfinite(got.abs().max().item())
    # bf16 weights and activations: judge the whole tensor by relative norm (bf16 lands
    # between 1e-3 and 1e-2), not element-wise, where one unlucky logit can exceed any atol.
    rel = ((got.float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel
