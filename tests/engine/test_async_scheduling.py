"""Async scheduling through `LLM` on CPU: exactly the tokens of sync scheduling.

Workloads mix random prompt lengths, max_tokens, stop tokens that end requests early
(so that a finished request's next step is already launched and its token discarded),
a KV cache small enough to force preemption (of requests with a token in flight) and a
token budget small enough to chunk prefills; greedy and seeded sampling; eager and
emulated FULL graphs.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner import LLM, SamplingParams
from graphrunner.cli import main
from tests.cuda_graphs import never_syncing

SIZES = (1, 2, 4, 8, 16)
# 13 blocks of 4 tokens; one request needs up to 12 (40-token prompt + 8 outputs): preemption.
SMALL = dict(device="cpu", dtype="float32", max_num_seqs=5, max_num_batched_tokens=16, max_model_len=64,
             block_size=4, num_kv_blocks=13, seed=0)


def _llm(mode: str, async_scheduling: bool | None) -> LLM:
    # None: the engine's default, which is the async loop.
    kw = {} if async_scheduling is None else {"async_scheduling": async_scheduling}
    if mode == "NONE":
        return LLM("builtin:tiny-llama", enforce_eager=True, **kw, **SMALL)
    return LLM("builtin:tiny-llama", enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=SIZES,
               compile_backend="eager", **kw, **SMALL)


@pytest.fixture(scope="module")
def pairs():
    pairs = {mode: (_llm(mode, False), _llm(mode, None)) for mode in ("NONE", "FULL")}
    assert all(not sync.async_scheduling and default.async_scheduling for sync, default in pairs.values())
    return pairs


@pytest.mark.parametrize("layout, reason", [
    (dict(prefill_context_parallel_size=2), "prefill_context_parallel_size=2"),
    (dict(data_parallel_size=2, data_parallel_lockstep=True), None),
    (dict(pipeline_parallel_size=2, data_parallel_size=2, data_parallel_lockstep=True),
     "data_parallel_lockstep=True with pipeline_parallel_size > 1"),
    (dict(pipeline_parallel_size=2, spec=2), "pipeline_parallel_size > 1 with speculative decoding"),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2), None),
    (dict(data_parallel_size=2), None),
])
def test_default_is_async_unless_the_layout_cannot_run_it(layout, reason):
    from graphrunner.config import ParallelConfig, SpeculativeConfig
    from graphrunner.engine.options import async_scheduling_default

    k = layout.pop("spec", 0)
    spec = SpeculativeConfig(num_speculative_tokens=k, method="ngram") if k else SpeculativeConfig()
    on, why = async_scheduling_default(ParallelConfig(**layout), spec)
    assert (on, why) == (reason is None, reason)


def _params(max_tokens: int, seed: int | None, stop: tuple[int, ...]) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, top_p=0.9, seed=seed,
                          stop_token_ids=stop, ignore_eos=True)


def _result(llm: LLM, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


def _assert_idle(llm: LLM) -> None:
    assert not llm.scheduler.has_unfinished_requests() and not llm._in_flight
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks
    assert llm.runner.output_ring.num_unresolved == 0
    assert all(r.num_output_placeholders == 0 for r in llm.scheduler.requests.values())


workloads = st.lists(
    st.tuples(
        st.integers(6, 40).flatmap(lambda n: st.lists(st.integers(0, 2047), min_size=n, max_size=n)),  # prompt
        st.integers(1, 8),  # max_tokens
        st.one_of(st.none(), st.integers(0, 2**31)),  # seed: None = greedy
        st.integers(0, 7),  # which free-running output becomes a stop token (>= max_tokens: none)
    ),
    min_size=3,  # enough requests to overflow the small cache: preemption
    max_size=6,
)


@settings(deadline=None)
@given(workloads)
def test_async_scheduling_matches_sync(pairs, workload):
    prompts = [w[0] for w in workload]
    free = [_params(n, seed, ()) for _, n, seed, _ in workload]
    for mode, (sync, async_) in pairs.items():
        # Stop tokens picked from a free run end requests early (at their first occurrence).
        free_run = [o.token_ids for o in sync.generate(prompts, free)]
        params = [
            _params(n, seed, (toks[k],) if k < len(toks) else ())
            for (_, n, seed, k), toks in zip(workload, free_run, strict=True)
        ]
        expected = _result(sync, prompts, params)
        assert _result(async_, prompts, params) == expected, mode
        _assert_idle(async_)


def test_async_engine_launches_before_resolving_and_preempts_with_tokens_in_flight():
    """Step N + 1 is launched while step N's output is unresolved; preemption still matches sync."""
    sync, async_ = _llm("NONE", False), _llm("NONE", True)
    events = []
    runner = async_.runner
    original_execute, original_sample = runner.execute_model, runner.sample_tokens

    def execute(so):
        events.append(("execute", runner.output_ring.num_unresolved))
        return original_execute(so)

    def sample(async_output=False):
        out = original_sample(async_output=async_output)
        events.append(("sample", async_output))
        return out

    runner.execute_model, runner.sample_tokens = execute, sample
    prompts = [[i + 1] * (30 + i) for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert _result(async_, prompts, params) == _result(sync, prompts, params)
    assert async_.scheduler.num_preemptions > 0 and sync.scheduler.num_preemptions > 0
    assert all(kind != "sample" or is_async for kind, is_async in events)
    # After the first step, every launch finds the previous output still unresolved.
    assert any(kind == "execute" and unresolved == 1 for kind, unresolved in events)
    _assert_idle(async_)


def test_eos_finish_discards_the_extra_token():
    sync, async_ = _llm("NONE", False), _llm("NONE", True)
    prompt = [[7, 7, 7, 7]]
    free = sync.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[free[2]])
    out = async_.generate(prompt, params)[0]
    assert out.token_ids == free[: free.index(free[2]) + 1] and out.finish_reason == "stop"
    _assert_idle(async_)
    # The runner still holds the finished row until the next plan says so; then it is gone.
    async_.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert async_.runner.req_states.num_live <= 1 and not async_.runner.req_states.has("0")


def test_cli_async_scheduling(capsys):
    assert main(["generate", "--device", "cpu", "--num-prompts", "3", "--prompt-len", "5", "--max-tokens", "4",
                 "--ignore-eos", "--num-kv-blocks", "64", "--max-model-len", "64", "--async-scheduling",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "generated tokens: 12" in out and "scheduling:       async" in out


@pytest.mark.gpu
def test_gpu_async_steps_never_sync_with_the_host():
    """Under FULL graphs, execute_model + sample_tokens(async_output=True) make no synchronizing CUDA call."""
    kw = dict(device="cuda", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=64,
              cudagraph_mode="FULL")
    prompts = [[1, 2, 3, 4], [5] * 9, [6, 7]]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    expected = _result(LLM("builtin:tiny-llama", **kw), prompts, params)
    llm = LLM("builtin:tiny-llama", async_scheduling=True, **kw)
    runner = llm.runner
    runner.execute_model = never_syncing(runner.execute_model)
    runner.sample_tokens = never_syncing(runner.sample_tokens)
    assert _result(llm, prompts, params) == expected
