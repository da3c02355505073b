"""EAGLE and EAGLE-3 heads in the runner, against plain decoding and constructed exact heads.

Plain decoding is the reference: a speculative run must give exactly its tokens (greedy and
seeded requests, chunked prefill, preemption) with either head at k = 1..4 in every graph
mode (emulated on CPU). A constructed target whose next token is a permutation of the
current one, and heads built to compute that permutation (EAGLE: from the embedding; EAGLE-3:
through attention and the draft-vocabulary map), accept every draft: each decode emits k + 1.
Head folders load as published, and bad ones are refused naming the values.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given

from graphrunner.config import CompilationConfig
from graphrunner.protocol import SamplingParams
from tests.runner_driver import make_runner
from tests.spec_decode.test_spec_decode import (
    BLOCK,
    MAX_MODEL_LEN,
    SIZES,
    VOCAB,
    SpecDriver,
    build,
    drive,
    workloads,
)


def eagle(k: int, method: str = "eagle", **extra) -> dict:
    return {"method": method, "model": f"builtin:{method}-tiny-llama", "num_speculative_tokens": k, **extra}


# Each head at every k and in every graph mode, over eight runners.
EAGLE_RUNNERS = [("NONE", "eagle", 1), ("FULL", "eagle", 2), ("PIECEWISE", "eagle", 3),
                 ("FULL_AND_PIECEWISE", "eagle", 4), ("NONE", "eagle3", 4), ("FULL", "eagle3", 3),
                 ("PIECEWISE", "eagle3", 2), ("FULL_AND_PIECEWISE", "eagle3", 1)]


@pytest.fixture(scope="module")
def runners():
    built = {("NONE", None, 0): build("NONE", None)}
    built.update({(mode, method, k): build(mode, eagle(k, method)) for mode, method, k in EAGLE_RUNNERS})
    return built


@given(workloads())
def test_eagle_tokens_equal_plain_tokens_in_every_mode(runners, case):
    """Greedy and seeded requests, penalties and min_tokens, chunked prefill, preemption."""
    workload, chunk, preemptions = case
    expected, _ = drive(runners[("NONE", None, 0)], workload, chunk)
    for key in EAGLE_RUNNERS:
        got, _ = drive(runners[key], workload, chunk, preemptions)
        assert got == expected, key


def test_the_head_drafts_from_the_targets_features(runners):
    """The drafts are the head's own math: each step's proposals equal a one-shot run of the head
    over the whole history (target features, then its own pre-norm outputs), in a fresh cache."""
    for key in (("FULL", "eagle", 2), ("FULL", "eagle3", 3)):
        runner = runners[key]
        driver = SpecDriver(runner)
        prompt = [random.Random(4).randrange(VOCAB) for _ in range(11)]
        driver.add("a", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        driver.step()  # the prefill, which proposes the first drafts
        drafts = runner.take_draft_token_ids()
        history = prompt + driver.reqs["a"].outputs
        want = _reference_drafts(runner, history, key[2])
        driver.run()
        assert drafts is not None and drafts.draft_token_ids[0] == want, key


def _reference_drafts(runner, history: list[int], k: int) -> list[int]:
    """Target features over `history` (a fresh plain forward), then the head over the whole
    sequence once per draft, in a dense KV cache of its own."""
    from graphrunner.attention.base import AttentionMetadata
    from graphrunner.kv_shape import KVCacheShape

    target, head = runner.model, runner.body.spec.drafter.model
    aux_layers = runner.body.spec.drafter.aux_layers
    n = len(history)
    blocks = -(-(n + k) // BLOCK)

    def meta(t: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, t], dtype=torch.int32), seq_lens=torch.tensor([t], dtype=torch.int32),
            block_table=torch.arange(blocks, dtype=torch.int32)[None], slot_mapping=torch.arange(t),
            num_reqs=1, num_tokens=t, max_query_len=t, max_seq_len=t)

    ids, pos = torch.tensor(history, dtype=torch.int32), torch.arange(n)
    op = target.attention_op_enabled
    target.use_attention_op(False)
    head.use_attention_op(False)
    try:
        caches = KVCacheShape(target.config.num_hidden_layers, BLOCK, target.config.num_key_value_heads,
                              target.config.head_dim, torch.float32).allocate(blocks, torch.device("cpu"))
        out = target(ids, pos, caches, meta(n))
        if aux_layers:  # residual stream entering each feature layer, in the head's order
            local = target.model.local_aux_layers
            feats = head.combine(torch.cat([out[1 + local.index(i)] for i in aux_layers], dim=-1))
        else:
            feats = out
        tokens = history[1:]  # the token after each position
        drafts: list[int] = []
        for _ in range(k):
            t = len(tokens)
            head_cache = KVCacheShape(1, BLOCK, head.config.layer.num_key_value_heads, head.config.layer.head_dim,
                                      torch.float32).allocate(blocks, torch.device("cpu"))
            normed, prenorm = head(torch.tensor(tokens, dtype=torch.int32), torch.arange(t), feats[:t], head_cache,
                                   meta(t))
            draft = int(head.greedy(normed[-1:])[0])
            drafts.append(draft)
            feats = torch.cat([feats[:t], prenorm[-1:]])  # the next position's features: the head's own
            tokens = tokens + [draft]
        return drafts
    finally:
        target.use_attention_op(op)
        head.use_attention_op(op)


# --------------------------------------------------------------------------- exact heads


@torch.no_grad()
def _make_exact(runner, method: str) -> None:
    """Target: layers add nothing (o_proj, down_proj 0), unit final norm, LM head = the embedding
    rows permuted by sigma, so its next token is sigma(current). Head: the same permutation of
    the token it reads (EAGLE: fc picks the embedding; EAGLE-3: attention that sees only the
    current position carries it, its LM head scores a draft vocabulary permuted by tau)."""
    target, head = runner.model, runner.body.spec.drafter.model
    g = torch.Generator().manual_seed(11)
    V, H = target.config.vocab_size, target.config.hidden_size
    sigma = torch.randperm(V, generator=g)
    sigma_inv = torch.argsort(sigma)
    emb = target.model.embed_tokens.weight
    for layer in target.model.local_layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    target.model.norm.weight.fill_(1.0)
    target.lm_head.weight.copy_(emb[sigma_inv])
    layer, attn = head.layer, head.layer.self_attn
    layer.mlp.down_proj.weight.zero_()
    eye = torch.eye(H)
    if method == "eagle":
        head.fc.weight.copy_(torch.cat([eye, torch.zeros(H, H)], dim=1))  # [embedding; features] -> embedding
        attn.o_proj.weight.zero_()
        return
    D, nh, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    alpha = 8.0  # q.k of the current position exceeds any other token's by ~300 logits: one-hot attention
    # The features play no part (the chain is through the tokens): zero after hidden_norm, which
    # is also the residual (norm_before_residual).
    head.fc.weight.zero_()
    head.hidden_norm.weight.zero_()
    for norm in (layer.input_layernorm, head.norm):
        norm.weight.fill_(1.0)
    qkv = torch.zeros_like(attn.qkv_proj.weight)  # [(nh + 2 nkv) D, 2H]
    for h in range(nh):
        qkv[h * D : (h + 1) * D, :D] = alpha * torch.eye(D)
    for g_ in range(nkv):
        qkv[(nh + g_) * D : (nh + g_ + 1) * D, :D] = alpha * torch.eye(D)  # k
        qkv[(nh + nkv + g_) * D : (nh + nkv + g_ + 1) * D, g_ * D : (g_ + 1) * D] = torch.eye(D)  # v: a slice each
    attn.qkv_proj.weight.copy_(qkv)
    o = torch.zeros_like(attn.o_proj.weight)  # [H, nh D]: the first q head of each KV group, back in place
    per_group = nh // nkv
    for g_ in range(nkv):
        h = g_ * per_group
        o[g_ * D : (g_ + 1) * D, h * D : (h + 1) * D] = torch.eye(D)
    attn.o_proj.weight.copy_(o)
    tau = torch.randperm(V, generator=g)[: head.config.draft_vocab_size]
    head.set_draft_map(tau - torch.arange(len(tau)))
    lm = torch.zeros_like(head.lm_head.weight)
    lm[:, : nkv * D] = emb[sigma_inv[tau], : nkv * D]  # draft d scores target id tau(d) = sigma(token)
    head.lm_head.weight.copy_(lm)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_an_exact_head_accepts_every_draft(method, mode):
    k, max_tokens = 3, 13
    comp = (CompilationConfig(enforce_eager=True) if mode == "NONE" else
            CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, compile_backend="eager"))
    spec = eagle(k, method)
    if method == "eagle3":
        spec["model"] = "builtin:eagle3-tiny-llama-full-vocab"
    runner = make_runner(speculative=spec, compilation=comp, max_num_seqs=4, max_num_batched_tokens=32,
                         max_model_len=MAX_MODEL_LEN, block_size=BLOCK, num_blocks=4 * MAX_MODEL_LEN // BLOCK)
    _make_exact(runner, method)
    if mode != "NONE":
        runner.capture_model(progress=False)
    plain = make_runner(compilation=CompilationConfig(enforce_eager=True), max_num_seqs=4,
                        max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN, block_size=BLOCK,
                        num_blocks=4 * MAX_MODEL_LEN // BLOCK)
    plain.model.load_state_dict(runner.model.state_dict())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    workload = [([random.Random(2).randrange(VOCAB) for _ in range(9)], params)]
    want, _ = drive(plain, workload)
    got, steps = drive(runner, workload)
    assert got == want
    assert steps == 1 + -(-(max_tokens - 1) // (k + 1))  # one prefill step, then k + 1 tokens a step


@pytest.fixture(autouse=True, scope="module")
def _full_vocab_head():
    """A built-in target whose EAGLE-3 head scores the whole vocabulary (the exact head needs every id)
    and takes its residual after hidden_norm."""
    from dataclasses import replace
    from types import MappingProxyType

    from graphrunner.models import eagle as eagle_mod
    from graphrunner.models import registry

    builtins, original = registry.BUILTIN_MODELS, eagle_mod.builtin_head_config
    registry.BUILTIN_MODELS = MappingProxyType({**builtins, "builtin:tiny-llama-full-vocab":
                                                replace(builtins["builtin:tiny-llama"])})

    def head_config(model: str):
        config = original(model)
        if not model.endswith("-full-vocab"):
            return config
        # norm_before_residual: the residual is the normed features, which the exact head zeroes.
        return replace(config, draft_vocab_size=config.vocab_size, norm_before_residual=True)

    eagle_mod.builtin_head_config = head_config
    try:
        yield
    finally:
        registry.BUILTIN_MODELS, eagle_mod.builtin_head_config = builtins, original


# --------------------------------------------------------------------------- head folders


def _head_tensors(head) -> dict[str, torch.Tensor]:
    """A head's weights under the names its authors publish (EAGLE-3: `midlayer.`)."""
    layer, attn = head.layer, head.layer.self_attn
    p = "midlayer." if head.eagle3 else "layers.0."
    q, kv = attn.qkv_proj.q_size, attn.qkv_proj.kv_size
    qw, kw, vw = attn.qkv_proj.weight.split([q, kv, kv])
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    out = {"fc.weight": head.fc.weight, p + "self_attn.q_proj.weight": qw, p + "self_attn.k_proj.weight": kw,
           p + "self_attn.v_proj.weight": vw, p + "self_attn.o_proj.weight": attn.o_proj.weight,
           p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
           p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
           p + "mlp.down_proj.weight": layer.mlp.down_proj.weight}
    if head.eagle3:
        out.update({p + "input_layernorm.weight": layer.input_layernorm.weight,
                    p + "hidden_norm.weight": head.hidden_norm.weight, "norm.weight": head.norm.weight,
                    "lm_head.weight": head.lm_head.weight,
                    "d2t": head.draft_to_target - torch.arange(head.config.draft_vocab_size),
                    "t2d": torch.zeros(head.config.vocab_size, dtype=torch.bool)})
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def _write_head(folder, runner, **config_changes) -> str:
    from safetensors.torch import save_file

    head = runner.body.spec.drafter.model
    c = head.config
    raw = {"architectures": ["LlamaForCausalLMEagle3" if head.eagle3 else "LlamaForCausalLM"],
           "hidden_size": c.hidden_size, "intermediate_size": c.layer.intermediate_size, "num_hidden_layers": 1,
           "num_attention_heads": c.layer.num_attention_heads, "num_key_value_heads": c.layer.num_key_value_heads,
           "head_dim": c.layer.head_dim, "rms_norm_eps": c.layer.rms_norm_eps, "rope_theta": c.layer.rope_theta,
           "max_position_embeddings": c.layer.max_position_embeddings, "vocab_size": c.vocab_size,
           "draft_vocab_size": c.draft_vocab_size, **config_changes}
    folder.mkdir()
    tensors = _head_tensors(head)
    if raw.pop("drop_d2t", False):
        del tensors["d2t"]
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_folder_drafts_like_the_head_it_was_saved_from(runners, tmp_path, method):
    source = runners[("NONE", method, 1 if method == "eagle" else 4)]
    folder = _write_head(tmp_path / "head", source)
    k = source.body.spec.k
    loaded = build("NONE", {"method": method, "model": folder, "num_speculative_tokens": k})
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    proposals = []
    for runner in (source, loaded):
        driver = SpecDriver(runner)
        driver.add("a", [5, 9, 2, 7, 5, 9], params)
        driver.step()
        proposals.append(runner.take_draft_token_ids().draft_token_ids)
        driver.run()
    assert proposals[0] == proposals[1]


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 64, "num_attention_heads": 2}, r"hidden_size=64, the target 'builtin:tiny-llama' 128"),
    ({"drop_d2t": True}, r"has no 'd2t' tensor: its draft vocabulary \(1024 ids\)"),
    ({"draft_vocab_size": 4096}, r"draft_vocab_size=4096, larger than the target's vocab_size=2048"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, r"reads the target's layers \[1, 2, 9\]; the target .* has 4"),
    ({"vocab_size": 4096, "draft_vocab_size": 1024}, r"vocab_size=4096, the target 'builtin:tiny-llama' 2048"),
])
def test_a_head_folder_that_does_not_fit_is_refused(runners, tmp_path, change, message):
    folder = _write_head(tmp_path / "bad", runners[("NONE", "eagle3", 4)], **change)
    with pytest.raises(ValueError, match=message):
        build("NONE", {"method": "eagle3", "model": folder, "num_speculative_tokens": 2})


def test_builtin_heads_are_checked_against_the_target():
    with pytest.raises(ValueError, match=r"hidden_size=4096, the target 'builtin:tiny-llama' 128"):
        make_runner(speculative=eagle(2, "eagle3", model="builtin:eagle3-llama-3.1-8b"))
    with pytest.raises(ValueError, match=r"'builtin:eagle3-tiny-llama' is a 'eagle3' head, the method is 'eagle'"):
        make_runner(speculative=eagle(2, "eagle", model="builtin:eagle3-tiny-llama"))
    with pytest.raises(ValueError, match=r"unknown builtin speculator head 'builtin:eagle-nope'"):
        make_runner(speculative=eagle(2, "eagle", model="builtin:eagle-nope"))
    with pytest.raises(ValueError, match=r"method 'eagle3' needs the head's `model`"):
        make_runner(speculative={"method": "eagle3", "num_speculative_tokens": 2})


def test_aux_hidden_states_are_the_inputs_of_the_chosen_layers():
    """The target's feature outputs equal transformers' hidden_states (the input of each layer)."""
    from tests.hf_fixtures import make_hf_model

    runner = make_runner(compilation=CompilationConfig(enforce_eager=True))
    model = runner.model
    hf = make_hf_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, rms_norm_eps=1e-5,
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model.load_weights((name, t.float()) for name, t in hf.state_dict().items())
    model.set_aux_hidden_state_layers([3, 0, 2])
    assert model.model.local_aux_layers == (0, 2, 3)
    ids = torch.tensor([5, 17, 300, 2, 9], dtype=torch.int32)
    from graphrunner.attention.base import AttentionMetadata
    from graphrunner.kv_shape import KVCacheShape

    caches = KVCacheShape(4, 8, 2, 32, torch.float32).allocate(1, torch.device("cpu"))
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([5], dtype=torch.int32),
                             block_table=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.arange(5), num_reqs=1,
                             num_tokens=5, max_query_len=5, max_seq_len=5)
    hidden, *aux = model(ids, torch.arange(5), caches, meta)
    with torch.no_grad():
        ref = hf(ids.long()[None], output_hidden_states=True).hidden_states
    for layer, got in zip((0, 2, 3), aux, strict=True):
        torch.testing.assert_close(got, ref[layer][0].float(), atol=1e-4, rtol=1e-4)
    model.set_aux_hidden_state_layers([])
    assert torch.equal(model(ids, torch.arange(5), caches, meta), hidden)
    with pytest.raises(ValueError, match=r"aux hidden state layers \[4\] outside the model's 4 layers"):
        model.set_aux_hidden_state_layers([4])


@pytest.mark.gpu
def test_eagle_cuda_graphs_match_plain_decoding_on_gpu():
    """Real CUDA graphs (FULL and FULL_AND_PIECEWISE) with the Triton kernels, both heads."""
    from tests.spec_decode.test_spec_decode import PARAMS, repetitive

    rng = random.Random(5)
    workload = [(repetitive(rng, 16) if i % 2 else [rng.randrange(VOCAB) for _ in range(9)], PARAMS[i % len(PARAMS)])
                for i in range(4)]
    expected, _ = drive(build("NONE", None, "cuda"), workload, 8)
    for mode, spec in (("NONE", eagle(3)), ("FULL", eagle(3)), ("FULL_AND_PIECEWISE", eagle(2, "eagle3")),
                       ("FULL", eagle(4, "eagle3")), ("PIECEWISE", eagle(1, "eagle3"))):
        got, _ = drive(build(mode, spec, "cuda"), workload, 8, {3: "r1"})
        assert got == expected, (mode, spec)
