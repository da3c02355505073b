"""PEFT adapter folders: what is read (ranks, targets, alpha, rsLoRA) and what is refused, by name.

Unsupported options fail with a ValueError naming the option (or tensor) and the file: DoRA,
embedding / LM-head adapters (`modules_to_save`, targets, tensors), trained biases, per-module
alphas, modules the model does not have, ranks above max_lora_rank, misshaped tensors.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from graphrunner.config import LoRAConfig
from graphrunner.layers.lora.peft import load_adapter
from graphrunner.models.loader import load_model_config
from graphrunner.protocol import LoRARequest
from tests.hf_fixtures import make_hf_checkpoint

H, INTER, Q, KV = 64, 128, 64, 32  # tests/hf_fixtures.py's llama


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return load_model_config(str(make_hf_checkpoint("llama", tmp_path_factory.mktemp("base") / "m")))


def _write(folder, tensors=None, **options):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none",
           "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}
    cfg.update(options)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, H),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(Q, 4)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return LoRARequest(folder.name, 1, str(folder))


def test_reads_ranks_targets_and_scaling(config, tmp_path):
    p = "base_model.model.model.layers."
    tensors = {p + "1.mlp.down_proj.lora_A.weight": torch.randn(8, INTER),
               p + "1.mlp.down_proj.lora_B.weight": torch.randn(H, 8),
               p + "0.self_attn.k_proj.lora_A.weight": torch.randn(2, H),
               p + "0.self_attn.k_proj.lora_B.weight": torch.randn(KV, 2)}
    adapter = load_adapter(_write(tmp_path / "a", tensors, r=8, lora_alpha=16, rank_pattern={"k_proj": 2}), config, 8)
    assert adapter.rank == 8 and adapter.targets() == {"down_proj", "k_proj"}
    assert adapter.modules[(1, "down_proj")][2] == 2.0 and adapter.modules[(0, "k_proj")][2] == 8.0  # alpha / r
    rs = load_adapter(_write(tmp_path / "rs", tensors, r=8, lora_alpha=16, use_rslora=True), config, 8)
    assert rs.modules[(1, "down_proj")][2] == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize(("options", "tensors", "match"), [
    ({"use_dora": True}, None, "use_dora=True: DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, None, "embedding or LM-head adapters"),
    ({"bias": "all"}, None, "bias='all'"),
    ({"alpha_pattern": {"q_proj": 4}}, None, "alpha_pattern"),
    ({"peft_type": "IA3"}, None, "peft_type='IA3'"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 640)}, "embedding or LM-head"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.randn(Q)}, "DoRA"),
    ({}, {"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": torch.randn(4, H),
          "base_model.model.model.layers.5.self_attn.q_proj.lora_B.weight": torch.randn(Q, 4)},
     "layer 5 is not present"),
    ({}, {"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.randn(4, H)}, "not a LoRA A/B"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, H)}, "has no lora_B"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, H + 1),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(Q, 4)}, "do not fit"),
    ({"r": 32}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(32, H),
                 "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(Q, 32)},
     "rank 32, above max_lora_rank=16"),
])
def test_refuses_unsupported_adapters_by_name(config, tmp_path, options, tensors, match):
    request = _write(tmp_path / "bad", tensors, **options)
    with pytest.raises(ValueError, match=match) as err:
        load_adapter(request, config, 16)
    assert "bad" in str(err.value) and ("adapter_config.json" in str(err.value) or
                                        "adapter_model.safetensors" in str(err.value))


def test_missing_files_are_named(config, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter(LoRARequest("x", 1, str(tmp_path / "nope")), config, 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_adapter(LoRARequest("x", 1, str(tmp_path / "empty")), config, 16)
    request = _write(tmp_path / "nobin")
    (tmp_path / "nobin" / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        load_adapter(request, config, 16)


def test_moe_expert_adapters_are_refused(tmp_path):
    config = load_model_config(str(make_hf_checkpoint("mixtral", tmp_path / "moe")))
    tensors = {"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.randn(4, H),
               "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.randn(32, 4)}
    with pytest.raises(ValueError, match="mixture of experts"):
        load_adapter(_write(tmp_path / "moe_adapter", tensors), config, 16)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_loras": 0}, "max_loras=0"), ({"max_lora_rank": 0}, "max_lora_rank=0"),
    ({"max_lora_rank": 512}, "largest supported rank 256"), ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras=2"),
])
def test_config_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3


def test_lora_request_checks():
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path is empty"):
        LoRARequest("a", 1, "")
    r = LoRARequest("a", 3, "/x")
    assert (r.name, r.adapter_id, r.path) == ("a", 3, "/x")
