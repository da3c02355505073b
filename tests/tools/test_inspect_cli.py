"""`graphrunner inspect` on a CPU: structure and invariants of its outputs, never golden numbers.

The dispatch-side subcommands (table, explain, simulate) are checked against a
`DispatchTable` built independently from the same inputs; `capture` and `replay` run
end to end on builtin:tiny-llama at tiny sizes (FULL graphs emulated on CPU); a trace
recorded by `generate --record-batches` is simulated, and a trace recorded under graphs
is replayed through the simulator descriptor for descriptor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.dispatch import DispatchTable
from capture.modes import AttentionCGSupport, CUDAGraphMode, resolve_mode
from graphrunner.cli import main

MODEL = "builtin:tiny-llama"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
MODES = [m.name for m in CUDAGraphMode]
SUPPORTS = [s.name for s in AttentionCGSupport]


def _stdout_of(argv: list[str]) -> str:
    # Not capsys: hypothesis tests run many examples inside one function-scoped fixture.
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


def run_json(*argv: str) -> dict:
    return json.loads(_stdout_of(["inspect", *argv, "--json"]))


def run_text(*argv: str) -> str:
    return _stdout_of(["inspect", *argv])


def fails(*argv: str) -> str:
    """The one-line message of a refused command."""
    with pytest.raises(SystemExit) as info:
        main(["inspect", *argv])
    msg = str(info.value.code)
    assert msg.startswith(f"graphrunner inspect {argv[0]}:"), msg
    return msg


def reference_table(mode, support, sizes, max_seqs, max_tokens, q) -> DispatchTable:
    return DispatchTable(
        resolve_mode(mode, support), sizes, max_num_reqs=max_seqs, max_num_batched_tokens=max_tokens,
        uniform_decode_query_len=q,
    )


def table_argv(mode, support, sizes, max_seqs, max_tokens, q) -> list[str]:
    argv = ["--device", "cpu", "--attention-support", support, "--max-num-seqs", str(max_seqs),
            "--max-num-batched-tokens", str(max_tokens), "--num-speculative-tokens", str(q - 1)]
    if mode is not None:
        argv += ["--cudagraph-mode", mode]
    if sizes is not None:
        argv += ["--cudagraph-capture-sizes", ",".join(map(str, sizes))]
    return argv


tables = st.tuples(
    st.one_of(st.none(), st.sampled_from(MODES)),
    st.sampled_from(SUPPORTS),
    st.one_of(st.none(), st.lists(st.integers(1, 80), min_size=1, max_size=6)),
    st.integers(1, 24),  # max_num_seqs
    st.integers(8, 96),  # max_num_batched_tokens
    st.integers(1, 3),  # q
)


# ---- table --------------------------------------------------------------------------
@settings(deadline=None)
@given(tables)
def test_table_json_lists_exactly_the_tables_descriptors(spec):
    mode, support, sizes, max_seqs, max_tokens, q = spec
    if sizes is not None and min(sizes) > max_tokens:
        sizes = sizes + [max_tokens]
    argv = table_argv(*spec[:2], sizes, max_seqs, max_tokens, q)
    try:
        want = reference_table(mode, support, sizes, max_seqs, max_tokens, q)
    except ValueError as e:  # an explicit mode the backend cannot honour: the CLI refuses it too
        assert str(e) in fails("table", *argv)
        return
    data = run_json("table", *argv)
    assert [d["key"] for d in data["descriptors"]] == [str(d) for d in want.descriptors]
    assert data["capture_sizes"] == list(want.capture_sizes)
    assert data["resolution"]["mode"] == want.mode.name
    assert data["uniform_decode_query_len"] == q
    # Candidate runs tile 1..max_num_batched_tokens, each with the table's own candidates.
    runs = data["candidates"]
    assert runs[0]["num_tokens_min"] == 1 and runs[-1]["num_tokens_max"] == max_tokens
    for prev, run in pairwise(runs):
        assert run["num_tokens_min"] == prev["num_tokens_max"] + 1
    for run in runs:
        for t in {run["num_tokens_min"], run["num_tokens_max"]}:
            assert run["candidates"] == [str(d) for d in want.candidates(t)]


def test_table_text_shows_resolution_sizes_and_every_descriptor():
    argv = table_argv("FULL", "UNIFORM_DECODE", [1, 2, 4, 8], 8, 32, 1)
    out = run_text("table", *argv)
    want = reference_table("FULL", "UNIFORM_DECODE", [1, 2, 4, 8], 8, 32, 1)
    assert "downgraded from FULL" in out and want.resolution.reason in out
    assert "capture sizes:  [1, 2, 4, 8]" in out
    for d in want.descriptors:
        assert f"\n  {d}\n" in out
    assert "(none: NONE, eager)" in out  # 9..32 tokens have no graph


def test_table_default_support_follows_the_device():
    data = run_json("table", "--device", "cpu")
    assert data["attention_support"] == "ALWAYS"  # FULL is emulated on a CPU
    assert data["resolution"]["mode"] == CUDAGraphMode.FULL_AND_PIECEWISE.name


# ---- explain ------------------------------------------------------------------------
@settings(deadline=None)
@given(
    st.sampled_from(["FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY", "PIECEWISE", "NONE"]),
    st.integers(1, 2),
    st.one_of(
        st.lists(st.integers(1, 2), min_size=1, max_size=12),  # often uniform
        st.lists(st.integers(1, 20), min_size=1, max_size=6),  # mostly mixed
    ),
)
def test_explain_prints_the_descriptor_dispatch_returns(mode, q, lens):
    sizes = [1, 2, 4, 8, 16, 32]
    argv = table_argv(mode, "ALWAYS", sizes, 16, 64, q)
    table = reference_table(mode, "ALWAYS", sizes, 16, 64, q)
    if sum(lens) > 64:
        lens = lens[:1]
    uniform = q if all(n == q for n in lens) else None  # the runner's classification
    want = table.dispatch(len(lens), sum(lens), uniform)

    data = run_json("explain", *argv, "--query-lens", ",".join(map(str, lens)))
    assert data["descriptor"] == str(want)
    assert data["batch"] == {"num_reqs": len(lens), "num_tokens": sum(lens), "uniform": uniform, "has_lora": False}
    assert data["padding_tokens"] == want.num_tokens - sum(lens) >= 0
    assert data["padding_reqs"] == (want.num_reqs - len(lens) if want.is_full else 0) >= 0
    assert data["waste"] == pytest.approx(data["padding_tokens"] / want.num_tokens)
    accepted = [v for v in data["verdicts"] if v["verdict"] == "accepted"]
    assert [v["descriptor"] for v in accepted] == ([] if want.is_eager else [str(want)])

    text = run_text("explain", *argv, "--query-lens", ",".join(map(str, lens)))
    assert f"descriptor:     {want}\n" in text


def test_explain_by_sizes():
    argv = table_argv("FULL_AND_PIECEWISE", "ALWAYS", [1, 2, 4, 8], 8, 32, 2)
    table = reference_table("FULL_AND_PIECEWISE", "ALWAYS", [1, 2, 4, 8], 8, 32, 2)
    data = run_json("explain", *argv, "--num-tokens", "6", "--uniform", "2")
    assert data["descriptor"] == str(table.dispatch(3, 6, 2)) == "FULL(t=8,r=4,q=2)"
    data = run_json("explain", *argv, "--num-tokens", "6", "--num-reqs", "2")
    assert data["descriptor"] == str(table.dispatch(2, 6, None)) == "PIECEWISE(t=8)"


def test_table_and_explain_show_the_lora_dimension():
    """--enable-lora: the LoRA graphs beside the plain ones and their own candidates; explain --lora: a
    batch with adapters gets a LoRA graph (or NONE), one without gets what it gets without LoRA."""
    argv = table_argv("FULL_AND_PIECEWISE", "ALWAYS", [1, 2, 4, 8, 16], 8, 32, 1)
    table = DispatchTable(resolve_mode("FULL_AND_PIECEWISE", AttentionCGSupport.ALWAYS), [1, 2, 4, 8, 16],
                          max_num_reqs=8, max_num_batched_tokens=32, enable_lora=True)
    data = run_json("table", *argv, "--enable-lora")
    assert data["lora"]["capture_sizes"] == list(table.lora_capture_sizes)
    assert [d["key"] for d in data["descriptors"]] == [str(d) for d in table.descriptors]
    assert data["lora"]["num_graphs"] == sum(d["has_lora"] for d in data["descriptors"]) > 0
    assert "candidates of batches with LoRA adapters" in run_text("table", *argv, "--enable-lora")
    data = run_json("explain", *argv, "--num-tokens", "3", "--uniform", "1", "--lora")
    assert data["descriptor"] == str(table.dispatch(3, 3, 1, has_lora=True)) and data["chosen"]["has_lora"]
    assert data["batch"]["has_lora"]
    plain = run_json("explain", *argv, "--num-tokens", "3", "--uniform", "1", "--enable-lora")
    assert plain["descriptor"] == str(table.dispatch(3, 3, 1)) == "FULL(t=4,r=4,q=1)"


def test_explain_states_the_expert_slots_of_a_moe_model():
    """Qwen3-30B-A3B (128 experts, top-8) at 3 decodes padded to 4 tokens: 32 routing slots,
    blocks of 16 rows, each of at most 32 active experts padded by at most 15 rows."""
    argv = [*table_argv("FULL", "ALWAYS", [1, 2, 4, 8], 8, 32, 1), "--model", "builtin:qwen3-30b-a3b"]
    data = run_json("explain", *argv, "--num-tokens", "3", "--uniform", "1")
    assert data["descriptor"] == "FULL(t=4,r=4)"
    assert data["moe"] == {"num_experts": 128, "top_k": 8, "padded_tokens": 4, "slots": 32, "block_m": 16,
                           "padded_slots": 32 + 32 * 15, "max_active_experts": 32}
    assert "4 padded tokens x top-8 = 32 routing slots" in run_text("explain", *argv, "--num-tokens", "3",
                                                                       "--uniform", "1")
    assert run_json("explain", *argv[:-2], "--num-tokens", "3", "--uniform", "1")["moe"] is None


@pytest.mark.parametrize(
    "extra, match",
    [
        ([], "--query-lens"),
        (["--num-tokens", "6"], "--num-reqs"),
        (["--num-tokens", "6", "--uniform", "4"], "--uniform=4"),
        (["--query-lens", "1,1", "--num-reqs", "3"], "--num-reqs=3"),
        (["--query-lens", "600"], "max_num_batched_tokens=512"),
    ],
)
def test_explain_refuses_bad_batches_with_a_clear_message(extra, match):
    assert match in fails("explain", "--device", "cpu", *extra)


# ---- simulate -----------------------------------------------------------------------
def _redispatch(table: DispatchTable, records: list[dict], q: int) -> dict[str, list[int]]:
    """Independent tally: mode -> [steps, real tokens, padding tokens]."""
    tally = {m: [0, 0, 0] for m in ("FULL", "PIECEWISE", "NONE")}
    for r in records:
        lens = r["query_lens"]
        desc = table.dispatch(len(lens), sum(lens), q if all(n == q for n in lens) else None)
        t = tally[desc.cg_mode.name]
        t[0] += 1
        t[1] += sum(lens)
        t[2] += desc.num_tokens - sum(lens)
    return tally


@pytest.mark.parametrize("workload", ["decode-heavy", "prefill-heavy", "mixed"])
def test_simulate_workload_hit_rates_sum_to_one(tmp_path, workload):
    trace = tmp_path / "trace.jsonl"
    argv = table_argv(None, "ALWAYS", None, 16, 128, 1)
    data = run_json("simulate", *argv, "--workload", workload, "--num-requests", "24", "--seed", "3",
                    "--max-model-len", "512", "--save-trace", str(trace))
    rates = data["hit_rates"]
    assert sum(r["step_fraction"] for r in rates.values()) == pytest.approx(1.0)
    assert sum(r["token_fraction"] for r in rates.values()) == pytest.approx(1.0)
    assert data["padding_waste"] >= 0 and data["padding_tokens"] >= 0
    assert rates["NONE"]["padding_tokens"] == 0  # eager runs unpadded

    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == data["num_steps"] > 0
    for r in records:  # the scheduler kept every step within the limits
        assert 1 <= r["num_reqs"] <= 16 and 1 <= r["num_tokens"] <= 128
        assert r["num_tokens"] == sum(r["query_lens"]) and r["num_reqs"] == len(r["query_lens"])
    tally = _redispatch(reference_table(None, "ALWAYS", None, 16, 128, 1), records, 1)
    for mode, (steps, tokens, padding) in tally.items():
        got = rates[mode]
        assert (got["steps"], got["real_tokens"], got["padding_tokens"]) == (steps, tokens, padding)
    assert data["padding_waste"] == pytest.approx(sum(t[2] for t in tally.values()) / sum(t[1] for t in tally.values()))


def test_workloads_differ_in_the_way_their_names_say():
    argv = table_argv(None, "ALWAYS", None, 16, 128, 1)

    def uniform_share(name: str) -> float:
        data = run_json("simulate", *argv, "--workload", name, "--num-requests", "16", "--max-model-len", "512")
        return data["uniform_decode_steps"] / data["num_steps"]

    assert uniform_share("decode-heavy") > 0.5 > uniform_share("prefill-heavy")


def test_simulate_rejects_malformed_traces(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"num_reqs": 2, "num_tokens": 3, "query_lens": [1, 1]}\n')
    assert f"{bad}:1" in fails("simulate", "--device", "cpu", "--trace", str(bad))
    big = tmp_path / "big.jsonl"
    big.write_text('{"num_reqs": 1, "num_tokens": 900}\n')
    assert "max_num_batched_tokens=512" in fails("simulate", "--device", "cpu", "--trace", str(big))


def test_simulate_plot(tmp_path):
    png = tmp_path / "sim.png"
    argv = ["simulate", "--device", "cpu", "--workload", "mixed", "--num-requests", "8", "--plot", str(png)]
    if not HAS_MATPLOTLIB:
        assert "matplotlib" in fails(*argv)
        return
    run_text(*argv)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- recorded traces ----------------------------------------------------------------
def test_generate_records_a_trace_that_simulates(tmp_path):
    trace = tmp_path / "trace.jsonl"
    assert main(["generate", "--model", MODEL, "--device", "cpu", "--num-prompts", "3", "--prompt-len", "9",
                 "--max-tokens", "3", "--ignore-eos", "--max-model-len", "64", "--num-kv-blocks", "16",
                 "--record-batches", str(trace)]) == 0
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    # The timed run only (the warmup is not recorded): one prefill step, then two decodes.
    assert [r["query_lens"] for r in records] == [[9, 9, 9], [1, 1, 1], [1, 1, 1]]
    for r in records:
        assert r["num_reqs"] == 3 and r["num_tokens"] == sum(r["query_lens"])
        assert r["uniform"] == (1 if r["query_lens"] == [1, 1, 1] else None)
        assert r["descriptor"] == f"NONE(t={r['num_tokens']},r=3)"  # CPU generate runs eagerly
    data = run_json("simulate", "--device", "cpu", "--trace", str(trace))
    assert data["num_steps"] == 3 and data["real_tokens"] == 33
    assert data["uniform_decode_steps"] == 2
    assert sum(r["step_fraction"] for r in data["hit_rates"].values()) == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY"])
def test_simulated_descriptors_are_the_ones_the_runner_used(tmp_path, mode):
    """A trace recorded under graphs: the simulator's table picks every recorded descriptor."""
    from graphrunner.engine import LLM
    from graphrunner.protocol import SamplingParams
    from graphrunner_tools.inspect.simulate import read_trace
    from graphrunner_tools.inspect.table import TableSpec, build_table

    trace = tmp_path / "trace.jsonl"
    sizes = (1, 2, 4, 8)
    llm = LLM(MODEL, device="cpu", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4,
              num_kv_blocks=64, enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
              compile_backend="eager", record_batches=trace)
    prompts = [[(5 * i + j) % 2000 for j in range(2 + 5 * i)] for i in range(5)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert llm.runner.last_descriptor is not None

    built = build_table(TableSpec(device="cpu", mode=mode, capture_sizes=sizes, max_num_seqs=4,
                                  max_num_batched_tokens=16))
    recorded = [json.loads(line)["descriptor"] for line in trace.read_text().splitlines()]
    shapes = read_trace(trace, built.table.uniform_decode_query_len)
    simulated = [str(built.table.dispatch(s.num_reqs, s.num_tokens, s.uniform)) for s in shapes]
    assert simulated == recorded
    assert any(d.startswith("FULL(") for d in recorded)


# ---- capture ------------------------------------------------------------------------
CAPTURE = ["--model", MODEL, "--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
           "--max-model-len", "64"]


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY"])
def test_capture_reports_one_record_per_descriptor(mode):
    sizes = "1,4,8"
    data = run_json("capture", *CAPTURE, "--mode", mode, "--capture-sizes", sizes)
    want = reference_table(mode, "ALWAYS", [1, 4, 8], 8, 32, 1)
    assert [d["key"] for d in data["descriptors"]] == [str(d) for d in want.descriptors]
    keys = [r["key"] for r in data["report"]["records"]]
    # One record per captured graph: a FULL descriptor once per start-up sampling variant (the
    # all-features one is captured on first use).
    expected = [f"{d}[{v}]" for d in want.descriptors for v in ("greedy", "sampled")]
    assert keys == expected
    assert data["report"]["num_graphs"] == len(expected)
    assert all(r["seconds"] > 0 for r in data["report"]["records"])
    assert data["kernel_histogram"] == []  # no CUDA graph nodes on a CPU


def test_capture_text_prints_a_row_per_graph():
    text = run_text("capture", *CAPTURE, "--mode", "FULL", "--capture-sizes", "2,8")
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("FULL(")]
    assert rows == [f"FULL(t={t},r={t})[{v}]" for t in (8, 2) for v in ("greedy", "sampled")]
    assert "4 graphs (FULL) on cpu" in text and "emulated" in text


def test_capture_reports_the_kv_cache_dtype():
    data = run_json("capture", *CAPTURE, "--mode", "FULL", "--capture-sizes", "2", "--kv-cache-dtype", "fp8")
    kv = data["kv_cache"]
    assert kv["dtype"] == "float8_e4m3fn" and kv["cache_dtype"] == "fp8"
    assert kv["block_bytes"] == 2 * 4 * 16 * 2 * 32  # tiny-llama: K and V x layers x tokens x heads x dim, 1 byte
    text = run_text("capture", *CAPTURE, "--mode", "FULL", "--capture-sizes", "2")
    assert "KV cache: float32 (kv_cache_dtype=auto)" in text


def test_capture_dot_on_cpu_fails_clearly_before_building(monkeypatch, tmp_path):
    from graphrunner.runner import ModelRunner

    def no_build(*_a, **_k):
        raise AssertionError("the runner was built although --dot cannot work on a CPU")

    monkeypatch.setattr(ModelRunner, "__init__", no_build)
    msg = fails("capture", *CAPTURE, "--mode", "FULL", "--dot", "FULL(t=1,r=1)[greedy]", str(tmp_path / "g.dot"))
    assert "CUDA graphs" in msg and "cpu" in msg
    assert not (tmp_path / "g.dot").exists()


def test_dot_graph_key_names_a_captured_full_graph():
    from graphrunner_tools.inspect.capture_cmd import dot_graph_key

    keys = ["PIECEWISE(t=8)", "FULL(t=8,r=8,q=1)", "FULL(t=1,r=1,q=1)"]
    assert dot_graph_key("FULL(t=8,r=8,q=1)", keys) == "full(t=8,r=8,q=1)[greedy]"
    assert dot_graph_key(" full(t=1, r=1, q=1)[sampled] ", keys) == "full(t=1,r=1,q=1)[sampled]"
    with pytest.raises(ValueError, match="PIECEWISE descriptor"):
        dot_graph_key("PIECEWISE(t=8)", keys)
    with pytest.raises(ValueError, match="not a FULL descriptor"):
        dot_graph_key("FULL(t=4,r=4,q=1)", keys)
    assert dot_graph_key("FULL(t=8,r=8,q=1)[all]", keys) == "full(t=8,r=8,q=1)[all]"
    with pytest.raises(ValueError, match=r"\[greedy\], \[sampled\] or \[all\]"):
        dot_graph_key("FULL(t=8,r=8,q=1)[fast]", keys)


def test_capture_refuses_mode_none():
    assert "mode=NONE captures nothing" in fails("capture", *CAPTURE, "--mode", "NONE")


# ---- replay -------------------------------------------------------------------------
REPLAY = ["--model", MODEL, "--device", "cpu", "--context", "8", "--steps", "2", "--warmup", "1"]


def test_replay_prints_a_row_per_size():
    data = run_json("replay", *REPLAY, "--sizes", "1,3")
    assert data["errors"] == []
    rows = data["rows"]
    assert [r["size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["replayed_full"] and r["descriptor"] == f"FULL(t={r['size']},r={r['size']},q=1)"
        assert r["eager_descriptor"] == f"NONE(t={r['size']},r={r['size']})"  # the same, unpadded batch
        assert r["replay_ms"] > 0 and r["eager_ms"] > 0
        assert r["speedup"] == pytest.approx(r["eager_ms"] / r["replay_ms"])
        assert r["timer"] == "perf_counter"

    text = run_text("replay", *REPLAY, "--sizes", "2")
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("2 ")]
    assert len(rows) == 1 and rows[0][1] == "FULL(t=2,r=2,q=1)"


def test_replay_refuses_a_mode_without_full_graphs():
    assert "captures none" in fails("replay", *REPLAY, "--mode", "PIECEWISE")


# ---- GPU ----------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_capture_dot_writes_a_graph_with_nodes(tmp_path):
    from capture.report import read_graph_dot

    dot = tmp_path / "g.dot"
    argv = ["--model", MODEL, "--device", "cuda", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
            "--max-model-len", "64", "--mode", "FULL", "--capture-sizes", "1,8"]
    data = run_json("capture", *argv, "--dot", "FULL(t=8,r=8)", str(dot))
    assert data["dot"] == str(dot)
    nodes, _ = read_graph_dot(dot)
    assert nodes > 0


@pytest.mark.gpu
def test_gpu_replay_ratio_is_positive():
    data = run_json("replay", "--model", MODEL, "--device", "cuda", "--sizes", "1,8", "--context", "64",
                    "--steps", "5", "--warmup", "2")
    assert data["errors"] == [] and [r["size"] for r in data["rows"]] == [1, 8]
    for r in data["rows"]:
        assert r["replayed_full"] and r["timer"] == "cuda events"
        assert r["speedup"] > 0


def test_inspect_kernels_prints_the_config_and_each_projection_plan():
    report = run_json("kernels", "--model", "builtin:qwen2.5-0.5b", "--device", "cpu",
                      "--kernel-config", '{"norm_gemv_max_k": 0, "pdl": false}')
    assert report["kernel_config"]["norm_gemv_max_k"] == 0 and report["kernel_config"]["pdl"] is False
    assert report["kernel_config"]["greedy_head"] is True  # the fields not given keep their defaults
    assert report["device_properties"] is None  # a CPU: every projection takes the torch method
    shapes = {name: (p["n"], p["k"]) for name, p in report["projections"].items()}
    assert shapes == {"qkv_proj": (1152, 896), "o_proj": (896, 896), "gate_up_proj": (9728, 896),
                      "down_proj": (896, 4864), "lm_head": (151936, 896)}
    assert {p["method"] for p in report["projections"].values()} == {"LinearMethod(torch: F.linear)"}


def test_inspect_kernels_names_an_unknown_field():
    with pytest.raises(SystemExit, match=r"unknown field\(s\) \['pd'\].*pdl_max_rows"):
        main(["inspect", "kernels", "--device", "cpu", "--kernel-config", '{"pd": 1}'])
