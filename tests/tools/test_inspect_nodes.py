"""`inspect capture`: nodes per decoder layer and kernel families (tools/inspect/node_families.py).

The classification runs on real-looking kernel names (as `capture.report.short_kernel_name`
leaves them) and on the project's own Triton kernel names read from the source; the per-
layer arithmetic and the rendering on synthetic node lists and DOT dumps; the CPU capture
path end to end (FULL graphs are emulated there: no node lists, one clear line). The node
counts of real CUDA graphs are the `gpu` test's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from capture.report import (
    CaptureRecord,
    CaptureReport,
    GraphNode,
    parse_graph_dot,
    parse_graph_nodes,
    short_kernel_name,
)
from graphrunner_tools.inspect.capture_cmd import CaptureResult, CaptureSpec, capture_text
from graphrunner_tools.inspect.node_families import (
    ATTENTION,
    FAMILIES,
    FAMILY_RULES,
    NON_KERNEL,
    OTHER,
    LayerSpan,
    delimit_layers,
    family_counts,
    family_table,
    histogram_family_counts,
    kernel_family,
    node_family,
    node_family_lines,
    smallest_decode_graph,
    summarize,
)
from tests.tools.test_inspect_cli import MODEL, run_json, run_text

ROOT = Path(__file__).resolve().parents[2]

# (short kernel name, family): names as they appear in graph dumps of this runner on H100/H200.
NAMES = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "gemm/gemv"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm/gemv"),
    ("ampere_bf16_s16816gemm_bf16_64x64_ldg8_f2f_stages_64x5_tn", "gemm/gemv"),
    ("cutlass::Kernel2", "gemm/gemv"),
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8", "gemm/gemv"),
    ("gemv2T_kernel_val", "gemm/gemv"),
    ("internal::gemvx::kernel", "gemm/gemv"),
    ("gemmSN_TN_kernel", "gemm/gemv"),
    ("triton_tem_fused_mm_0", "gemm/gemv"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton fused"),
    ("triton_poi_fused_mul_silu_1", "triton fused"),
    ("triton_per_fused_add_mean_mul_pow_rsqrt_2", "triton fused"),
    ("triton_poi_fused_index_select_cat_3", "triton fused"),
    ("_paged_attn_kernel", ATTENTION),
    ("_merge_splits_kernel", ATTENTION),
    ("_merge_states_kernel", ATTENTION),
    ("_write_kv_kernel", ATTENTION),
    ("flash_fwd_splitkv_kernel", ATTENTION),
    ("vectorized_elementwise_kernel", "elementwise/copy"),
    ("unrolled_elementwise_kernel", "elementwise/copy"),
    ("elementwise_kernel", "elementwise/copy"),
    ("index_elementwise_kernel", "elementwise/copy"),
    ("indexSelectSmallIndex", "elementwise/copy"),
    ("CatArrayBatchedCopy", "elementwise/copy"),
    ("reduce_kernel", "reduce"),
    ("splitKreduce_kernel", "reduce"),
    ("ReduceSplitK", "reduce"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "nccl"),
    ("_gumbel_argmax_kernel", "sampling"),
    ("_threshold_kernel", "sampling"),
    ("_positions_seq_lens_kernel", "step inputs"),
    ("_input_ids_kernel", "step inputs"),
    ("_slot_mapping_kernel", "step inputs"),
    ("_gather_kernel", "step inputs"),
    ("_post_update_kernel", "step inputs"),
    ("_ngram_kernel", OTHER),
    ("DeviceScanKernel", OTHER),
    ("kernel", OTHER),
]

# (mangled symbol, short name): the names above as the DOT dump spells them.
SYMBOLS = [
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_",
     "vectorized_elementwise_kernel"),
    ("_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIN3c108BFloat16ENS0_14func_wrapper_tIS4_ZNS0_"
     "11sum_functorIS4_fS4_E10operatorclERNS_14TensorIteratorEEUlffE_EEjS4_Li4ELi4EEEEEvT1_", "reduce_kernel"),
    ("_ZN7cutlass7Kernel2I56cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8EEvNT_6ParamsE",
     "cutlass::Kernel2"),
    ("_ZN8internal5gemvx6kernelIiiffLb0ELb1ELb1ELb0ELi6ELb0E18cublasGemvParamsExIiPKfS4_PfEEEvT9_",
     "internal::gemvx::kernel"),
    ("_Z17gemv2T_kernel_valIiiLi128ELi16ELi4ELi4ELb0ELb0EN13cublasGemvParamsI16cublasGemvTensorI13__nv_bfloat16EEEvT7_",
     "gemv2T_kernel_val"),
    ("_Z19splitKreduce_kernelILi32ELi16Ei13__nv_bfloat16S0_fS0_Lb1ELb0ELb0EEv18cublasSplitKParamsIT4_E",
     "splitKreduce_kernel"),
    ("_Z12plain_kernel6Params", "plain_kernel"),  # a class-typed parameter is not a second name
    ("_paged_attn_kernel", "_paged_attn_kernel"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"),
]


# ---- classification -------------------------------------------------------------------
@pytest.mark.parametrize(("name", "family"), NAMES)
def test_kernel_names_fall_into_their_family(name, family):
    assert kernel_family(name) == family
    assert node_family(GraphNode("KERNEL", name)) == family


@pytest.mark.parametrize(("symbol", "short"), SYMBOLS)
def test_short_kernel_name_keeps_the_scope_of_a_generic_name(symbol, short):
    assert short_kernel_name(symbol) == short


def test_non_kernel_nodes_are_memcpy_memset_whatever_their_name():
    for kind in ("MEMCPY", "MEMSET", "EMPTY", "EVENT_RECORD"):
        assert node_family(GraphNode(kind)) == NON_KERNEL
    assert node_family(GraphNode("MEMSET", "reduce_kernel")) == NON_KERNEL


def test_rules_are_ordered_where_patterns_overlap():
    """The earlier rule wins where two match: the order is part of the definition."""
    def first(name):
        return [r.family for r in FAMILY_RULES if r.matches(name)]

    assert first("ncclDevKernel_AllReduce_Sum_bf16_RING_LL")[:2] == ["nccl", "reduce"]
    assert first("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == ["triton fused", "elementwise/copy"]
    assert first("cublasLt_splitKreduce_kernel") == ["reduce", "gemm/gemv"]  # a split-K reduce is a reduce
    assert first("_write_kv_kernel") == [ATTENTION]
    assert {r.family for r in FAMILY_RULES} | {NON_KERNEL, OTHER} == set(FAMILIES)


def _triton_kernels(rel: str) -> list[str]:
    """The launched @triton.jit functions of a source file (helpers end without _kernel)."""
    src = (ROOT / rel).read_text()
    return [n for n in re.findall(r"@triton\.jit(?:\([^)]*\))?\s+def (\w+)", src) if n.endswith("_kernel")]


@pytest.mark.parametrize(("files", "family"), [
    (["graphrunner/attention/triton_attn.py", "graphrunner/attention/kv_write.py", "graphrunner/attention/merge.py"],
     ATTENTION),
    (["graphrunner/sample/triton_sampling.py", "graphrunner/sample/pivot_select.py", "graphrunner/sample/argmax.py",
      "graphrunner/sample/pivot_refine.py", "graphrunner/sample/pivot_reject.py",
      "graphrunner/sample/logprobs_triton.py", "graphrunner/sample/fused_process.py",
      "graphrunner/sample/bitmask.py"], "sampling"),
    (["graphrunner/kernels/input_prep.py", "graphrunner/kernels/dcp.py"],
     "step inputs"),
    (["graphrunner/layers/moe/kernels.py"], "moe"),
])
def test_the_projects_own_triton_kernels_are_classified(files, family):
    names = [n for f in files for n in _triton_kernels(f)]
    assert names, files
    assert {n: kernel_family(n) for n in names} == dict.fromkeys(names, family)


# ---- DOT dumps --------------------------------------------------------------------------
def _dot_node(node_id: str, kind: str, name: str = "", topo: int = 0) -> str:
    ident = f"ID | {node_id.rsplit('_', 1)[1]} (topoId: {topo})"
    body = f"{ident} | {name}\\<\\<\\<{{1,1,1}},{{128,1,1}},0\\>\\>\\>" if kind == "KERNEL" else ident
    return f'"{node_id}"[style="solid" shape="record" label="{{{kind}\n| {{{body}}}\n| {{params | 0x0}}\n}}"];'


def _dot(nodes: list[tuple[str, str, str]], edges: list[tuple[str, str]]) -> str:
    lines = ["digraph dot {", "subgraph cluster_1 {", 'label="graph_1" graph[style="dashed"];']
    lines += [_dot_node(i, kind, name, topo) for topo, (i, kind, name) in enumerate(nodes)]
    lines += [f'"{a}" -> "{b}";' for a, b in edges] + ["}", "}"]
    return "\n".join(lines)


def test_parse_graph_nodes_orders_by_edges_not_by_file_order():
    # Execution order node_2 -> node_0 -> node_1, with node_3 a second root joining node_1.
    nodes = [("graph_1_node_0", "KERNEL", "_ZN2at6native29vectorized_elementwise_kernelILi4EEEvT_"),
             ("graph_1_node_1", "KERNEL", "_paged_attn_kernel"),
             ("graph_1_node_2", "MEMSET", ""),
             ("graph_1_node_3", "KERNEL", "triton_poi_fused_add_0")]
    edges = [("graph_1_node_2", "graph_1_node_0"), ("graph_1_node_0", "graph_1_node_1"),
             ("graph_1_node_3", "graph_1_node_1")]
    text = _dot(nodes, edges)
    order = parse_graph_nodes(text)
    assert order == [GraphNode("MEMSET"), GraphNode("KERNEL", "vectorized_elementwise_kernel"),
                     GraphNode("KERNEL", "triton_poi_fused_add_0"), GraphNode("KERNEL", "_paged_attn_kernel")]
    # The histogram parser agrees: every node counted, kernels only in the histogram.
    count, kernels = parse_graph_dot(text)
    assert count == 4 and sum(kernels.values()) == 3
    assert family_counts(order)[NON_KERNEL] == 1


# ---- per layer --------------------------------------------------------------------------
PROLOGUE = [GraphNode("MEMSET"), GraphNode("KERNEL", "_positions_seq_lens_kernel"),
            GraphNode("KERNEL", "_input_ids_kernel"), GraphNode("KERNEL", "_slot_mapping_kernel")]
LAYER = [GraphNode("KERNEL", n) for n in (
    "triton_red_fused_add_mean_mul_pow_rsqrt_0", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "triton_poi_fused_cat_1",
    "_write_kv_kernel", "_paged_attn_kernel", "_merge_splits_kernel", "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT",
    "splitKreduce_kernel", "triton_red_fused_add_mean_2", "gemv2T_kernel_val", "triton_poi_fused_mul_silu_3",
    "gemv2T_kernel_val", "vectorized_elementwise_kernel")]
EPILOGUE = [GraphNode("KERNEL", n) for n in ("triton_red_fused_add_mean_4", "gemv2T_kernel_val", "reduce_kernel",
                                              "_post_update_kernel")] + [GraphNode("MEMCPY")]


def _graph(num_layers: int, extra_in_first: int = 0) -> list[GraphNode]:
    first = LAYER[:6] + [GraphNode("KERNEL", "CatArrayBatchedCopy")] * extra_in_first + LAYER[6:]
    return PROLOGUE + first + LAYER * (num_layers - 1) + EPILOGUE


def test_layers_are_delimited_by_the_attention_kernel_that_occurs_once_per_layer():
    nodes = _graph(24)
    assert len(nodes) == 4 + 24 * 13 + 5
    span = delimit_layers(nodes, 24)
    assert isinstance(span, LayerSpan)
    # _write_kv_kernel comes first in each layer and occurs 24 times: it is the anchor.
    assert span.anchor == "_write_kv_kernel"
    assert span.gaps == (13,) * 23 and span.typical == 13
    assert span.families == {**dict.fromkeys(FAMILIES, 0), "gemm/gemv": 4, "triton fused": 4, ATTENTION: 3,
                             "elementwise/copy": 1, "reduce": 1}
    assert sum(span.families.values()) == 13
    assert "13 nodes per layer" in span.line() and "all 23 gaps equal" in span.line()


def test_an_irregular_first_layer_leaves_the_typical_gap():
    span = delimit_layers(_graph(4, extra_in_first=2), 4)
    assert isinstance(span, LayerSpan)
    assert span.gaps == (15, 13, 13) and span.typical == 13
    assert span.to_dict() == {"anchor": "_write_kv_kernel", "nodes_per_layer": 13, "min": 13, "max": 15,
                              "gaps": [15, 13, 13]}
    assert "range 13-15" in span.line()
    assert sum(span.families.values()) == 13  # the families of a typical span, not the first one


def test_layers_cannot_be_delimited_without_an_attention_kernel_per_layer():
    reason = delimit_layers(_graph(4), 5)
    assert isinstance(reason, str) and "_paged_attn_kernel x4" in reason and "5 layers" in reason
    assert "no two consecutive layers" in delimit_layers(_graph(1), 1)
    assert "attention kernels: none" in delimit_layers(PROLOGUE + EPILOGUE, 2)


def test_ratio_and_families_of_a_summary():
    nodes = _graph(24)
    record = CaptureRecord("FULL(t=1,r=1,q=1)[greedy]", 0.1, 0, len(nodes), {})
    s = summarize(record, 24, nodes, "cuda")
    assert s.ratio == pytest.approx(321 / 24)
    assert sum(s.families.values()) == s.num_nodes == 321
    assert s.families["gemm/gemv"] == 24 * 4 + 1 and s.families[NON_KERNEL] == 2
    assert s.node_types == {"KERNEL": 319, "MEMSET": 1, "MEMCPY": 1}
    assert s.layers is not None and s.layers.typical == 13 and s.note == ""
    data = s.to_dict()
    assert data["nodes_per_layer_ratio"] == pytest.approx(321 / 24)
    assert sum(f["count"] for f in data["families"]) == 321
    assert sum(f["share"] for f in data["families"]) == pytest.approx(1.0)
    assert sum(f["per_layer"] for f in data["families"]) == 13
    json.dumps(data)


def test_a_summary_from_the_histogram_alone_gives_the_ratio_only():
    kernels = {"gemv2T_kernel_val": 10, "_paged_attn_kernel": 4, "triton_poi_fused_add_0": 6}
    assert histogram_family_counts(25, kernels) == {
        **dict.fromkeys(FAMILIES, 0), "gemm/gemv": 10, ATTENTION: 4, "triton fused": 6, NON_KERNEL: 5}
    s = summarize(CaptureRecord("FULL(t=1,r=1)[greedy]", 0.1, 0, 25, kernels), 4, None, "cuda")
    assert s.ratio == 6.25 and s.layers is None and sum(s.families.values()) == 25
    assert "node order unknown" in s.note and "only the ratio" in s.note


def test_summaries_without_a_node_list_say_why():
    cpu = summarize(CaptureRecord("FULL(t=1,r=1,q=1)[greedy]", 0.1, 0), 4, None, "cpu")
    assert cpu.num_nodes is None and cpu.ratio is None and cpu.families == {}
    assert cpu.note.startswith("node lists need a CUDA device")
    piece = summarize(CaptureRecord("PIECEWISE(t=8)", 0.1, 0), 4, None, "cuda")
    assert "PIECEWISE piece graphs" in piece.note
    assert cpu.to_dict()["layers"] is None and cpu.to_dict()["families"] == []


# ---- rendering ----------------------------------------------------------------------------
DESCRIPTORS = [
    {"key": "PIECEWISE(t=8)", "cg_mode": "PIECEWISE", "num_tokens": 8, "num_reqs": None, "uniform_token_count": None},
    {"key": "FULL(t=4,r=4)", "cg_mode": "FULL", "num_tokens": 4, "num_reqs": 4, "uniform_token_count": None},
    {"key": "FULL(t=8,r=8,q=1)", "cg_mode": "FULL", "num_tokens": 8, "num_reqs": 8, "uniform_token_count": 1},
    {"key": "FULL(t=1,r=1,q=1)", "cg_mode": "FULL", "num_tokens": 1, "num_reqs": 1, "uniform_token_count": 1},
]


def _records(with_nodes: bool) -> list[CaptureRecord]:
    keys = ["PIECEWISE(t=8)"] + [f"{d['key']}[{v}]" for d in DESCRIPTORS[1:] for v in ("greedy", "sampled", "all")]
    n = len(_graph(4))
    return [CaptureRecord(k, 0.01, 0, n if with_nodes and k.startswith("FULL") else None, {}) for k in keys]


def test_the_default_graph_is_the_smallest_uniform_decode_graph_greedy():
    records = _records(True)
    assert smallest_decode_graph(DESCRIPTORS, records) == "FULL(t=1,r=1,q=1)[greedy]"
    assert smallest_decode_graph(DESCRIPTORS[:2], records) == "FULL(t=4,r=4)[greedy]"  # mode FULL: no decode-only graph
    assert smallest_decode_graph(DESCRIPTORS[:1], records) is None
    only_sampled = [CaptureRecord("FULL(t=4,r=4)[sampled]", 0.01, 0)]
    assert smallest_decode_graph(DESCRIPTORS[:2], only_sampled) == "FULL(t=4,r=4)[sampled]"


def test_the_family_table_lists_nonzero_families_with_shares_and_a_total():
    s = summarize(CaptureRecord("FULL(t=1,r=1,q=1)[greedy]", 0.1, 0, len(_graph(4)), {}), 4, _graph(4), "cuda")
    rows = [line.split("  ") for line in family_table(s).splitlines()[2:]]
    cells = {r[0].strip(): [c.strip() for c in r[1:] if c.strip()] for r in rows}
    assert list(cells) == [f for f in FAMILIES if s.families[f]] + ["total"]
    assert cells["total"] == [str(s.num_nodes), "100.0%", "13"]
    assert cells["gemm/gemv"] == ["17", f"{100 * 17 / 61:.1f}%", "4"]
    assert "sampling" not in cells  # a zero row is left out


def test_node_family_lines_default_and_all_graphs():
    records = _records(True)
    nodes = _graph(4)
    summaries = [summarize(r, 4, nodes if r.num_nodes else None, "cuda") for r in records]
    default = smallest_decode_graph(DESCRIPTORS, records)
    text = "\n".join(node_family_lines(summaries, default, all_graphs=False))
    assert text.startswith("nodes of FULL(t=1,r=1,q=1)[greedy]: 61 nodes, 4 decoder layers")
    assert "15.2 nodes per layer = all 61 nodes / 4 layers" in text
    assert "13 nodes per layer from one layer's _write_kv_kernel to the next (all 3 gaps equal)" in text
    assert text.count("nodes of ") == 1 and "--all-graphs shows all 10 graphs" in text
    every = "\n".join(node_family_lines(summaries, default, all_graphs=True))
    assert every.count("61 nodes, 4 decoder layers") == 9
    assert "nodes of PIECEWISE(t=8): PIECEWISE piece graphs are captured without a node list" in every


def test_node_family_lines_group_graphs_without_nodes():
    summaries = [summarize(r, 4, None, "cpu") for r in _records(False)]
    lines = node_family_lines(summaries, "FULL(t=1,r=1,q=1)[greedy]", all_graphs=True)
    assert len(lines) == 1 and "and 6 more: node lists need a CUDA device" in lines[0]
    default = node_family_lines(summaries, "FULL(t=1,r=1,q=1)[greedy]", all_graphs=False)
    assert default[0].startswith("nodes of FULL(t=1,r=1,q=1)[greedy]: node lists need a CUDA device")
    none = node_family_lines(summaries[:1], None, all_graphs=False)
    assert "no FULL graph was captured" in none[0]


def test_capture_text_and_json_carry_the_node_section():
    records = _records(True)
    report = CaptureReport("FULL_AND_PIECEWISE", "cuda:0", records)
    result = CaptureResult(CaptureSpec(model=MODEL, mode="FULL_AND_PIECEWISE"), {}, (1, 4, 8), DESCRIPTORS, 0.5,
                           report, num_layers=4)
    result.node_summaries = [summarize(r, 4, _graph(4) if r.num_nodes else None, "cuda") for r in records]
    text = capture_text(result, top=5)
    assert "nodes of FULL(t=1,r=1,q=1)[greedy]: 61 nodes" in text and "per layer" in text
    assert capture_text(result, top=5, all_graphs=True).count("61 nodes, 4 decoder layers") == 9
    data = json.loads(json.dumps(result.to_dict(top=5)))
    nf = data["node_families"]
    assert nf["num_hidden_layers"] == 4 and nf["default_graph"] == "FULL(t=1,r=1,q=1)[greedy]"
    assert [g["graph"] for g in nf["graphs"]] == [r.key for r in records]
    assert [r["family"] for r in nf["rules"]] == [r.family for r in FAMILY_RULES]


# ---- the CPU capture path, end to end -------------------------------------------------------
CAPTURE = ["--model", MODEL, "--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
           "--max-model-len", "64", "--mode", "FULL_DECODE_ONLY", "--capture-sizes", "1,4"]


def test_cpu_capture_says_node_lists_need_a_cuda_device():
    text = run_text("capture", *CAPTURE)
    line = next(x for x in text.splitlines() if x.startswith("nodes of "))
    assert line.startswith("nodes of FULL(t=1,r=1,q=1)[greedy]: node lists need a CUDA device")
    data = run_json("capture", *CAPTURE)
    nf = data["node_families"]
    assert nf["num_hidden_layers"] == 4 and nf["default_graph"] == "FULL(t=1,r=1,q=1)[greedy]"
    assert len(nf["graphs"]) == 4  # two sizes x the start-up variants (greedy, sampled)
    assert all(g["num_nodes"] is None and "CUDA device" in g["note"] for g in nf["graphs"])


# ---- GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_decode_graph_families_sum_to_its_nodes_and_layers_are_counted():
    argv = ["--model", MODEL, "--device", "cuda", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
            "--max-model-len", "64", "--mode", "FULL_DECODE_ONLY", "--capture-sizes", "1"]
    data = run_json("capture", *argv)
    nf = data["node_families"]
    layers = nf["num_hidden_layers"]
    graphs = {g["graph"]: g for g in nf["graphs"]}
    assert nf["default_graph"] == "FULL(t=1,r=1,q=1)[greedy]" and set(graphs) == {
        f"FULL(t=1,r=1,q=1)[{v}]" for v in ("greedy", "sampled")}
    for g in graphs.values():
        record = next(r for r in data["report"]["records"] if r["key"] == g["graph"])
        assert g["num_nodes"] == record["num_nodes"] and g["num_nodes"] > 0, g
        assert sum(f["count"] for f in g["families"]) == g["num_nodes"]
        assert g["nodes_per_layer_ratio"] == pytest.approx(g["num_nodes"] / layers)
        assert g["node_types"] and sum(g["node_types"].values()) == g["num_nodes"], g["note"]
        assert g["layers"] is not None, g["note"]
        assert kernel_family(g["layers"]["anchor"]) == ATTENTION
        assert len(g["layers"]["gaps"]) == layers - 1
        assert 0 < g["layers"]["nodes_per_layer"] * (layers - 1) < g["num_nodes"]
        per_layer = {f["family"]: f["per_layer"] for f in g["families"]}
        assert sum(per_layer.values()) == g["layers"]["nodes_per_layer"]
        assert per_layer[ATTENTION] >= 1
    text = run_text("capture", *argv)
    assert "nodes of FULL(t=1,r=1,q=1)[greedy]:" in text and "nodes per layer" in text
    print(text)  # a sample of the output (pytest -s shows it)


def test_a_real_dump_counts_nodes_not_edges():
    """An excerpt of a real H100 dump (`cudaGraphDebugDotPrint`, torch 2.11, CUDA 13): edge
    statements (`"a" -> "b" [headlabel=0];`) are not nodes. The pattern once matched their
    targets too, which doubled the node counts reported before this was found."""
    from pathlib import Path

    from capture.report import parse_graph_dot, parse_graph_nodes

    text = (Path(__file__).parents[1] / "data" / "graph_h100_excerpt.dot").read_text()
    num_nodes, kernels = parse_graph_dot(text)
    assert num_nodes == 3 and kernels == {"_positions_seq_lens_kernel": 1, "_input_ids_kernel": 1, "_gather_kernel": 1}
    assert [n.name for n in parse_graph_nodes(text)] == ["_positions_seq_lens_kernel", "_input_ids_kernel",
                                                         "_gather_kernel"]
