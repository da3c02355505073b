"""Model configs and weights: built-in shapes or Hugging Face checkpoint folders.

`load_model_config` turns `builtin:NAME` or a folder's config.json (old or
transformers-5 keys) into a `ModelConfig`; `load_model` builds the model on its device
and fills it with dummy weights or the folder's safetensors.

Damaged inputs raise errors that name the file (and the tensor where one is at fault):
FileNotFoundError for a missing folder, config.json or shard, `CheckpointError` (a
ValueError) for a file that cannot be parsed (malformed JSON, a truncated or foreign
safetensors file, a bad tokenizer.json), a missing or misshaped tensor, or weights that
are not finite (NaN or inf) once loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.attention.kv_scales import is_kv_scale_name, load_kv_scales
from graphrunner.config import KernelConfig, LoadConfig, ModelConfig, MoEConfig, resolve_dtype
from graphrunner.layers.linear import quantize_linear_layers
from graphrunner.layers.moe.layer import FusedMoE
from graphrunner.layers.rotary import normalize_rope_scaling
from graphrunner.models.quant_config import parse_quantization_config
from graphrunner.models.registry import check_architecture, decoder_architecture, get_builtin, is_builtin

if TYPE_CHECKING:
    from graphrunner.models.llama import LlamaForCausalLM

logger = logging.getLogger("graphrunner.models")

__all__ = [
    "CheckpointError",
    "checkpoint_dtype",
    "full_parameter",
    "init_dummy_weights",
    "init_dummy_weights_sharded",
    "is_builtin",
    "iter_checkpoint_weights",
    "load_model",
    "load_model_config",
    "load_tokenizer",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
LOAD_FORMATS = ("auto", "dummy")


class CheckpointError(ValueError):
    """A model folder's file is damaged or does not match the model; the message names the
    file (and the tensor, where one is at fault). The library error, if any, is `__cause__`."""

# config.json `model_type` -> architecture, for configs that omit `architectures`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}

# HF class defaults that differ per architecture (used when a key is absent).
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5},
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
}

# The experts' config keys and the HF class defaults for each MoE architecture: (key of the expert
# count, key of the expert width, defaults). Mixtral's experts have the model's intermediate_size
# and always renormalise the top-k weights.
_MOE_KEYS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "MixtralForCausalLM": ("num_local_experts", "intermediate_size", {
        "num_local_experts": 8, "num_experts_per_tok": 2}),
    "Qwen2MoeForCausalLM": ("num_experts", "moe_intermediate_size", {
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "norm_topk_prob": False}),
    "Qwen3MoeForCausalLM": ("num_experts", "moe_intermediate_size", {
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False}),
}


# ----------------------------------------------------------------------------- config


def load_model_config(model: str) -> ModelConfig:
    """`builtin:NAME` -> the built-in config; a folder -> its parsed config.json.

    Raises ValueError for an unknown builtin (listing them) or an unsupported
    architecture (naming it and the supported set), FileNotFoundError naming a missing
    folder or config.json.
    """
    if is_builtin(model):
        return get_builtin(model)
    folder = Path(model)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist (and {model!r} is not 'builtin:NAME')")
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model folder {str(folder)!r} (looked for {str(path)!r})")
    raw = _read_json_object(path)
    try:
        return model_config_from_dict(raw, name=str(folder))
    except KeyError as e:
        raise CheckpointError(f"{str(path)!r}: required key {e} is missing") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r}: {e}") from e


def model_config_from_dict(raw: dict[str, Any], *, name: str = "model") -> ModelConfig:
    """Parse a HF config.json dict, accepting both pre- and post-transformers-5 keys."""
    architecture = _architecture(raw)
    check_architecture(architecture)
    if architecture == "LlavaForConditionalGeneration":
        from graphrunner.models.llava import llava_model_config

        return llava_model_config(raw, name=name, text_config=model_config_from_dict)
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        from graphrunner.models.qwen2_5_vl import qwen2_5_vl_model_config

        return qwen2_5_vl_model_config(raw, name=name, text_config=model_config_from_dict)
    # A pooling checkpoint (`Qwen3Model`, `Qwen3ForSequenceClassification`) has its decoder's fields.
    arch = decoder_architecture(architecture)
    defaults = _ARCH_DEFAULTS[arch]

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias") is not None and not isinstance(raw.get("mlp_bias"), bool):
        raise _bad_field("mlp_bias", raw["mlp_bias"], "true or false (a JSON boolean)")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    _warn_sliding_window(raw, arch)

    heads = _positive_int(raw, "num_attention_heads")
    hidden = _positive_int(raw, "hidden_size")
    max_pos = _positive_int(raw, "max_position_embeddings", defaults["max_position_embeddings"])
    rope_theta, rope_scaling = _rope(raw, max_pos)

    return ModelConfig(
        vocab_size=_positive_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(raw, "intermediate_size"),
        num_hidden_layers=_positive_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_positive_int(raw, "num_key_value_heads", heads),
        head_dim=_positive_int(raw, "head_dim", hidden // heads),
        rms_norm_eps=_positive_float(raw, "rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        attention_bias=_attention_bias(raw, arch),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        eos_token_id=_eos(raw.get("eos_token_id")),
        architecture=architecture,
        name=name,
        moe=_moe(raw, arch),
        quant=None if raw.get("quantization_config") is None else parse_quantization_config(raw["quantization_config"]),
    )


def _moe(raw: dict[str, Any], arch: str) -> MoEConfig | None:
    """The experts of a MoE architecture's config.json (None for a dense one, or a Qwen-MoE
    config with num_experts 0, which Hugging Face builds with dense layers only)."""
    if arch not in _MOE_KEYS:
        return None
    count_key, width_key, defaults = _MOE_KEYS[arch]
    # transformers 5 writes every family's expert count as num_local_experts; Hub configs of the
    # Qwen families say num_experts.
    present = [key for key in ("num_experts", "num_local_experts") if raw.get(key) is not None]
    if len(present) == 2 and raw["num_experts"] != raw["num_local_experts"]:
        raise _bad_field("num_experts", raw["num_experts"], f"equal to num_local_experts={raw['num_local_experts']!r}")
    count = raw[present[0]] if present else defaults[count_key]
    count_key = present[0] if present else count_key
    if count == 0 and arch != "MixtralForCausalLM":
        return None
    if _is_int(count) and count < 0:
        raise _bad_field(count_key, count, "an int >= 0")
    norm = True if arch == "MixtralForCausalLM" else _bool(raw, "norm_topk_prob", defaults["norm_topk_prob"])
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_int(i) and i >= 0 for i in only):
        raise _bad_field("mlp_only_layers", only, "a list of layer indices (ints >= 0)")
    shared = raw.get("shared_expert_intermediate_size", defaults.get("shared_expert_intermediate_size", 0))
    if shared is None or (_is_int(shared) and shared == 0):
        shared = 0
    elif not _is_int(shared) or shared < 0:
        raise _bad_field("shared_expert_intermediate_size", shared, "an int >= 0")
    experts = _positive_int({count_key: count}, count_key)
    top_k = _positive_int(raw, "num_experts_per_tok", defaults["num_experts_per_tok"])
    if top_k > experts:
        raise _bad_field("num_experts_per_tok", top_k, f"<= {count_key}={experts}")
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_positive_int(raw, width_key, defaults.get(width_key)),
        norm_topk_prob=norm,
        shared_expert_intermediate_size=shared,
        decoder_sparse_step=_positive_int(raw, "decoder_sparse_step", 1),
        mlp_only_layers=tuple(only),
    )


def checkpoint_dtype(model: str) -> torch.dtype | None:
    """The dtype a folder's config.json declares (`dtype`, or the older `torch_dtype`);
    None for builtins or when absent. ModelConfig does not carry it: `dtype="auto"`
    picks the runtime dtype from the device instead."""
    if is_builtin(model):
        return None
    path = Path(model) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {str(path)!r}")
    raw = _read_json_object(path)
    name = raw.get("dtype") or raw.get("torch_dtype")
    return resolve_dtype(name, "cpu") if name else None


def load_tokenizer(model: str | Path) -> Any:
    """The `tokenizers.Tokenizer` of a model folder's tokenizer.json.

    FileNotFoundError naming the path when there is none, ImportError when the optional
    `tokenizers` package is missing, CheckpointError naming the file when it cannot be parsed.
    """
    path = Path(model) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in model folder {str(model)!r} (looked for {str(path)!r})")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            f"reading {str(path)!r} needs the `tokenizers` package: pip install 'graphrunner[text]'"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for every parse error
        raise CheckpointError(f"{str(path)!r} is not a valid tokenizer file: {e}") from e


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError naming the file (and the line and column
    of a syntax error) when it is not valid UTF-8 JSON or not an object."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{str(path)!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{str(path)!r} is not a text (UTF-8 JSON) file: byte {e.start} is invalid") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(path)!r} holds a JSON {type(raw).__name__}, expected an object")
    return raw


def _bad_field(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"config.json field {name}={value!r} must be {rule}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(raw: dict[str, Any], name: str, default: int | None = None) -> int:
    """`raw[name]`, an int >= 1 (absent or null: `default`; KeyError when there is none)."""
    value = raw.get(name) if default is not None else raw[name]
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad_field(name, value, "an int >= 1")
    return value


def _positive_float(raw: dict[str, Any], name: str, default: float) -> float:
    """`raw[name]`, a finite number > 0 (absent or null: `default`)."""
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise _bad_field(name, value, "a finite number > 0")
    return float(value)


def _bool(raw: dict[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad_field(name, value, "true or false (a JSON boolean)")
    return value


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise _bad_field("architectures", archs, "a list of architecture names")
    if archs:
        return archs[0]
    model_type = raw.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(
        f"config.json has no 'architectures' and model_type={model_type!r} is not one of {sorted(_MODEL_TYPE_TO_ARCH)}"
    )


def _rope(raw: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from new `rope_parameters` or old `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    old_scaling = raw.get("rope_scaling") or {}
    if not params:
        params = dict(old_scaling)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 0):
        raise _bad_field("rope_theta", theta, "a finite number > 0")
    return float(theta), normalize_rope_scaling(params, max_position_embeddings=max_pos)


def _attention_bias(raw: dict[str, Any], arch: str) -> bool:
    # Qwen2 hard-codes bias on q/k/v (its config has no key for it), Qwen2-MoE reads qkv_bias; Mistral
    # and Mixtral never have one.
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return _bool(raw, "qkv_bias", True)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return False
    return _bool(raw, "attention_bias", False)


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if not isinstance(value, list) else value
    if not all(_is_int(v) and v >= 0 for v in ids):
        raise _bad_field("eos_token_id", value, "a token id (an int >= 0) or a list of them")
    return tuple(ids)


def _warn_sliding_window(raw: dict[str, Any], arch: str) -> None:
    # Attention backends are full-causal; a window shorter than the context would
    # change results past the window, so say so instead of failing to load.
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") and not raw.get(
        "use_sliding_window", False
    ):
        window = None
    if window is not None:
        logger.warning(
            "config sets sliding_window=%s; graphrunner attends over the full context, so "
            "outputs past %s tokens differ from the reference model",
            window,
            window,
        )


# ---------------------------------------------------------------------------- weights


def iter_checkpoint_weights(folder: str | Path, *, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, CPU tensor) from a folder's safetensors.

    One `model.safetensors`, or the shards listed in `model.safetensors.index.json`
    (every shard is checked to exist before the first tensor is yielded). With
    `progress`, a tqdm bar over shards is shown when there is more than one. A file that
    is truncated or not safetensors raises `CheckpointError` naming it.
    """
    for _, name, tensor in _iter_file_tensors(_checkpoint_files(Path(folder)), progress=progress):
        yield name, tensor


def _iter_file_tensors(files: list[Path], *, progress: bool = False) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, HF tensor name, CPU tensor) from `files` in order."""
    bar = None
    if progress and len(files) > 1:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(files), desc="loading shards", unit="shard")
    try:
        for file in files:
            with _open_safetensors(file) as f:
                for name in f.keys():
                    yield file, name, _read_tensor(f, file, name)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _open_safetensors(file: Path) -> Any:
    """`safe_open(file)`; CheckpointError naming the file when its header cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except OSError as e:
        raise CheckpointError(f"checkpoint file {str(file)!r} cannot be read: {e}") from e
    except SafetensorError as e:
        # The header's offsets reach past the end of the file: the file was cut short
        # (an interrupted download or copy). Anything else: not a safetensors file at all.
        what = (
            "is truncated (its header describes more tensor data than the file holds)"
            if "incomplete metadata" in str(e)
            else "is not a safetensors file (or is truncated inside its header)"
        )
        raise CheckpointError(f"checkpoint file {str(file)!r} {what}: {e}") from e


def _read_tensor(f: Any, file: Path, name: str) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return f.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"checkpoint file {str(file)!r}: cannot read tensor {name!r}: {e}") from e


def _checkpoint_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{str(index)!r} has no 'weight_map' object of tensor name -> shard file")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {str(file)!r} listed in {str(index)!r} is missing")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    for file in others:
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} is not a regular file (a directory?)")
    if others:
        return others
    raise FileNotFoundError(f"no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}) in folder {str(folder)!r}")


def _load_checkpoint(model: LlamaForCausalLM, folder: Path) -> None:
    """Fill `model` from the folder's safetensors, then check that every weight is finite.

    A misshaped or duplicate tensor is reported with the file it came from, a missing one
    with the folder."""
    files = _checkpoint_files(folder)
    current: list[Path] = []  # the file of the tensor being loaded; empty once all are
    expected = _checkpoint_names(model)
    harmless: list[str] = []
    kv_scales: list[tuple[str, torch.Tensor]] = []  # fp8 KV-cache scales: buffers, not weights

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for file, name, tensor in _iter_file_tensors(files, progress=True):
            current[:] = [file]
            if is_kv_scale_name(name):
                kv_scales.append((name, tensor))
                continue
            if name not in expected:
                if name.endswith(_HARMLESS_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
                    harmless.append(name)
                    continue
                raise CheckpointError(f"checkpoint file {str(file)!r}: unexpected tensor {name!r}; "
                                      f"{model.config.architecture} has no such weight")
            if not tensor.dtype.is_floating_point:
                raise CheckpointError(f"checkpoint file {str(file)!r}: tensor {name!r} has dtype {tensor.dtype}; "
                                      "weights must be floating point")
            yield name, tensor
        current.clear()

    try:
        model.load_weights(stream())
    except CheckpointError:
        raise
    except ValueError as e:
        where = f"checkpoint file {str(current[0])!r}" if current else f"checkpoint folder {str(folder)!r}"
        raise CheckpointError(f"{where}: {e}") from e
    try:
        load_kv_scales(model, kv_scales)
    except ValueError as e:
        raise CheckpointError(f"checkpoint folder {str(folder)!r}: {e}") from e
    _check_finite(model, files)
    if harmless:
        logger.warning("ignored %d checkpoint tensor(s) the model recomputes: %s", len(harmless), harmless[:8])


# Buffers some checkpoints save that the model derives itself.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


def _checkpoint_names(model: LlamaForCausalLM) -> set[str]:
    """The tensor names the unsharded model reads (a TP/PP rank loads a part of them)."""
    from graphrunner.attention.torch_ref import TorchReferenceBackend

    names = getattr(model, "checkpoint_names", None)
    if callable(names):  # models other than the plain causal LM name their own
        return set(names())
    from graphrunner.models.llama import LlamaForCausalLM

    full = LlamaForCausalLM(model.config, TorchReferenceBackend(), dtype=torch.float32, device="meta")
    targets, alternates = full._weight_targets()
    return set(targets) | set(alternates)


@torch.no_grad()
def _check_finite(model: torch.nn.Module, files: list[Path]) -> None:
    """CheckpointError naming the first non-finite (NaN or inf) checkpoint tensor and its file.

    Cost: one read of the loaded weights on their device (one min/max reduction per
    parameter, bandwidth-bound; NaN propagates through both) and one host sync. Only when
    a parameter fails are the files read again on the CPU, to name the culprit. Checking
    the parameters, not the files, also catches values that overflow the runtime dtype
    (an fp32 checkpoint loaded as float16).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.dtype.is_floating_point and p.numel() > 0]
    if not params:
        return
    # e4m3 has no infinities, and NaN is its one all-ones magnitude (0x7f): a bit test, not aminmax
    # (which fp8 lacks).
    extremes = torch.stack([
        torch.stack(torch.aminmax(p)).float() if p.dtype != torch.float8_e4m3fn
        else torch.where(((p.view(torch.uint8) & 0x7F) == 0x7F).any(), math.nan, 0.0).float().expand(2)
        for _, p in params])
    finite = torch.isfinite(extremes).all(dim=1).tolist()
    if all(finite):
        return
    param, tensor = params[finite.index(False)]
    for file, name, source in _iter_file_tensors(files):
        if source.dtype.is_floating_point and source.numel() > 0 and not bool(torch.isfinite(source.float()).all()):
            bad = torch.count_nonzero(~torch.isfinite(source.float())).item()
            raise CheckpointError(
                f"checkpoint file {str(file)!r}: tensor {name!r} has {bad} non-finite (NaN or inf) value(s) "
                f"of {source.numel()}; the checkpoint is damaged"
            )
    raise CheckpointError(
        f"parameter {param!r} is not finite after casting the checkpoint in {str(files[0].parent)!r} to "
        f"{tensor.dtype}: its values overflow that dtype; load it in a wider one (e.g. dtype='bfloat16')"
    )


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, *, seed: int, std: float = 0.02, exclude: tuple[str, ...] = ()) -> None:
    """Fill every parameter in place with reproducible random values on its own device.

    Matrices and biases ~ N(0, std); norm weights ~ 1 + N(0, std), so activations stay
    finite through deep stacks while outputs still vary with the input. Parameters whose
    names start with one of `exclude` are left alone and draw nothing (the others get the
    values they get without them).
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.startswith(exclude):
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if param.dtype.is_floating_point:
            param.normal_(0.0, std, generator=gen)
            if name.endswith("norm.weight"):  # RMSNorm scales: near 1, not near 0
                param.add_(1.0)


@torch.no_grad()
def init_dummy_weights_sharded(model: LlamaForCausalLM, *, seed: int, std: float = 0.02) -> None:
    """Dummy weights of a TP/PP-sharded model equal to the single-process model's shards.

    Walks the parameters of the *unsharded* model (built on the meta device, so nothing
    is allocated), draws each full tensor exactly as `init_dummy_weights` would (same
    generator, same order, same shape), and keeps this rank's share. One full tensor
    exists at a time.
    """
    from graphrunner.attention.torch_ref import TorchReferenceBackend
    from graphrunner.models.llama import LlamaForCausalLM

    # The full model only names and shapes the parameters: its attention never runs.
    full = LlamaForCausalLM(
        model.config, TorchReferenceBackend(), dtype=next(model.parameters()).dtype, device="meta"
    )
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, meta in full.named_parameters():
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if tensor.dtype.is_floating_point:
            tensor.normal_(0.0, std, generator=gen)
            if name.endswith("norm.weight"):
                tensor.add_(1.0)
        model.load_full_parameter(name, tensor)
    # Parameters the causal LM has not (a pooling classifier's `score` head, replicated on every rank)
    # come last in the single-process model too: drawn next, from the same generator.
    drawn = {name for name, _ in full.named_parameters()}
    for name, param in model.named_parameters():
        if name not in drawn and param.dtype.is_floating_point:
            param.normal_(0.0, std, generator=gen)


@torch.no_grad()
def full_parameter(model_config: ModelConfig, load_config: LoadConfig, name: str, dtype: torch.dtype,
                   device: torch.device | str) -> torch.Tensor:
    """The full (unsharded) value of the single-process model's parameter `name`, as `load_model`
    fills it: drawn like the dummy weights (the parameters before it are drawn and dropped: the
    embedding comes first) or read from the checkpoint folder. For a stage that needs a weight
    another pipeline stage owns (an EAGLE head's copy of the target embedding)."""
    from graphrunner.attention.torch_ref import TorchReferenceBackend
    from graphrunner.models.llama import LlamaForCausalLM

    device = torch.device(device)
    if load_config.load_format == "dummy" or is_builtin(load_config.model):
        full = LlamaForCausalLM(model_config, TorchReferenceBackend(), dtype=dtype, device="meta")
        gen = torch.Generator(device=device).manual_seed(load_config.seed)
        for param_name, meta in full.named_parameters():
            tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            if tensor.dtype.is_floating_point:
                tensor.normal_(0.0, 0.02, generator=gen)
                if param_name.endswith("norm.weight"):
                    tensor.add_(1.0)
            if param_name == name:
                return tensor
        raise ValueError(f"{model_config.name!r} has no parameter {name!r}")
    for tensor_name, tensor in iter_checkpoint_weights(load_config.model):
        if tensor_name == name:
            return tensor.to(device=device, dtype=dtype)
    raise CheckpointError(f"checkpoint folder {load_config.model!r} has no tensor {name!r}")


def generative_model_class(architecture: str) -> Callable[..., LlamaForCausalLM]:
    """The model class a generative runner builds for `architecture` (ValueError naming a
    pooling-only one: it has no LM head)."""
    from graphrunner.models.registry import check_runner_kind

    check_runner_kind(architecture, "generate")
    if architecture == "LlavaForConditionalGeneration":
        from graphrunner.models.llava import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        from graphrunner.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    from graphrunner.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def load_model(
    model_config: ModelConfig,
    load_config: LoadConfig,
    *,
    attn_backend: Any,
    dtype: torch.dtype | str,
    device: torch.device | str,
    tp: Any = None,
    pp_rank: int = 0,
    pp_size: int = 1,
    kernel: KernelConfig | None = None,
    model_cls: Callable[..., LlamaForCausalLM] | None = None,
) -> LlamaForCausalLM:
    """Build a `LlamaForCausalLM` on `device` in `dtype` and fill its weights.

    `load_format="dummy"` (always, for builtins): random weights from `load_config.seed`.
    `"auto"`: safetensors from the folder `load_config.model` (cast and moved as loaded).
    `tp` (a `TPComm`), `pp_rank`/`pp_size`: build and fill only this rank's shard; dummy
    weights are then the shards of the single-process model's dummy weights. `kernel` (default
    `KernelConfig()`) picks the layers' kernels. `model_cls`: a constructor with
    `LlamaForCausalLM`'s arguments (a pooling runner's); None: the generative model of the
    architecture (ValueError for a pooling-only one).
    """
    if load_config.load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_config.load_format!r}; allowed: {list(LOAD_FORMATS)}")
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    start = time.perf_counter()
    dummy = load_config.load_format == "dummy" or is_builtin(load_config.model)
    quant = model_config.quant
    if dummy and quant is not None and quant.prequantized:  # no fp8 tensors to read: draw, then quantize
        model_config = dataclasses.replace(model_config, quant=quant.for_dummy_weights())
    if model_cls is None:
        model_cls = generative_model_class(model_config.architecture)
    model = model_cls(model_config, attn_backend, dtype=dtype, device=device, tp=tp, pp_rank=pp_rank,
                      pp_size=pp_size, kernel=kernel)
    sharded = model.tp.ep_size > 1 or pp_size > 1  # ep_size: TP, times DP under DP + EP
    if dummy:
        if sharded:
            init_dummy_weights_sharded(model, seed=load_config.seed)
        else:
            init_dummy_weights(model, seed=load_config.seed)
        source = f"dummy weights (seed {load_config.seed})"
    else:
        _load_checkpoint(model, Path(load_config.model))
        source = repr(load_config.model)
    quantized = quantize_linear_layers(model)
    if quantized:
        source += f", {quantized} projections in fp8"
    if model_config.quant is not None and not model_config.quant.prequantized:
        sparse = [m for m in model.modules() if isinstance(m, FusedMoE)]
        for moe in sparse:
            moe.quantize_fp8()
        if sparse:
            source += f", the experts of {len(sparse)} sparse layers in fp8"
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # so the logged time includes the copies
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "loaded %s from %s: %.2f GiB of parameters (%s) in %.2f s",
        model_config.name,
        source,
        nbytes / 2**30,
        dtype,
        time.perf_counter() - start,
    )
    return model
