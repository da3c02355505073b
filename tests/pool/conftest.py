"""Tiny Hugging Face pooling checkpoints: an embedder (a bare Qwen3 decoder with a
sentence-transformers last-token + Normalize pipeline), a mean-pooling embedder, and Llama
sequence classifiers (three labels; one label: a cross-encoder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_fixtures import make_hf_config


@torch.no_grad()
def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)


def save_pooling_model(kind: str, path: Path, *, arch: str = "qwen3", seed: int = 0, pooling: str | None = "lasttoken",
                       normalize: bool = True, num_labels: int = 3):
    """kind "embed": a bare decoder (`Qwen3Model`) with modules.json (pooling mode `pooling`, None: no
    modules.json); "classify": a `*ForSequenceClassification` with `num_labels`. Returns the HF model."""
    import transformers

    config = make_hf_config(arch, num_labels=num_labels) if kind == "classify" else make_hf_config(arch)
    config._attn_implementation = "eager"
    cls = transformers.AutoModelForSequenceClassification if kind == "classify" else transformers.AutoModel
    model = cls.from_config(config, dtype=torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    if kind == "embed" and pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "lasttoken")}
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return model


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("embedder")
    return path, save_pooling_model("embed", path)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    return path, save_pooling_model("classify", path, arch="llama")
