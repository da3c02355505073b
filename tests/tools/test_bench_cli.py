"""`graphrunner bench` on a CPU: structure and invariants of the outputs, never golden numbers.

The three subcommands run end to end on builtin:tiny-llama at tiny sizes; the helpers
behind them (roofline byte counts, timing statistics, length sampling) are checked
against independent references.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.dispatch import default_capture_sizes
from graphrunner.cli import main
from graphrunner.cli_args import parse_int_list
from graphrunner.config import LoadConfig
from graphrunner.models.loader import load_model, load_model_config
from graphrunner_tools.bench.common import Stats
from graphrunner_tools.bench.roofline import (
    expected_active_experts,
    kv_bytes_per_token,
    measure_copy_bandwidth,
    weight_bytes_read,
)
from graphrunner_tools.bench.throughput import sample_lengths

MODEL = "builtin:tiny-llama"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# Small copy probe: the bandwidth figure is not under test here, its plumbing is.
COPY = ["--copy-mib", "8"]


def _latency_argv(path, *extra: str, modes: str = "NONE,FULL") -> list[str]:
    return [
        "bench", "latency", "--model", MODEL, "--batch-sizes", "1,2", "--context", "16", "--steps", "3",
        "--warmup", "1", "--modes", modes, "--device", "cpu", "--json", str(path), *COPY, *extra,
    ]


# ---- latency ------------------------------------------------------------------------
def test_latency_writes_one_row_per_mode_and_batch(tmp_path):
    out, md = tmp_path / "lat.json", tmp_path / "lat.md"
    extra = ["--markdown", str(md)] + (["--png", str(tmp_path / "lat.png")] if HAS_MATPLOTLIB else [])
    assert main(_latency_argv(out, *extra)) == 0

    data = json.loads(out.read_text())
    assert data["kind"] == "latency"
    assert data["env"]["torch"] == torch.__version__ and data["env"]["device"] == "cpu"
    assert data["bandwidth"]["bytes_per_s"] > 0 and data["bandwidth"]["method"].startswith("cpu memcpy")
    rows = data["rows"]
    assert sorted((r["mode"], r["batch_size"]) for r in rows) == [("FULL", 1), ("FULL", 2), ("NONE", 1), ("NONE", 2)]
    assert [m["error"] for m in data["modes"]] == [None, None]

    config = load_model_config(MODEL)
    kv_per_token = kv_bytes_per_token(config, 4)  # CPU auto dtype is float32
    for r in rows:
        bs = r["batch_size"]
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["device_median_ms"] is None  # no CUDA events on a CPU
        assert r["tokens_per_s"] == pytest.approx(bs / (r["median_ms"] / 1e3))
        # The decode batch ran the graph of its own size (capture sizes = batch sizes): no padding.
        assert r["descriptor"].startswith(f"{r['mode']}(t={bs},")
        # Requests start at context 16; admission + 1 warmup step precede 3 timed steps.
        assert r["mean_seq_len"] == 16 + 1 + 1 + (3 - 1) / 2
        assert r["kv_bytes"] == bs * r["mean_seq_len"] * kv_per_token
        assert r["weight_bytes"] > 0 and r["roofline_ms"] > 0
        assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / r["median_ms"])
    full = next(m for m in data["modes"] if m["mode"] == "FULL")
    assert full["num_graphs"] >= 2 and full["capture_seconds"] > 0

    table = md.read_text()
    assert table.count("\n| NONE |") == 2 and table.count("\n| FULL |") == 2
    if HAS_MATPLOTLIB:
        assert (tmp_path / "lat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_with_fp8_kv_reports_the_dtype_and_reads_one_byte_per_element(tmp_path):
    """--kv-cache-dtype fp8: the runners' caches are float8_e4m3fn, the report says so, and the
    roofline's KV bytes use the 1-byte element (a quarter of the CPU's fp32 cache)."""
    out, md = tmp_path / "lat.json", tmp_path / "lat.md"
    assert main(_latency_argv(out, "--kv-cache-dtype", "fp8", "--markdown", str(md), modes="NONE")) == 0
    data = json.loads(out.read_text())
    assert data["spec"]["kv_cache_dtype"] == "fp8"
    assert [m["kv_cache_dtype"] for m in data["modes"]] == ["float8_e4m3fn"]
    kv_per_token = kv_bytes_per_token(load_model_config(MODEL), 1)
    for r in data["rows"]:
        assert r["kv_bytes"] == r["batch_size"] * r["mean_seq_len"] * kv_per_token
    assert "KV cache: float8_e4m3fn (kv_cache_dtype=fp8)" in md.read_text()


def test_latency_refuses_an_unknown_kv_cache_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--model", MODEL, "--device", "cpu", "--kv-cache-dtype", "int8"])
    assert "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_latency_with_lora_adapters_times_base_and_lora(tmp_path):
    """`--num-loras 2 --lora-rank 4`: each batch is timed on the base model, then with request i running
    dummy adapter i mod 2 on the LoRA graphs of its size; the LoRA row carries its ratio to the base row."""
    out = tmp_path / "lat.json"
    assert main(_latency_argv(out, "--num-loras", "2", "--lora-rank", "4")) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["mode"], r["batch_size"], r["num_loras"]) for r in rows) == [
        ("FULL", 1, 0), ("FULL", 1, 1), ("FULL", 2, 0), ("FULL", 2, 2),
        ("NONE", 1, 0), ("NONE", 1, 1), ("NONE", 2, 0), ("NONE", 2, 2)]
    for r in rows:
        assert ("lora" in r["descriptor"]) == bool(r["num_loras"])
        assert (r["lora_over_base"] is None) == (not r["num_loras"])
        if r["num_loras"]:
            assert r["lora_over_base"] > 0
            assert r["descriptor"].startswith(f"{r['mode']}(t={r['batch_size']},")  # its own LoRA graph


def test_latency_failed_mode_is_reported_and_others_still_measured(tmp_path, monkeypatch, capsys):
    from graphrunner.runner import ModelRunner

    def broken_capture(self, **kwargs):
        raise RuntimeError("capture exploded on purpose")

    monkeypatch.setattr(ModelRunner, "capture_model", broken_capture)
    out = tmp_path / "lat.json"
    assert main(_latency_argv(out)) == 1
    data = json.loads(out.read_text())
    assert {r["mode"] for r in data["rows"]} == {"NONE"}
    errors = {m["mode"]: m["error"] for m in data["modes"]}
    assert errors["NONE"] is None and "capture exploded on purpose" in errors["FULL"]
    assert "capture exploded on purpose" in capsys.readouterr().err


def test_latency_piecewise_with_eager_backend(tmp_path):
    out = tmp_path / "lat.json"
    rc = main(_latency_argv(out, "--compile-backend", "eager", modes="PIECEWISE"))
    data = json.loads(out.read_text())
    error = data["modes"][0]["error"]
    if error and "NotImplementedError" in error:
        pytest.skip(f"PIECEWISE is not wired into the runner yet: {error}")
    assert rc == 0, error
    assert [r["descriptor"].split("(")[0] for r in data["rows"]] == ["PIECEWISE", "PIECEWISE"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--batch-sizes", "1,x"], "--batch-sizes"),
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--modes", "NONE,WARP"], "allowed"),
        (["--capture-sizes", "1,-2"], "--capture-sizes"),
        (["--steps", "0"], "steps=0"),
    ],
)
def test_latency_bad_arguments_exit_with_a_named_error(argv, needle):
    base = ["bench", "latency", "--model", MODEL, "--device", "cpu", "--batch-sizes", "1", "--modes", "NONE"]
    with pytest.raises(SystemExit) as exc:
        main(base + argv)
    assert needle in str(exc.value)


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed")
def test_latency_png_without_matplotlib_fails_fast(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(_latency_argv(tmp_path / "x.json", "--png", str(tmp_path / "x.png")))
    assert "matplotlib" in str(exc.value)
    assert not (tmp_path / "x.json").exists()  # failed before measuring anything


# ---- capture ------------------------------------------------------------------------
def test_capture_prints_report_and_json(tmp_path, capsys):
    out = tmp_path / "cap.json"
    argv = ["bench", "capture", "--model", MODEL, "--mode", "FULL", "--device", "cpu", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "4", "--max-model-len", "32", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    report = data["report"]
    assert data["capture_sizes"] == list(default_capture_sizes(2, 4))
    assert report["mode"] == "FULL" and report["num_graphs"] == len(report["records"]) > 0
    captured_sizes = {int(rec["key"].split("t=")[1].split(",")[0]) for rec in report["records"]}
    assert captured_sizes == set(data["capture_sizes"])
    assert report["total_seconds"] >= sum(rec["seconds"] for rec in report["records"]) > 0
    assert f"{report['num_graphs']} graphs (FULL)" in text
    phases = data["startup_seconds"]
    assert phases == {"load": data["load_seconds"], "compile": report["compile_seconds"],
                      "capture": report["total_seconds"]}
    assert phases["load"] > 0 and phases["capture"] > 0
    assert f"start-up: load {phases['load']:.2f} s / compile {phases['compile']:.2f} s" in text
    for rec in report["records"]:
        assert rec["key"] in text


def test_capture_mode_none_is_rejected():
    with pytest.raises(SystemExit) as exc:
        main(["bench", "capture", "--model", MODEL, "--mode", "NONE", "--device", "cpu"])
    assert "captures nothing" in str(exc.value)


# ---- throughput ---------------------------------------------------------------------
def test_kernels_refuses_a_cpu_by_name(capsys):
    """`bench kernels` reads kernel times from CUPTI: on a CPU it exits naming the need, before building."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="bench kernels needs a CUDA device"):
        main(["bench", "kernels", "--model", "builtin:tiny-llama"])
    # the fp8 weights and KV cache of `bench latency` are taken too (and checked before the device)
    with pytest.raises(SystemExit, match="bench kernels needs a CUDA device"):
        main(["bench", "kernels", "--model", "builtin:tiny-llama", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])


def test_throughput_counts_every_output_token(tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", MODEL, "--device", "cpu", "--num-prompts", "3", "--input-len", "6",
            "--output-len", "3", "--mode", "FULL", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
            "--json", str(out), *COPY]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["input_tokens"] == 3 * 6
    assert data["output_tokens"] == data["expected_output_tokens"] == 3 * 3
    assert data["ideal_batch"] == 2
    assert data["output_tokens_per_s"] == pytest.approx(data["output_tokens"] / data["elapsed_seconds"])
    assert data["ideal_output_tokens_per_s"] > 0
    assert data["ideal_fraction"] == pytest.approx(data["output_tokens_per_s"] / data["ideal_output_tokens_per_s"])
    text = capsys.readouterr().out
    assert "output tokens/s" in text
    # The engine's default loop; no CUDA events on a CPU, so the busy share is reported as not measured.
    assert data["scheduling"] == "async" and data["spec"]["async_scheduling"] is True
    assert data["gpu_busy_fraction"] is None and "GPU busy:            not measured" in text
    assert set(data["startup_seconds"]) == {"load", "compile", "capture"}
    assert data["startup_seconds"]["load"] > 0 and data["startup_seconds"]["capture"] > 0


def test_throughput_no_async_scheduling_runs_the_sync_loop(tmp_path):
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", MODEL, "--device", "cpu", "--num-prompts", "2", "--input-len", "4",
            "--output-len", "2", "--mode", "NONE", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
            "--no-async-scheduling", "--json", str(out), *COPY]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["scheduling"] == "sync" and data["spec"]["async_scheduling"] is False
    assert data["output_tokens"] == data["expected_output_tokens"] == 2 * 2


@pytest.mark.gpu
def test_gpu_throughput_reports_gpu_busy_fraction(tmp_path):
    """On CUDA the steps are bracketed by events: the busy share is a fraction of the run, and the
    runner's execute_model is its own method again afterwards."""
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", MODEL, "--device", "cuda", "--num-prompts", "8", "--input-len", "16",
            "--output-len", "16", "--mode", "FULL", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
            "--json", str(out), *COPY]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert 0.0 < data["gpu_busy_fraction"] <= 1.0


def test_throughput_with_more_adapters_than_max_loras(tmp_path):
    """`--num-loras 3 --max-loras 2`: every prompt runs its dummy adapter, the third waits for a slot;
    every output token is counted."""
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", MODEL, "--device", "cpu", "--num-prompts", "4", "--input-len", "6",
            "--output-len", "3", "--mode", "NONE", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
            "--num-loras", "3", "--max-loras", "2", "--lora-rank", "4", "--json", str(out), *COPY]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["output_tokens"] == data["expected_output_tokens"] == 4 * 3
    assert data["spec"]["num_loras"] == 3 and data["spec"]["max_loras"] == 2


@settings(deadline=None)
@given(n=st.integers(1, 50), mean=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_sample_lengths(n, mean, seed):
    import numpy as np

    fixed = sample_lengths(n, mean, "fixed", np.random.default_rng(seed))
    assert fixed.tolist() == [mean] * n
    uniform = sample_lengths(n, mean, "uniform", np.random.default_rng(seed))
    assert len(uniform) == n
    assert all(max(1, mean // 2) <= x <= max(1, 3 * mean // 2) for x in uniform.tolist())


# ---- roofline and statistics ----------------------------------------------------------
@functools.cache
def _tiny_model(tied: bool, name: str = MODEL):
    config = dataclasses.replace(load_model_config(name), tie_word_embeddings=tied)
    model = load_model(config, LoadConfig(model=name, load_format="dummy"), attn_backend=None,
                       dtype=torch.float32, device="cpu")
    return config, model


@settings(deadline=None)
@given(tied=st.booleans(), num_tokens=st.integers(1, 5000))
def test_weight_bytes_match_parameter_count(tied, num_tokens):
    config, model = _tiny_model(tied)
    V, H = config.vocab_size, config.hidden_size
    got = weight_bytes_read(model, config, num_tokens)
    if tied:
        # One [V, H] matrix serves embedding and LM head: every parameter read once.
        assert got == config.num_params() * 4
    else:
        # The LM head is read whole; the input embedding only for the gathered rows.
        assert got == (config.num_params() - V * H + min(num_tokens, V) * H) * 4


@settings(deadline=None)
@given(num_tokens=st.integers(1, 300))
def test_weight_bytes_of_a_moe_model_count_the_expected_active_experts(num_tokens):
    """tiny-moe: 8 experts, top-2. One token reads 2 experts per layer; many read all 8."""
    config, model = _tiny_model(False, "builtin:tiny-moe")
    moe = config.moe
    assert moe is not None
    V, H, L = config.vocab_size, config.hidden_size, config.num_hidden_layers
    expert = 3 * H * moe.moe_intermediate_size
    active = 8 * (1 - (1 - 2 / 8) ** num_tokens)
    want = config.num_params() - V * H + min(num_tokens, V) * H - L * moe.num_experts * expert
    assert weight_bytes_read(model, config, num_tokens) == pytest.approx((want + L * active * expert) * 4, abs=8 * L)
    if num_tokens == 1:
        assert active == 2
    assert expected_active_experts(128, 8, 8) == pytest.approx(51.6, abs=0.05)  # Qwen3-30B-A3B at batch 8


def test_kv_bytes_per_token_matches_the_runner_cache_layout():
    from tests.runner_driver import make_runner

    runner = make_runner(MODEL, num_blocks=8, max_model_len=32)
    elem = torch.empty((), dtype=runner.dtype).element_size()
    assert kv_bytes_per_token(runner.model_config, elem) * runner.limits.block_size == runner.kv_cache_shape.block_bytes
    allocated = sum(c.numel() * c.element_size() for c in runner.buffers.kv_caches)
    assert allocated == runner.num_kv_blocks * runner.limits.block_size * kv_bytes_per_token(runner.model_config, elem)


def test_copy_bandwidth_on_cpu():
    bw = measure_copy_bandwidth(torch.device("cpu"), 1 << 20, iters=5)
    assert bw.bytes_moved == 2 << 20 and bw.bytes_per_s > 0
    assert bw.bytes_per_s == pytest.approx(bw.bytes_moved / bw.seconds.median)
    with pytest.raises(ValueError, match="nbytes"):
        measure_copy_bandwidth(torch.device("cpu"), 0)


@given(st.lists(st.floats(1e-6, 10.0), min_size=1, max_size=60))
def test_stats(samples):
    s = Stats.of(samples)
    assert s.n == len(samples)
    assert s.min == min(samples) and s.max == max(samples)
    assert s.median == pytest.approx(statistics.median(samples))
    assert s.min <= s.median <= s.p90 <= s.max


def test_parse_int_list():
    assert parse_int_list("1, 8,32", "x") == (1, 8, 32)
    for bad in ("", "a", "1,0", "-1"):
        with pytest.raises(ValueError, match="--bs"):
            parse_int_list(bad, "--bs")


# ---- peer: Hugging Face transformers on the same weights -----------------------------
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")


class _DenseCausalBackend:
    """Ignores the KV cache and attends causally over the whole batch (one prefill)."""

    name = "test-dense"

    def forward(self, q, k, v, kv_cache, metadata, scale, out=None):
        # q: [T, H, D]; k, v: [T, Hkv, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
        ).transpose(0, 1)  # [T, H, D]
        return o if out is None else out.copy_(o)


def _cpu_sized(name: str, **overrides):
    """A builtin's flags (bias, tying, rope scaling, GQA, head_dim) at CPU size."""
    from graphrunner.models import BUILTIN_MODELS

    cfg = BUILTIN_MODELS[name]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    fields = dict(vocab_size=512, hidden_size=group * 2 * cfg.head_dim, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=2 * group, num_key_value_heads=2, name=name + "-cpu")
    return dataclasses.replace(cfg, **{**fields, **overrides})


def _peer_configs():
    tiny = load_model_config(MODEL)
    return {
        "tiny-llama": tiny,
        "qwen2.5-like": _cpu_sized("builtin:qwen2.5-0.5b"),  # qkv bias, tied embeddings
        "llama3.2-like": _cpu_sized("builtin:llama-3.2-1b"),  # llama3 rope scaling, tied
        # Qwen3: q/k RMSNorm, head_dim 32 != hidden / heads = 16, untied.
        "qwen3": dataclasses.replace(tiny, architecture="Qwen3ForCausalLM", qk_norm=True, hidden_size=64,
                                     rms_norm_eps=1e-6, rope_theta=1e6, name="qwen3-cpu"),
    }


@functools.cache
def _ours_and_peer(case: str):
    from graphrunner.models.loader import init_dummy_weights
    from graphrunner_tools.bench.peer import hf_model_from_runner

    config = _peer_configs()[case]
    ours = load_model(config, LoadConfig(model=config.name, load_format="dummy"), attn_backend=_DenseCausalBackend(),
                      dtype=torch.float32, device="cpu")
    init_dummy_weights(ours, seed=5, std=0.1)  # larger than the default: logits O(1), so 1e-4 means something
    return ours, hf_model_from_runner(ours, config, torch.float32, "cpu")


@needs_transformers
@pytest.mark.parametrize("case", ["tiny-llama", "qwen2.5-like", "llama3.2-like", "qwen3"])
@settings(deadline=None)
@given(num_tokens=st.integers(1, 12), offset=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_hf_peer_holds_our_weights(case, num_tokens, offset, seed):
    ours, hf = _ours_and_peer(case)
    assert type(hf).__name__ == ours.config.architecture
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ours.config.vocab_size, (num_tokens,), generator=gen)  # [T]
    pos = torch.arange(offset, offset + num_tokens)  # [T]
    n = ours.config.num_hidden_layers
    with torch.inference_mode():
        got = ours.compute_logits(ours(ids.to(torch.int32), pos, [torch.empty(0)] * n, None))  # [T, V]
        ref = hf(ids[None], position_ids=pos[None]).logits[0].float()  # [T, V]
    assert ref.std() > 0.1, "logits too flat for the tolerance to mean anything"
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # Same weights, not copies of copies: every HF tensor equals the matching slice of ours.
    from graphrunner_tools.bench.peer import hf_state_from_runner

    theirs = dict(hf.named_parameters())
    for name, t in hf_state_from_runner(ours).items():
        assert torch.equal(theirs[name], t), name


def _throughput_peer_argv(path, *extra: str) -> list[str]:
    return ["bench", "throughput", "--model", MODEL, "--device", "cpu", "--num-prompts", "2", "--input-len", "6",
            "--output-len", "4", "--mode", "FULL", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
            "--peer", "--json", str(path), *COPY, *extra]


@needs_transformers
def test_throughput_peer_rows_beside_ours(tmp_path, capsys):
    out, md = tmp_path / "tp.json", tmp_path / "tp.md"
    assert main(_throughput_peer_argv(out, "--markdown", str(md))) == 0
    data = json.loads(out.read_text())
    assert data["output_tokens"] == 2 * 4
    peer = data["peer"]
    assert peer["skipped"] is None and peer["transformers"]
    assert peer["ours_output_tokens_per_s"] == data["output_tokens_per_s"]
    rows = {r["variant"]: r for r in peer["rows"]}
    assert list(rows) == ["hf-eager", "hf-static-compile"]
    assert rows["hf-eager"]["error"] is None, rows["hf-eager"]["error"]  # the eager peer must run on CPU
    for r in rows.values():
        if r["error"] is not None:  # a failed variant is allowed, but must say why
            assert isinstance(r["error"], str) and r["error"] and r["ours_over_peer"] is None
            continue
        assert r["output_tokens"] == 2 * 4 and len(r["first_tokens"]) == 4
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["elapsed_seconds"])
        assert r["ours_over_peer"] == pytest.approx(data["output_tokens_per_s"] / r["output_tokens_per_s"])
    # fp32, same weights, greedy: the first tokens agree exactly.
    assert len(peer["ours_first_tokens"]) == 4
    assert peer["token_agreement"] == 1.0 and peer["ours_first_tokens"] == rows["hf-eager"]["first_tokens"]
    text = capsys.readouterr().out
    assert "hf-eager" in text and "ours/peer" in text
    table = md.read_text()
    assert "| graphrunner |" in table and "| hf-eager |" in table and "| hf-static-compile |" in table


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dist", "uniform"], "dist='fixed'"),
        (["--num-prompts", "3"], "max_num_seqs=2"),
        (["--peer-variants", "hf-eager,vllm"], "allowed"),
    ],
)
def test_throughput_peer_bad_arguments_fail_before_measuring(tmp_path, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(_throughput_peer_argv(tmp_path / "x.json", *argv))
    assert needle in str(exc.value)
    assert not (tmp_path / "x.json").exists()


@needs_transformers
def test_peer_failed_variant_carries_its_error(monkeypatch):
    from graphrunner_tools.bench import peer

    def broken(*args, **kwargs):
        raise RuntimeError("no static cache in this transformers")

    monkeypatch.setattr(peer, "_static_compile_kwargs", broken)
    ours, hf = _ours_and_peer("tiny-llama")
    rows = peer.run_peer(hf, [[1, 2, 3], [4, 5, 6]], 2, compile_backend="eager")
    assert [r.variant for r in rows] == list(peer.PEER_VARIANTS)
    assert rows[0].error is None and rows[0].output_tokens == 4
    assert "RuntimeError: no static cache in this transformers" == rows[1].error
    assert rows[1].output_tokens_per_s is None
    cmp = peer.PeerComparison(100.0, rows[0].first_tokens, rows)
    assert cmp.ratio(rows[0]) == pytest.approx(100.0 / rows[0].output_tokens_per_s) and cmp.ratio(rows[1]) is None
    assert cmp.errors == [f"hf-static-compile: {rows[1].error}"]
    assert "FAILED: RuntimeError" in peer.peer_text(cmp) and "FAILED: RuntimeError" in peer.peer_markdown(cmp)


def test_peer_without_transformers_is_a_named_skip(monkeypatch):
    from graphrunner_tools.bench import peer

    def missing():
        raise peer.PeerUnavailable("transformers not installed: pip install transformers")

    monkeypatch.setattr(peer, "_transformers", missing)
    config, model = _tiny_model(False)
    cmp = peer.compare_with_peer(model, config, dtype=torch.float32, device=torch.device("cpu"), prompts=[[1, 2]],
                                 output_len=2, ours_output_tokens_per_s=1.0, ours_first_tokens=[3, 4])
    assert cmp.rows == [] and "transformers not installed" in cmp.skipped
    assert cmp.to_dict()["token_agreement"] is None
    assert "skipped: transformers not installed" in peer.peer_text(cmp)


@given(ours=st.lists(st.integers(0, 3), max_size=12), theirs=st.lists(st.integers(0, 3), max_size=12))
def test_token_agreement(ours, theirs):
    from graphrunner_tools.bench.peer import AGREEMENT_TOKENS, token_agreement

    k = min(AGREEMENT_TOKENS, len(ours), len(theirs))
    got = token_agreement(ours, theirs)
    if k == 0:
        assert got is None
    else:
        assert got == pytest.approx(sum(ours[i] == theirs[i] for i in range(k)) / k)
        assert token_agreement(ours, ours) == 1.0


@pytest.mark.gpu
def test_gpu_latency_graphs_beat_eager_and_report_device_time(tmp_path):
    """On CUDA: every mode runs, device-event times exist, and FULL replay beats eager at batch 1."""
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", MODEL, "--batch-sizes", "1,8", "--context", "64", "--steps", "10",
            "--warmup", "3", "--modes", "NONE,PIECEWISE,FULL", "--device", "cuda", "--json", str(out), *COPY]
    assert main(argv) == 0
    rows = {(r["mode"], r["batch_size"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 6 and all(r["device_median_ms"] > 0 for r in rows.values())
    assert rows[("FULL", 1)]["median_ms"] < rows[("NONE", 1)]["median_ms"]
