"""Config parsing and weight loading: key variants, sharding, completeness, error messages."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.config import LoadConfig
from graphrunner.layers.moe.layer import FusedMoE
from graphrunner.models import (
    BUILTIN_MODELS,
    SUPPORTED_ARCHITECTURES,
    LlamaForCausalLM,
    checkpoint_dtype,
    is_builtin,
    iter_checkpoint_weights,
    load_model,
    load_model_config,
)
from graphrunner.models.loader import model_config_from_dict
from graphrunner.models.registry import CAUSAL_ARCHITECTURES, MOE_ARCHITECTURES
from tests.hf_fixtures import ARCHS, make_hf_checkpoint, write_legacy_config


class NullBackend:
    name = "null"

    def forward(self, q, k, v, kv_cache, metadata, scale, out=None):
        return q


def _load(path, **kw):
    cfg = load_model_config(str(path))
    load = LoadConfig(model=str(path), **kw)
    return load_model(cfg, load, attn_backend=NullBackend(), dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (single-file folder, sharded folder) with identical weights."""
    out = {}
    for arch in ARCHS:
        single = make_hf_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=5)
        sharded = make_hf_checkpoint(arch, tmp_path_factory.mktemp(arch + "-sharded"), seed=5, make_sharded=True)
        out[arch] = (single, sharded)
    return out


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("arch", ARCHS)
def test_old_and_new_rope_keys_give_identical_config(arch, checkpoints, tmp_path):
    folder = _copy(checkpoints[arch][0], tmp_path)
    new = load_model_config(str(folder))
    assert checkpoint_dtype(str(folder)) == torch.float32
    write_legacy_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" not in raw and "rope_theta" in raw and "torch_dtype" in raw and "dtype" not in raw
    old = load_model_config(str(folder))
    assert old == new
    assert checkpoint_dtype(str(folder)) == torch.float32


def test_fixture_configs_parse_as_expected(checkpoints):
    llama3 = load_model_config(str(checkpoints["llama3"][0]))
    assert llama3.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert llama3.eos_token_id == (2, 3) and llama3.rope_theta == 500000.0
    qwen2 = load_model_config(str(checkpoints["qwen2"][0]))
    assert qwen2.attention_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm
    qwen3 = load_model_config(str(checkpoints["qwen3"][0]))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.hidden_size == 64
    assert load_model_config(str(checkpoints["mistral"][0])).architecture == "MistralForCausalLM"


_base_fields = st.fixed_dictionaries(
    {
        "arch": st.sampled_from(sorted(CAUSAL_ARCHITECTURES)),
        "kv_heads": st.sampled_from([1, 2, 4]),
        "group": st.sampled_from([1, 2, 3]),
        "head_dim": st.sampled_from([None, 16, 32]),
        "eos": st.one_of(st.none(), st.integers(0, 999), st.lists(st.integers(0, 999), max_size=3)),
        "tie": st.one_of(st.none(), st.booleans()),
        "bias": st.one_of(st.none(), st.booleans()),
        "rope": st.sampled_from(["none", "default", "linear", "llama3", "llama3-no-orig"]),
        "theta": st.one_of(st.none(), st.sampled_from([1e4, 5e5, 1e6])),
        "omit_kv": st.booleans(),
    }
)


def _raw_configs(f) -> tuple[dict, dict]:
    """The same model written with transformers-5 keys and with the older keys."""
    heads = f["kv_heads"] * f["group"]
    base = {
        "architectures": [f["arch"]],
        "vocab_size": 100,
        "hidden_size": heads * 16,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    }
    if not f["omit_kv"]:
        base["num_key_value_heads"] = f["kv_heads"]
    if f["head_dim"] is not None:
        base["head_dim"] = f["head_dim"]
    for key, value in (("eos_token_id", f["eos"]), ("tie_word_embeddings", f["tie"]), ("attention_bias", f["bias"])):
        if value is not None:
            base[key] = value
    scaling = {
        "none": None,
        "default": {},
        "linear": {"factor": 2.0},
        "llama3": {
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024
        },
        "llama3-no-orig": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    }[f["rope"]]
    rope_type = f["rope"].split("-")[0]
    new, old = dict(base, dtype="bfloat16"), dict(base, torch_dtype="bfloat16")
    if scaling is not None:
        new["rope_parameters"] = {"rope_type": rope_type, **scaling}
        old["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **scaling}
    if f["theta"] is not None:
        old["rope_theta"] = f["theta"]
        new.setdefault("rope_parameters", {"rope_type": "default"})["rope_theta"] = f["theta"]
    return new, old


@settings(deadline=None)
@given(fields=_base_fields)
def test_config_parsing_invariants(fields):
    new, old = _raw_configs(fields)
    cfg = model_config_from_dict(new)
    assert model_config_from_dict(old) == cfg
    heads = new["num_attention_heads"]
    assert cfg.num_key_value_heads == (heads if fields["omit_kv"] else fields["kv_heads"])
    assert cfg.head_dim == (fields["head_dim"] or new["hidden_size"] // heads)
    assert cfg.rope_theta == (fields["theta"] or 10000.0)
    eos = fields["eos"]
    assert cfg.eos_token_id == (() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos))
    assert cfg.tie_word_embeddings is bool(fields["tie"])  # HF default: untied
    arch = fields["arch"]
    expected_bias = {"Qwen2ForCausalLM": True, "Qwen2MoeForCausalLM": True, "MistralForCausalLM": False,
                     "MixtralForCausalLM": False}.get(arch, bool(fields["bias"]))
    assert cfg.attention_bias is expected_bias
    assert cfg.qk_norm is (arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"))
    assert (cfg.moe is not None) is (arch in MOE_ARCHITECTURES)
    if fields["rope"] in ("none", "default"):
        assert cfg.rope_scaling is None
    else:
        assert cfg.rope_scaling["rope_type"] == fields["rope"].split("-")[0]
        if fields["rope"] == "llama3-no-orig":  # HF falls back to max_position_embeddings
            assert cfg.rope_scaling["original_max_position_embeddings"] == 4096


def test_builtins():
    assert is_builtin("builtin:tiny-llama") and not is_builtin("/some/folder")
    for name, cfg in BUILTIN_MODELS.items():
        assert load_model_config(name) is cfg and cfg.name == name
        assert cfg.architecture in SUPPORTED_ARCHITECTURES
    q = BUILTIN_MODELS["builtin:qwen2.5-0.5b"]
    assert (q.vocab_size, q.hidden_size, q.num_hidden_layers, q.eos_token_id) == (151936, 896, 24, (151643, 151645))
    assert q.tie_word_embeddings and q.attention_bias
    l1 = BUILTIN_MODELS["builtin:llama-3.2-1b"]
    assert l1.rope_scaling["factor"] == 32.0 and l1.tie_word_embeddings and l1.eos_token_id == (128001, 128008, 128009)
    l8 = BUILTIN_MODELS["builtin:llama-3.1-8b"]
    assert l8.rope_scaling["factor"] == 8.0 and not l8.tie_word_embeddings and l8.head_dim == 128
    # ~8.03B parameters, as the real model.
    assert 8.0e9 < l8.num_params() < 8.1e9
    llava = BUILTIN_MODELS["builtin:llava-1.5-7b"]  # 7.06B: Llama-2-7B, CLIP ViT-L/14-336, the projector
    assert 7.05e9 < llava.num_params() < 7.07e9 and llava.vision.num_image_tokens == 576


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_equals_single_file(arch, checkpoints):
    single, sharded = checkpoints[arch]
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) == 3
    a, b = dict(iter_checkpoint_weights(single)), dict(iter_checkpoint_weights(sharded))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    ma, mb = _load(single), _load(sharded)
    pa, pb = dict(ma.named_parameters()), dict(mb.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_element_is_filled(arch, checkpoints):
    """Completeness of the name mapping: poison every element, load, and nothing is left."""
    folder = checkpoints[arch][0]
    model = LlamaForCausalLM(load_model_config(str(folder)), NullBackend(), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    weights = dict(iter_checkpoint_weights(folder))
    model.load_weights(weights.items())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # Fused parameters hold the HF tensors side by side.
    attn = model.model.layers[1].self_attn
    q = attn.qkv_proj.weight[: attn.qkv_proj.q_size]
    assert torch.equal(q, weights["model.layers.1.self_attn.q_proj.weight"])
    mlp = model.model.layers[0].mlp
    if isinstance(mlp, FusedMoE):  # expert 1's up projection, the second half of its gate|up rows
        name = ("model.layers.0.block_sparse_moe.experts.1.w3.weight" if arch == "mixtral"
                else "model.layers.0.mlp.experts.1.up_proj.weight")
        assert torch.equal(mlp.w13[1, mlp.intermediate_size :], weights[name])
    else:
        up = mlp.gate_up_proj.weight[model.config.intermediate_size :]
        assert torch.equal(up, weights["model.layers.0.mlp.up_proj.weight"])


def test_tied_lm_head_falls_back_to_embeddings(checkpoints):
    folder = checkpoints["qwen2"][0]
    names = dict(iter_checkpoint_weights(folder))
    assert "lm_head.weight" not in names  # HF saves tied models without it
    model = _load(folder)
    assert model.lm_head is None
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ names["model.embed_tokens.weight"].T)


def test_extra_tensors_are_ignored_with_debug_log(checkpoints, caplog):
    folder = checkpoints["llama"][0]
    model = LlamaForCausalLM(load_model_config(str(folder)), NullBackend(), dtype=torch.float32, device="cpu")
    weights = list(iter_checkpoint_weights(folder))
    weights += [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)), ("model.extra.weight", torch.ones(2))]
    with caplog.at_level(logging.DEBUG, logger="graphrunner.models"):
        model.load_weights(weights)
    assert "model.extra.weight" in caplog.text and "inv_freq" not in caplog.text


def test_load_casts_and_logs(checkpoints, caplog):
    folder = checkpoints["llama"][0]
    cfg = load_model_config(str(folder))
    with caplog.at_level(logging.INFO, logger="graphrunner.models"):
        model = load_model(cfg, LoadConfig(model=str(folder)), attn_backend=NullBackend(), dtype="fp16", device="cpu")
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert re.search(r"GiB of parameters .* in [\d.]+ s", caplog.text)


# ---------------------------------------------------------------------- error cases


def test_missing_folder_and_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope"))):
        load_model_config(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"config\.json.*" + re.escape(str(tmp_path))):
        load_model_config(str(tmp_path))


def test_missing_shard_names_it(checkpoints, tmp_path):
    folder = _copy(checkpoints["llama"][1], tmp_path)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003\.safetensors"):
        next(iter_checkpoint_weights(folder))


def test_no_safetensors_names_folder(checkpoints, tmp_path):
    folder = _copy(checkpoints["llama"][0], tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(folder))):
        _load(folder)


def _model_and_weights(checkpoints, arch="llama"):
    folder = checkpoints[arch][0]
    model = LlamaForCausalLM(load_model_config(str(folder)), NullBackend(), dtype=torch.float32, device="cpu")
    return model, dict(iter_checkpoint_weights(folder))


@settings(deadline=None)
@given(data=st.data())
def test_missing_tensor_names_it(checkpoints, data):
    model, weights = _model_and_weights(checkpoints, data.draw(st.sampled_from(ARCHS)))
    name = data.draw(st.sampled_from(sorted(weights)))
    del weights[name]
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        model.load_weights(weights.items())


@settings(deadline=None)
@given(data=st.data())
def test_misshaped_tensor_names_it_and_shapes(checkpoints, data):
    model, weights = _model_and_weights(checkpoints, data.draw(st.sampled_from(ARCHS)))
    name = data.draw(st.sampled_from(sorted(weights)))
    good = tuple(weights[name].shape)
    bad = weights[name].reshape(-1)[:-1]  # one element short, and flattened
    weights[name] = bad
    msg = rf"{re.escape(repr(name))}.*{re.escape(str(tuple(bad.shape)))}.*expected {re.escape(str(good))}"
    with pytest.raises(ValueError, match=msg):
        model.load_weights(weights.items())


def test_duplicate_tensor_names_it(checkpoints):
    model, weights = _model_and_weights(checkpoints)
    items = list(weights.items()) + [("model.norm.weight", weights["model.norm.weight"])]
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*more than once"):
        model.load_weights(items)


def test_unknown_builtin_lists_builtins():
    with pytest.raises(ValueError, match=r"'builtin:gpt-5'.*builtin:tiny-llama.*"):
        load_model_config("builtin:gpt-5")


def test_unsupported_architecture_names_it_and_supported_set(checkpoints, tmp_path):
    folder = _copy(checkpoints["llama"][0], tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model_config(str(folder))
    cfg = dataclasses.replace(load_model_config(str(checkpoints["llama"][0])), architecture="FalconForCausalLM")
    with pytest.raises(ValueError, match=r"'FalconForCausalLM'.*supported"):
        LlamaForCausalLM(cfg, NullBackend(), dtype=torch.float32, device="cpu")


def test_unknown_rope_type_and_load_format(checkpoints, tmp_path):
    folder = _copy(checkpoints["llama"][0], tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"'yarn'.*allowed"):
        load_model_config(str(folder))
    cfg = load_model_config(str(checkpoints["llama"][0]))
    with pytest.raises(ValueError, match=r"'gguf'.*auto.*dummy"):
        bad = LoadConfig(model="x", load_format="gguf")
        load_model(cfg, bad, attn_backend=NullBackend(), dtype=torch.float32, device="cpu")
