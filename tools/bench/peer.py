"""Peer comparison: Hugging Face transformers `generate` on the SAME weights, in the same run.

    hf_model_from_runner(runner_model, model_config, dtype, device) -> transformers model
    run_peer(hf_model, prompts, output_len, *, variants, compile_backend)  -> list[PeerRow]
    compare_with_peer(runner_model, model_config, ...)                      -> PeerComparison

The transformers model is built from a config equivalent to our `ModelConfig` and filled
with OUR parameters (the fused q|k|v and gate|up matrices split back into HF names), so
that a throughput ratio compares engines, not weights. Variants:

  hf-eager            `generate` with the default dynamic KV cache, no compilation
  hf-static-compile   `cache_implementation="static"` with the decode forward compiled by
                      torch.compile (inductor, mode "reduce-overhead" = CUDA graphs); one
                      untimed warmup generate of the same shape compiles it first

Both are greedy, `max_new_tokens = min_new_tokens = O`, EOS disabled, on a batch of
same-length prompts (no padding). A variant that fails (transformers APIs move between
versions) is recorded with its error string; the others still run. transformers is a
test/benchmark-only dependency: it is imported lazily and its absence is reported as
`PeerUnavailable`, never as an import error of this module.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from graphrunner.config import ModelConfig

PEER_VARIANTS = ("hf-eager", "hf-static-compile")
AGREEMENT_TOKENS = 8  # greedy tokens compared on the first prompt (bf16 may diverge later)
_MAX_ERROR_CHARS = 600

# Our architecture name -> the transformers config class of the same model.
_HF_CONFIG_CLASSES: Mapping[str, str] = MappingProxyType(
    {
        "LlamaForCausalLM": "LlamaConfig",
        "MistralForCausalLM": "MistralConfig",
        "Qwen2ForCausalLM": "Qwen2Config",
        "Qwen3ForCausalLM": "Qwen3Config",
    }
)


class PeerUnavailable(RuntimeError):
    """The peer cannot run at all here (transformers is not installed)."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise PeerUnavailable(
            "transformers not installed: pip install transformers to run the peer comparison"
        ) from None
    return transformers


# ---------------------------------------------------------------------------- the model


def hf_config_from_model_config(cfg: ModelConfig):
    """A transformers config equivalent to `cfg` (same shapes, norms, rope, bias, tying).

    EOS/BOS/PAD are left unset: the peer never stops early, like `ignore_eos` on our side.
    """
    transformers = _transformers()
    if cfg.architecture not in _HF_CONFIG_CLASSES:
        raise ValueError(
            f"architecture={cfg.architecture!r} has no transformers peer; allowed: {sorted(_HF_CONFIG_CLASSES)}"
        )
    config_cls = getattr(transformers, _HF_CONFIG_CLASSES[cfg.architecture])
    fields: dict[str, Any] = dict(
        architectures=[cfg.architecture],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if cfg.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        fields["attention_bias"] = cfg.attention_bias  # Qwen2 hard-codes q/k/v bias; Mistral has none
    if cfg.architecture == "LlamaForCausalLM":
        fields["mlp_bias"] = False
    if cfg.architecture == "MistralForCausalLM":
        fields["sliding_window"] = None  # our backends attend over the full context
    if cfg.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        fields["use_sliding_window"] = False
    rope = dict(cfg.rope_scaling or {"rope_type": "default"})
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        fields["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}  # transformers >= 5
    else:  # older transformers: theta and scaling are separate keys
        fields["rope_theta"] = cfg.rope_theta
        fields["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    return config_cls(**fields)


def _no_init_weights():
    """transformers' context that skips random init (the weights are overwritten anyway)."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def hf_state_from_runner(runner_model: nn.Module) -> dict[str, torch.Tensor]:
    """HF tensor name -> a view of OUR parameter holding that tensor (no copies).

    Fused parameters are split back: qkv_proj -> q_proj | k_proj | v_proj and
    gate_up_proj -> gate_proj | up_proj. Raises ValueError for a tensor-parallel shard
    (only the full, tp_size=1 model maps onto a transformers model).
    """
    from graphrunner.models.llama import MLP, LlamaForCausalLM

    if not isinstance(runner_model, LlamaForCausalLM):
        raise TypeError(f"the peer maps a LlamaForCausalLM onto transformers, not a {type(runner_model).__name__}")
    m = runner_model.model
    if m.embed_tokens is None or m.norm is None or m.num_local_layers != len(m.layers):
        raise ValueError("the peer needs the full model (pp_size=1), not one pipeline stage")
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": m.embed_tokens.weight,
        "model.norm.weight": m.norm.weight,
    }
    if runner_model.lm_head is not None:
        out["lm_head.weight"] = runner_model.lm_head.weight
    for i, layer in enumerate(m.local_layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, MLP):
            raise ValueError(f"layer {i} holds experts: the peer maps dense models only")
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if linear.tp_size != 1:
                raise ValueError(f"layer {i}: tp_size={linear.tp_size}; the peer needs the full model (tp_size=1)")
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        qkv = attn.qkv_proj
        for param in ("weight", "bias"):
            fused = getattr(qkv, param)
            if fused is None:
                continue
            q, k, v = fused.split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=0)  # rows: q | k | v
            out.update({f"{p}self_attn.{s}_proj.{param}": t for s, t in zip("qkv", (q, k, v), strict=True)})
        out[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        if attn.o_proj.bias is not None:
            out[p + "self_attn.o_proj.bias"] = attn.o_proj.bias
        if attn.q_norm is not None and attn.k_norm is not None:
            out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight
            out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight
        gate, up = mlp.gate_up_proj.weight.split(list(mlp.gate_up_proj.out_sizes), dim=0)  # rows: gate | up
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = mlp.down_proj.weight
    covered = sum(t.numel() for t in out.values())
    total = sum(t.numel() for t in runner_model.parameters())
    if covered != total:  # a parameter this mapping does not know would silently differ
        raise ValueError(f"HF name mapping covers {covered} of the model's {total} parameter elements")
    return out


@torch.no_grad()
def hf_model_from_runner(
    runner_model: nn.Module,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    attn_implementation: str = "sdpa",
):
    """A transformers CausalLM with `model_config`'s architecture holding OUR weights.

    Built directly on `device` in `dtype` with random init skipped, then every HF
    parameter is copied from `runner_model` (see `hf_state_from_runner`). Raises
    PeerUnavailable without transformers, ValueError naming any tensor that is missing
    on either side or has a different shape.
    """
    transformers = _transformers()
    config = hf_config_from_model_config(model_config)
    with torch.device(device), _no_init_weights():
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if model_config.tie_word_embeddings:
        hf.tie_weights()  # skipping init may also have skipped tying
    hf.eval()
    ours = hf_state_from_runner(runner_model)
    theirs = dict(hf.named_parameters())  # tied parameters are listed once
    missing, unexpected = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    if missing or unexpected:
        raise ValueError(
            f"HF/graphrunner parameter names differ: HF-only {missing[:8]}, graphrunner-only {unexpected[:8]}"
        )
    for name, param in theirs.items():
        if tuple(param.shape) != tuple(ours[name].shape):
            raise ValueError(f"{name}: HF shape {tuple(param.shape)} != graphrunner shape {tuple(ours[name].shape)}")
        param.copy_(ours[name])
    if model_config.tie_word_embeddings and hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        raise ValueError("tie_word_embeddings=True but the transformers model did not tie its LM head")
    return hf


# ---------------------------------------------------------------------------- generate


@dataclass
class PeerRow:
    """One peer variant's timed `generate` (or the error that stopped it)."""

    variant: str
    detail: str = ""
    output_tokens: int = 0
    elapsed_seconds: float = 0.0
    warmup_seconds: float = 0.0
    first_tokens: list[int] = field(default_factory=list)  # first prompt, first AGREEMENT_TOKENS generated
    error: str | None = None

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.output_tokens / self.elapsed_seconds if self.error is None and self.elapsed_seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "detail": self.detail,
            "output_tokens": self.output_tokens,
            "elapsed_seconds": self.elapsed_seconds,
            "warmup_seconds": self.warmup_seconds,
            "output_tokens_per_s": self.output_tokens_per_s,
            "first_tokens": self.first_tokens,
            "error": self.error,
        }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generation_config(transformers, output_len: int, **extra: Any):
    # Greedy, exactly output_len tokens: no EOS to stop on; pad is never used (no padding).
    return transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        eos_token_id=None,
        pad_token_id=0,
        **extra,
    )


def _static_compile_kwargs(transformers, hf_model, backend: str) -> tuple[dict[str, Any], str]:
    """GenerationConfig fields for a static cache with a compiled decode forward, and a description."""
    mode = "reduce-overhead" if backend == "inductor" else None  # `mode` is an inductor option
    how = f"torch.compile backend={backend}" + (f" mode={mode}" if mode else "")
    compile_config_cls = getattr(transformers, "CompileConfig", None)
    if compile_config_cls is not None:
        # transformers >= 4.48 compiles the decode step itself when the cache is static;
        # compiling model.forward as well would compile twice. Off CUDA it only does so
        # when told to (`_compile_all_devices`).
        cc = compile_config_cls(backend=backend, mode=mode)
        if hf_model.device.type != "cuda":
            cc._compile_all_devices = True
        return {"cache_implementation": "static", "compile_config": cc}, f"static cache, generate's {how}"
    hf_model.forward = torch.compile(hf_model.forward, backend=backend, mode=mode)
    return {"cache_implementation": "static"}, f"static cache, model.forward {how}"


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


@torch.inference_mode()
def run_peer(
    hf_model,
    prompts: Sequence[Sequence[int]],
    output_len: int,
    *,
    variants: Sequence[str] = PEER_VARIANTS,
    compile_backend: str = "inductor",
    log: Callable[[str], None] | None = None,
) -> list[PeerRow]:
    """Time greedy `hf_model.generate` of `output_len` tokens for the whole batch, per variant.

    `prompts` must all have the same length (HF then needs no padding). Each variant gets
    an untimed warmup generate first (same shape for hf-static-compile, so that its
    compilation and graph capture stay out of the timing). Errors are caught per variant.
    """
    transformers = _transformers()
    bad = [v for v in variants if v not in PEER_VARIANTS]
    if bad:
        raise ValueError(f"unknown peer variants {bad}; allowed: {list(PEER_VARIANTS)}")
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"peer prompts must all have one length (no padding), got lengths {sorted(lengths)}")
    if output_len < 1:
        raise ValueError(f"output_len={output_len} must be >= 1")
    input_ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=hf_model.device)  # [B, L]
    rows = []
    for variant in variants:
        row = PeerRow(variant)
        try:
            _time_variant(row, transformers, hf_model, input_ids, output_len, compile_backend, log)
        except Exception as e:  # record and go on: one broken variant must not hide the others
            row.error = _error_text(e)
            if log:
                log(f"peer {variant}: FAILED: {row.error}")
        rows.append(row)
    return rows


def _time_variant(row: PeerRow, transformers, hf_model, input_ids, output_len, compile_backend, log) -> None:
    """Warm up, then time one generate of `row.variant`; fills `row` in place."""
    fields: dict[str, Any] = {}
    if row.variant == "hf-eager":
        attn = getattr(hf_model.config, "_attn_implementation", "default")
        row.detail = f"dynamic cache, {attn} attention, no compile"
        warmup_config = _generation_config(transformers, min(2, output_len))
        config = _generation_config(transformers, output_len)
    else:
        fields, row.detail = _static_compile_kwargs(transformers, hf_model, compile_backend)
        config = _generation_config(transformers, output_len, **fields)
        warmup_config = config  # the same static-cache shape: compiled (and captured) once, untimed
    attention_mask = torch.ones_like(input_ids)  # [B, L]: same-length prompts, nothing padded
    seconds = []
    for what, gen_config in (("warmup", warmup_config), ("timed generate", config)):
        if log:
            log(f"peer {row.variant}: {what}")
        start = time.perf_counter()
        out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config)
        _synchronize(input_ids.device)
        seconds.append(time.perf_counter() - start)
    row.warmup_seconds, row.elapsed_seconds = seconds
    new = out[:, input_ids.shape[1] :]  # [B, generated]
    if new.shape[1] != output_len:
        raise RuntimeError(f"generate produced {new.shape[1]} new tokens per prompt, expected {output_len}")
    row.output_tokens = new.numel()
    row.first_tokens = new[0, :AGREEMENT_TOKENS].tolist()
    if "compile_config" in fields and not hasattr(hf_model, "_compiled_call"):
        row.detail += " (NOT compiled: generate skipped its auto-compile)"


def token_agreement(ours: Sequence[int], theirs: Sequence[int], n: int = AGREEMENT_TOKENS) -> float | None:
    """Fraction of the first `n` greedy tokens that are equal position by position
    (over the positions both sides have); None when there is nothing to compare."""
    k = min(n, len(ours), len(theirs))
    if k == 0:
        return None
    return sum(a == b for a, b in zip(ours[:k], theirs[:k], strict=True)) / k


# ---------------------------------------------------------------------------- the comparison


@dataclass
class PeerComparison:
    """Peer rows beside our output tokens/s, plus the greedy-agreement sanity check."""

    ours_output_tokens_per_s: float
    ours_first_tokens: list[int]
    rows: list[PeerRow] = field(default_factory=list)
    transformers_version: str | None = None
    skipped: str | None = None  # why the peer did not run at all (e.g. transformers missing)

    @property
    def agreement(self) -> float | None:
        """ours vs hf-eager, first prompt, first AGREEMENT_TOKENS tokens (None if hf-eager did not run)."""
        eager = next((r for r in self.rows if r.variant == "hf-eager" and r.error is None), None)
        return None if eager is None else token_agreement(self.ours_first_tokens, eager.first_tokens)

    def ratio(self, row: PeerRow) -> float | None:
        """ours / peer output tokens/s (> 1: we are faster)."""
        peer = row.output_tokens_per_s
        return self.ours_output_tokens_per_s / peer if peer else None

    @property
    def errors(self) -> list[str]:
        return [f"{r.variant}: {r.error}" for r in self.rows if r.error]

    def to_dict(self) -> dict[str, Any]:
        return {
            "transformers": self.transformers_version,
            "skipped": self.skipped,
            "ours_output_tokens_per_s": self.ours_output_tokens_per_s,
            "ours_first_tokens": self.ours_first_tokens,
            "agreement_tokens": AGREEMENT_TOKENS,  # asked for; fewer are compared when output_len is shorter
            "token_agreement": self.agreement,
            "rows": [{**r.to_dict(), "ours_over_peer": self.ratio(r)} for r in self.rows],
        }


def compare_with_peer(
    runner_model: nn.Module,
    model_config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    prompts: Sequence[Sequence[int]],
    output_len: int,
    ours_output_tokens_per_s: float,
    ours_first_tokens: Sequence[int],
    variants: Sequence[str] = PEER_VARIANTS,
    compile_backend: str = "inductor",
    log: Callable[[str], None] | None = None,
) -> PeerComparison:
    """Build the peer from `runner_model`'s weights and run every variant.

    Without transformers the comparison comes back with `skipped` set and no rows.
    The caller should drop its own references to `runner_model` afterwards: the peer
    holds a second copy of the weights until this returns.
    """
    result = PeerComparison(ours_output_tokens_per_s, list(ours_first_tokens[:AGREEMENT_TOKENS]))
    try:
        result.transformers_version = _transformers().__version__
    except PeerUnavailable as e:
        result.skipped = str(e)
        return result
    if log:
        log(f"peer: building transformers {model_config.architecture} with graphrunner's weights")
    try:
        hf = hf_model_from_runner(runner_model, model_config, dtype, device)
    except Exception as e:  # our numbers stand; say why the peer has none
        result.skipped = f"could not build the transformers model: {_error_text(e)}"
        return result
    try:
        result.rows = run_peer(hf, prompts, output_len, variants=variants, compile_backend=compile_backend, log=log)
    finally:
        del hf
    return result


# ---------------------------------------------------------------------------- rendering


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def peer_text(cmp: PeerComparison) -> str:
    """Readable lines: one per peer variant with tok/s and ours/peer, then the agreement."""
    if cmp.skipped:
        return f"peer (Hugging Face transformers): skipped: {cmp.skipped}"
    lines = [f"peer: Hugging Face transformers {cmp.transformers_version} generate, same weights, prompts and lengths"]
    lines.append(f"  {'graphrunner':18s} {cmp.ours_output_tokens_per_s:12.1f} output tok/s")
    for r in cmp.rows:
        if r.error:
            lines.append(f"  {r.variant:18s} FAILED: {r.error}")
        else:
            lines.append(
                f"  {r.variant:18s} {r.output_tokens_per_s:12.1f} output tok/s   ours/peer {_fmt(cmp.ratio(r), '.2f')}x"
                f"   ({r.detail})"
            )
    agree = cmp.agreement
    lines.append(
        f"  greedy agreement with hf-eager (first prompt, first {AGREEMENT_TOKENS} tokens): "
        + ("n/a" if agree is None else f"{100 * agree:.0f}%")
    )
    return "\n".join(lines)


def peer_markdown(cmp: PeerComparison) -> str:
    """A markdown table of ours and the peer variants."""
    if cmp.skipped:
        return f"\n- peer skipped: {cmp.skipped}\n"
    lines = [
        "",
        f"Peer: Hugging Face transformers {cmp.transformers_version} (same weights, same prompts)",
        "",
        "| engine | output tok/s | ours / peer | note |",
        "|---|---|---|---|",
        f"| graphrunner | {cmp.ours_output_tokens_per_s:.1f} | 1.00 | |",
    ]
    for r in cmp.rows:
        note = (f"FAILED: {r.error}" if r.error else r.detail).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.variant} | {_fmt(r.output_tokens_per_s, '.1f')} | {_fmt(cmp.ratio(r), '.2f')} | {note} |")
    agree = cmp.agreement
    lines += ["", f"- greedy agreement with hf-eager (first prompt, first {AGREEMENT_TOKENS} tokens): "
              + ("n/a" if agree is None else f"{100 * agree:.0f}%")]
    return "\n".join(lines) + "\n"
