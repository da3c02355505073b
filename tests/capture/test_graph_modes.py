"""Graph and eager agree: every cudagraph mode yields the same tokens as NONE.

On CPU, FULL graphs are emulated (capture records the step, replay re-runs it over the
same static buffers), so these tests exercise dispatch, padding and buffer discipline in
CI; tests marked `gpu` replay real CUDA graphs.
"""

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from capture.full import GraphReplayError
from graphrunner import LLM, SamplingParams

CPU_MODES = ["NONE", "FULL", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"]
SIZES = (1, 2, 4, 8, 16, 24, 32)


def _llm(mode: str, device="cpu", **kw) -> LLM:
    args = dict(device=device, dtype="float32", max_num_seqs=6, max_num_batched_tokens=32, max_model_len=96,
                block_size=4, num_kv_blocks=40, seed=0)
    args.update(kw)
    if mode == "NONE":
        return LLM("builtin:tiny-llama", enforce_eager=True, **args)
    return LLM("builtin:tiny-llama", enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=SIZES,
               compile_backend="eager", **args)


# The property tests below run on a CPU in CI (FULL graphs emulated); the device-scale run
# (tools/gpu_suite.sh scale) sets this to "cuda" to compare real graphs with eager.
PROPERTY_DEVICE = os.environ.get("GRAPHRUNNER_GRAPH_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def llms():
    return {mode: _llm(mode, device=PROPERTY_DEVICE, debug_cudagraphs=True) for mode in CPU_MODES}


workloads = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2047), min_size=1, max_size=40),  # prompt
        st.integers(1, 12),  # max_tokens
        st.one_of(st.none(), st.integers(0, 2**31)),  # seed: None = greedy
    ),
    min_size=1,
    max_size=7,
)


@given(workloads)
def test_all_modes_produce_identical_tokens(llms, workload):
    prompts = [w[0] for w in workload]
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        if seed is None
        else SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_k=50, top_p=0.9, seed=seed)
        for _, n, seed in workload
    ]
    results = {mode: [o.token_ids for o in llm.generate(prompts, params)] for mode, llm in llms.items()}
    for mode in CPU_MODES[1:]:
        assert results[mode] == results["NONE"], mode


def test_graphs_are_actually_replayed(llms, monkeypatch):
    """The FULL runner must serve decode steps from graphs (not silently run eager)."""
    from capture.full import FullGraph

    runner = llms["FULL"].runner
    desc_of = {id(graph): desc for (desc, _), graph in runner.graphs.full_graphs.items()}
    seen = []
    original = FullGraph.replay

    def spy(self):
        seen.append(desc_of[id(self)])
        return original(self)

    monkeypatch.setattr(FullGraph, "replay", spy)
    llms["FULL"].generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    monkeypatch.undo()
    # One prefill step (5 tokens, padded to 8) and four decode steps of two requests.
    assert len(seen) == 5 and all(d.is_full for d in seen)
    assert seen[0].num_tokens == 8 and all(d.num_tokens == 2 and d.num_reqs == 2 for d in seen[1:])


def test_preemption_under_graphs_matches_eager():
    prompts = [[i + 1] * (5 + 7 * i) for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("NONE", "FULL"):
        llm = _llm(mode, num_kv_blocks=26, max_num_batched_tokens=16)
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.scheduler.num_preemptions > 0
    assert outs["FULL"] == outs["NONE"]


def _poison(runner, value=-7777):
    ib = runner.input_buffers
    for t in (ib.input_ids, ib.positions, ib.slot_mapping, ib.seq_lens, ib.logits_indices, ib.block_table, ib.sampled):
        t.fill_(value)


def test_poisoned_buffers_are_rewritten_by_replay(llms, monkeypatch):
    """After capture every derived buffer is poisoned; replays must rewrite all they read."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eager = [o.token_ids for o in llms["NONE"].generate(prompts, params)]
    llm = llms["FULL"]  # debug_cudagraphs=True, as the module's property tests run it
    runner = llm.runner
    original = runner.input_buffers.upload

    def poisoned_upload(*args, **kwargs):
        _poison(runner)
        return original(*args, **kwargs)

    monkeypatch.setattr(runner.input_buffers, "upload", poisoned_upload)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == eager


def test_padded_rows_never_write_live_kv():
    """A FULL replay with padded requests/tokens leaves every KV slot outside the real ones untouched."""
    llm = _llm("FULL")
    runner = llm.runner
    sentinel = 12345.0
    for cache in runner.buffers.kv_caches:
        cache.fill_(sentinel)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # Exactly the slots of the request's 5 computed tokens (3 prompt + 2 fed-back samples) changed.
    caches = runner.buffers.kv_caches
    written = sum(int((c != sentinel).any(dim=(0, 3, 4)).sum()) for c in caches) // len(caches)
    assert written == 5


def test_debug_mode_catches_reallocated_input():
    llm = _llm("FULL", debug_cudagraphs=True)
    llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    llm.runner.input_buffers.positions = torch.zeros_like(llm.runner.input_buffers.positions)
    with pytest.raises(GraphReplayError, match="positions"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def test_debug_mode_catches_reallocated_sampling_state():
    llm = _llm("FULL", debug_cudagraphs=True)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2]], greedy)
    states = llm.runner.sampling_states
    states.temperature = torch.zeros_like(states.temperature)
    with pytest.raises(GraphReplayError, match=r"sampling\.temperature"):
        llm.generate([[1, 2]], greedy)


def test_debug_mode_catches_reallocated_pp_stage_buffer():
    """The static-tensor list derives from StepBuffers' fields, PP stage buffers included.

    A single process has no PP peers, so the stage output buffers are allocated by hand
    before capture (as a non-last stage's would be); nothing reads them here, but every
    replay must still find them where the graphs were captured.
    """
    from graphrunner.step.buffers import StageBuffers

    llm = _llm("FULL", debug_cudagraphs=True)
    runner = llm.runner
    runner.buffers.stage = StageBuffers.allocate(runner.limits.max_num_tokens, runner.model_config.hidden_size,
                                                 torch.float32, runner.device, receives=False, sends=True)
    runner.capture_model(progress=False)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2]], greedy)
    assert "stage.hidden_out" in runner.buffers.static_tensors()
    runner.buffers.stage.hidden_out = torch.zeros_like(runner.buffers.stage.hidden_out)
    with pytest.raises(GraphReplayError, match=r"stage\.hidden_out"):
        llm.generate([[1, 2]], greedy)


def test_debug_mode_catches_broken_padding_row():
    llm = _llm("FULL", debug_cudagraphs=True)
    runner = llm.runner
    original = runner.input_buffers.upload

    def broken_upload(idx_mapping, query_lens, num_reqs_padded, pad_row):
        # A padded entry pointing at a live row (row 0) instead of the scratch row.
        original(idx_mapping, query_lens, num_reqs_padded, pad_row)
        if num_reqs_padded > len(idx_mapping):
            runner.input_buffers.idx_mapping[len(idx_mapping)] = 0
            runner.input_buffers.query_start_loc[-1] = 0

    runner.input_buffers.upload = broken_upload
    with pytest.raises(GraphReplayError, match="FULL"):
        llm.generate([[1, 2], [3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))


def test_steps_dispatch_to_none_before_capture():
    llm = _llm("NONE")
    graphs = llm.runner.graphs
    assert not graphs.captured
    assert graphs.dispatch(2, 2, 1).is_eager


def test_explicit_impossible_mode_is_an_error():
    with pytest.raises(ValueError, match="NOT_A_MODE|allowed"):
        _llm("NOT_A_MODE")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"])
def test_gpu_modes_match_eager(mode):
    prompts = [[(7 * i + j) % 2000 for j in range(3 + 9 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)] * 3
    kw = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=16,
              num_kv_blocks=64)
    eager = LLM("builtin:tiny-llama", device="cuda", enforce_eager=True, **kw)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    graphs = LLM("builtin:tiny-llama", device="cuda", enforce_eager=False, cudagraph_mode=mode,
                 debug_cudagraphs=True, **kw)
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == want


def test_full_and_piecewise_routes_decode_to_full_and_mixed_to_piecewise(llms, monkeypatch):
    from capture.full import FullGraph

    llm = llms["FULL_AND_PIECEWISE"]
    runner = llm.runner
    desc_of = {id(graph): desc for (desc, _), graph in runner.graphs.full_graphs.items()}
    routes = []
    original_full, original_step = FullGraph.replay, runner.body.run

    in_full = []

    def spy_full(self):
        routes.append(("full", desc_of[id(self)].num_tokens))
        in_full.append(True)  # on CPU the emulated replay re-runs the step body: not a route
        try:
            return original_full(self)
        finally:
            in_full.pop()

    def spy_step(batch, piecewise=False):
        if not in_full:
            routes.append(("piecewise" if piecewise else "eager", batch.num_tokens_padded))
        return original_step(batch, piecewise)

    monkeypatch.setattr(FullGraph, "replay", spy_full)
    monkeypatch.setattr(runner.body, "run", spy_step)
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    monkeypatch.undo()
    # Prefill of 8 tokens: PIECEWISE at the capture size 8; then 3 uniform decodes of 2: FULL.
    assert routes == [("piecewise", 8)] + [("full", 2)] * 3


def test_prompt_logprobs_are_the_same_in_every_mode(llms):
    """A step that carries prompt logprobs reads every prompt position's hidden state: it runs
    eagerly in every mode (FULL included, whose mixed-batch graphs would drop them)."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]
    want = [(o.token_ids, o.prompt_logprobs) for o in llms["NONE"].generate(prompts, params)]
    assert want[0][1] is not None and len(want[0][1]) == len(prompts[0])
    for mode in CPU_MODES[1:]:
        got = [(o.token_ids, o.prompt_logprobs) for o in llms[mode].generate(prompts, params)]
        assert [g[0] for g in got] == [w[0] for w in want], mode
        assert got[0][1] is not None, mode
        for g, w in zip(got[0][1][1:], want[0][1][1:], strict=True):
            assert g.keys() == w.keys(), mode
            for tok in w:
                assert abs(g[tok].logprob - w[tok].logprob) < 1e-4 and g[tok].rank == w[tok].rank, mode


POISON_VARIANTS = {
    "greedy": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5, ignore_eos=True),
    "all": SamplingParams(max_tokens=8, temperature=0.8, repetition_penalty=1.2, presence_penalty=0.2,
                          logit_bias={7: 1.5}, min_tokens=2, logprobs=2, seed=11, ignore_eos=True),
}


def _poison_step_buffers(runner, value=-7777):
    """Every per-step buffer a step derives on the device (not the uploaded idx_mapping /
    query_start_loc, which a steady decode plan keeps on purpose)."""
    ib, lp = runner.buffers.inputs, runner.buffers.logprobs
    for t in (ib.input_ids, ib.positions, ib.slot_mapping, ib.seq_lens, ib.logits_indices, ib.block_table, ib.sampled,
              lp.token_ids, lp.ranks):
        t.fill_(value)
    lp.values.fill_(float("nan"))


@pytest.mark.parametrize("variant", sorted(POISON_VARIANTS))
def test_poisoned_buffers_are_rewritten_in_every_mode_and_variant(llms, variant, monkeypatch):
    """Poison the derived buffers before every step (steady decode replays included): every
    graph kind (FULL uniform decode, FULL mixed, PIECEWISE) and every sampling variant must
    rewrite all it reads, and give the eager tokens and logprobs."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = POISON_VARIANTS[variant]

    def run(llm):
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]

    want = run(llms["NONE"])
    kinds = set()
    for mode in CPU_MODES[1:]:
        runner = llms[mode].runner
        original = runner.graphs.run

        def poisoned_run(desc, batch, graph=None, runner=runner, original=original):
            _poison_step_buffers(runner)
            kinds.add(f"{desc.cg_mode.name}{'-uniform' if desc.uniform_token_count else ''}")
            return original(desc, batch, graph)

        monkeypatch.setattr(runner.graphs, "run", poisoned_run)
        got = run(llms[mode])
        monkeypatch.undo()
        assert [g[0] for g in got] == [w[0] for w in want], mode
        for (_, got_lp), (_, want_lp) in zip(got, want, strict=True):
            assert (got_lp is None) == (want_lp is None), mode
            for g, w in zip(got_lp or [], want_lp or [], strict=True):
                assert g.keys() == w.keys(), mode
                assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in w), mode
    assert {"FULL", "FULL-uniform", "PIECEWISE"} <= kinds, kinds


def test_one_token_prompt_logprobs_are_a_single_none(llms):
    """vLLM's shape: the first prompt token has no logprob, so a one-token prompt gives [None]."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    for mode in ("NONE", "FULL"):
        (out,) = llms[mode].generate([[42]], params)
        assert out.prompt_logprobs == [None], mode
