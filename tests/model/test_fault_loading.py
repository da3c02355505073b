"""Damaged model folders and bad devices give errors that name the culprit.

Every fault here once surfaced as a raw library traceback (SafetensorError, a bare JSON
decoder message, a tokenizers Exception, torch's RuntimeError for an unknown device) or,
for NaN weights, as silently generated zeros. Each test damages a copy of a tiny
checkpoint and checks the error type and that the message names the file (and tensor).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from graphrunner.cli import main
from graphrunner.config import LoadConfig, resolve_device
from graphrunner.models import (
    CheckpointError,
    checkpoint_dtype,
    iter_checkpoint_weights,
    load_model,
    load_model_config,
    load_tokenizer,
)
from tests.hf_fixtures import make_hf_checkpoint

SHARD2 = "model-00002-of-00003.safetensors"
INDEX = "model.safetensors.index.json"


class NullBackend:
    name = "null"

    def forward(self, q, k, v, kv_cache, metadata, scale, out=None):
        return q


def _load(path, dtype=torch.float32, **kw):
    cfg = load_model_config(str(path))
    return load_model(cfg, LoadConfig(model=str(path), **kw), attn_backend=NullBackend(), dtype=dtype, device="cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(single-file folder, sharded folder) of the tiny llama fixture."""
    single = make_hf_checkpoint("llama", tmp_path_factory.mktemp("single"), seed=3)
    sharded = make_hf_checkpoint("llama", tmp_path_factory.mktemp("sharded"), seed=3, make_sharded=True)
    return single, sharded


@pytest.fixture
def single(checkpoints, tmp_path):
    return Path(shutil.copytree(checkpoints[0], tmp_path / "single"))


@pytest.fixture
def sharded(checkpoints, tmp_path):
    return Path(shutil.copytree(checkpoints[1], tmp_path / "sharded"))


def _names(path: Path) -> str:
    return re.escape(repr(str(path)))


def _rewrite(file: Path, name: str, change) -> None:
    tensors = load_file(file)
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, file, metadata={"format": "pt"})


# ------------------------------------------------------------------------ safetensors


def test_truncated_single_file_names_it(single):
    file = single / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=_names(file) + " is truncated") as exc:
        _load(single)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value.__cause__, SafetensorError)


def test_truncated_shard_mid_load_names_the_shard(sharded):
    """Shard 1 loads fine, shard 2 was cut short: the error names shard 2."""
    file = sharded / SHARD2
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=_names(file) + " is truncated"):
        _load(sharded)


def test_garbage_file_is_not_safetensors(single):
    file = single / "model.safetensors"
    file.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match=_names(file) + " is not a safetensors file") as exc:
        list(iter_checkpoint_weights(single))
    assert isinstance(exc.value.__cause__, SafetensorError)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("cuts")


@settings(deadline=None)
@given(data=st.data())
def test_any_cut_names_the_file(checkpoints, scratch, data):
    """Cut at any byte (inside the header or the tensor data): always a CheckpointError."""
    src = checkpoints[1] / SHARD2
    full = src.read_bytes()
    cut = data.draw(st.integers(0, len(full) - 1), label="cut")
    folder = Path(tempfile.mkdtemp(dir=scratch))
    (folder / "model.safetensors").write_bytes(full[:cut])
    with pytest.raises(CheckpointError, match=_names(folder / "model.safetensors")):
        list(iter_checkpoint_weights(folder))


def test_missing_shard_names_shard_and_index(sharded):
    (sharded / SHARD2).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{_names(sharded / SHARD2)} listed in {_names(sharded / INDEX)}"):
        _load(sharded)


def test_malformed_index_names_it(sharded):
    (sharded / INDEX).write_text('{"weight_map": {"a": "x.safetensors",}}')
    with pytest.raises(CheckpointError, match=_names(sharded / INDEX) + " is not valid JSON.*line 1 column"):
        _load(sharded)
    (sharded / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=_names(sharded / INDEX) + " has no 'weight_map'"):
        _load(sharded)


def test_misshaped_tensor_names_file_and_tensor(sharded):
    name = "model.layers.0.mlp.down_proj.weight"
    file = next(f for f in sorted(sharded.glob("*.safetensors")) if name in load_file(f))
    _rewrite(file, name, lambda t: t[:, :-1].contiguous())
    with pytest.raises(CheckpointError, match=rf"{_names(file)}: .*{re.escape(repr(name))} has shape"):
        _load(sharded)


def test_missing_tensor_names_folder_and_tensor(single):
    file = single / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"folder {_names(single)}: .*missing.*'model\.norm\.weight'"):
        _load(single)


# ------------------------------------------------------------------------ non-finite


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_names_tensor_and_file(sharded, value):
    name = "model.layers.1.self_attn.k_proj.weight"
    file = next(f for f in sorted(sharded.glob("*.safetensors")) if name in load_file(f))

    def poison(t):
        t[3, 5] = value
        return t

    _rewrite(file, name, poison)
    with pytest.raises(CheckpointError, match=rf"{_names(file)}: tensor {re.escape(repr(name))} has 1 non-finite"):
        _load(sharded)


def test_overflow_on_cast_names_the_parameter(single):
    """Finite in the fp32 file, inf once cast to float16: still refused, naming the parameter."""
    _rewrite(single / "model.safetensors", "model.norm.weight", lambda t: t.fill_(1e6))
    assert _load(single, dtype=torch.float32) is not None
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*torch\.float16.*overflow"):
        _load(single, dtype=torch.float16)


def test_dummy_weights_skip_the_checkpoint(single):
    _rewrite(single / "model.safetensors", "model.norm.weight", lambda t: t.fill_(float("nan")))
    model = _load(single, load_format="dummy")
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_cli_reports_nan_weights_instead_of_generating(single):
    _rewrite(single / "model.safetensors", "model.embed_tokens.weight", lambda t: t.fill_(float("nan")))
    with pytest.raises(SystemExit, match=r"model\.safetensors.*'model\.embed_tokens\.weight'.*non-finite"):
        main(["generate", "--model", str(single), "--device", "cpu", "--num-prompts", "1", "--max-tokens", "2"])


# ------------------------------------------------------------------------ config.json


@pytest.mark.parametrize(
    ("text", "where"),
    [('{\n  "vocab_size": 640,\n  "hidden_size": 64\n  "x": 1\n}', "line 4 column 3"), ("", "line 1 column 1")],
)
def test_malformed_config_names_path_and_position(single, text, where):
    path = single / "config.json"
    path.write_text(text)
    for load in (load_model_config, checkpoint_dtype):
        with pytest.raises(CheckpointError, match=rf"{_names(path)} is not valid JSON: .* at {where}"):
            load(str(single))


def test_binary_or_incomplete_config_names_path(single):
    path = single / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match=_names(path) + " is not a text"):
        load_model_config(str(single))
    path.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=_names(path) + " holds a JSON list"):
        load_model_config(str(single))
    path.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    with pytest.raises(CheckpointError, match=_names(path) + r": required key 'num_attention_heads' is missing"):
        load_model_config(str(single))


# ------------------------------------------------------------------------ tokenizer


def test_bad_tokenizer_names_the_file(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    for text in ('{"model": {"type": "nonsense"}}', "not json at all", ""):
        path.write_text(text)
        with pytest.raises(CheckpointError, match=_names(path) + " is not a valid tokenizer file"):
            load_tokenizer(tmp_path)
    with pytest.raises(SystemExit, match=_names(path) + " is not a valid tokenizer file"):
        main(["generate", "--model", str(tmp_path), "--device", "cpu", "--prompt", "hello"])


def test_missing_tokenizer_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=_names(tmp_path / "tokenizer.json")):
        load_tokenizer(tmp_path)


# ------------------------------------------------------------------------ device

BAD_DEVICES = ["tpu", "gpu", "CUDA", "cuda:x", "mps", "meta", "cuda:99"]


# ids are prefixed: a bare "gpu" id would be a keyword, and conftest skips "gpu" tests without CUDA.
@pytest.mark.parametrize("device", BAD_DEVICES, ids=[f"device={d}" for d in BAD_DEVICES])
def test_bad_device_names_value_and_allowed_forms(device):
    with pytest.raises(ValueError, match=re.escape(repr(device))) as exc:
        resolve_device(device)
    if device != "cuda:99":  # 'cuda:99' is a form we accept, for an index that does not exist
        assert "'cpu', 'cuda', 'cuda:N'" in str(exc.value)


def test_good_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'cuda' needs a CUDA GPU"):
            resolve_device("cuda")


def test_llm_bad_device_is_a_value_error():
    from graphrunner.engine.llm import LLM

    with pytest.raises(ValueError, match="'tpu'"):
        LLM("builtin:tiny-llama", device="tpu")


@pytest.mark.parametrize("device", ["tpu", "cuda:99"])
def test_cli_bad_device_exits_naming_it(device):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--device", device])
    assert exc.value.code != 0 and repr(device) in str(exc.value)
    assert str(exc.value).startswith("graphrunner generate: --device:")


def test_cli_bad_device_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner.cli", "generate", "--device", "tpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "'tpu'" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------ config.json values

import json  # noqa: E402

# field -> values that must be refused (each names config.json, the field and the value)
BAD_CONFIG_VALUES = {
    "rope_theta": [0, -1.0, float("inf"), "1e4"],
    "rms_norm_eps": [-1e-6, 0, "x"],
    "tie_word_embeddings": ["false", 1],
    "eos_token_id": ["23", [1, "2"], -1, True],
    "num_hidden_layers": [True, 0, 2.0],
    "hidden_size": [64.0, "64"],
    "num_attention_heads": ["4", 0],
    "num_key_value_heads": [2.5],
    "architectures": ["LlamaForCausalLM", [1]],
    "max_position_embeddings": [-5],
}


@settings(deadline=None)
@given(item=st.sampled_from([(f, v) for f, vs in BAD_CONFIG_VALUES.items() for v in vs]))
def test_bad_config_values_name_file_field_and_value(checkpoints, scratch, item):
    field, value = item
    folder = Path(tempfile.mkdtemp(dir=scratch))
    raw = json.loads((checkpoints[0] / "config.json").read_text())
    raw[field] = value
    if field == "rope_theta" and isinstance(raw.get("rope_parameters"), dict):  # transformers-5 keys
        raw["rope_parameters"]["rope_theta"] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=re.escape(f"config.json field {field}={value!r}")):
        load_model_config(str(folder))


def test_model_config_refuses_what_the_model_cannot_use():
    cfg = load_model_config("builtin:tiny-llama")
    import dataclasses

    for field, value in (("rope_theta", 0.0), ("rms_norm_eps", -1.0), ("tie_word_embeddings", "false"),
                         ("num_attention_heads", 0), ("eos_token_id", ("23",)), ("num_hidden_layers", True)):
        with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
            dataclasses.replace(cfg, **{field: value})


def test_unexpected_tensor_is_an_error_and_inv_freq_a_warning(single, caplog):
    file = single / "model.safetensors"
    _rewrite(file, "model.norm.weight", lambda t: t)
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, file, metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="graphrunner.models"):
        _load(single)
    assert "rotary_emb.inv_freq" in caplog.text
    tensors["model.layers.0.mlp.extra.weight"] = torch.ones(4)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{_names(file)}: unexpected tensor 'model\.layers\.0\.mlp\.extra"):
        _load(single)


def test_integer_weights_are_an_error(single):
    _rewrite(single / "model.safetensors", "model.norm.weight", lambda t: t.to(torch.int32))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype torch\.int32"):
        _load(single)


def test_a_directory_named_model_safetensors_is_named(tmp_path, checkpoints):
    folder = Path(shutil.copytree(checkpoints[0], tmp_path / "dir"))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=_names(folder / "model.safetensors") + " is not a regular file"):
        _load(folder)
