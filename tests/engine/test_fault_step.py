"""Fault injection into a step: non-finite logits, capture out of memory, a failing replay.

1. NaN or +-inf logits in one row (a faulty model): the other rows get the tokens (and
   logprobs) they get in a batch without the bad row, and the bad row a token id in
   [0, V), whatever the variant (greedy, sampled, all features) and the path (the torch
   reference, the Triton kernels interpreted on CPU). Which id the bad row gets is
   documented in the `Sampler` docstring: here a +inf entry wins, a row of only -inf gives
   token 0 and a greedy row with NaN entries gives its first NaN entry (torch.argmax ranks
   NaN highest); any other outcome is only checked to be in range. End to end, an engine
   whose model poisons one request's logits serves the other requests unchanged, in FULL
   graphs (emulated on CPU) and eagerly, and keeps serving afterwards.
2. A capture that runs out of memory at the N-th graph raises `torch.OutOfMemoryError`
   naming that graph (descriptor and sampling variant) and the memory figures, releases
   every graph captured before it, and leaves the runner serving eagerly (dispatch NONE)
   with the same tokens; capture can then be run again.
3. An error inside a replay surfaces as `GraphReplayError` naming the graph, the device's
   error kept as `__cause__`.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from capture.full import FullGraph, GraphReplayError
from capture.pool import GraphPool
from graphrunner import LLM, SamplingParams
from graphrunner.kernels import HAS_TRITON
from graphrunner.sample.sampler import Sampler
from graphrunner.state.features import SamplingFeatures
from tests.sample.test_sampler import make_states

pytestmark = [
    # The Triton interpreter converts 1-element arrays to ints (numpy >= 1.25 warns) and computes
    # the NaN rows in numpy (which warns of the invalid values it was given).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

VOCAB = 50
BAD_ID = 7  # the entry a single-entry fault hits
INF, NAN = float("inf"), float("nan")
KINDS = ("+inf entry", "-inf entry", "NaN row", "-inf row", "NaN entry")

# Each variant with a batch it serves: row 0 greedy, the others using the variant's stages.
VARIANTS = {
    "greedy": (SamplingFeatures(), [SamplingParams(temperature=0.0)] * 3),
    "sampled": (SamplingFeatures.sampled_only(), [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, min_p=0.05, seed=3),
        SamplingParams(temperature=1.2, top_p=0.6, seed=9),
    ]),
    "all": (SamplingFeatures.all_on(), [
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2),
        SamplingParams(temperature=0.9, top_k=7, top_p=0.8, seed=5, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.1, logit_bias={3: 2.0}, logprobs=5),
        SamplingParams(temperature=1.1, min_p=0.1, seed=11, allowed_token_ids=tuple(range(30)), min_tokens=4,
                       stop_token_ids=(20, 21), logprobs=1),
    ]),
}
HISTORY = [5, 6, 7, 8, 9, 10, 11, 12]  # prompt [5, 6, 7, 8], then four output tokens
POSITION = len(HISTORY)


@pytest.fixture(scope="module")
def states():
    n = 3
    # Slot limits just above what VARIANTS use (1 bias entry, 2 stop ids): each slot is a loop
    # step of the sparse Triton pass, which the defaults (300, 16) made most of the Triton cases' time.
    return {name: make_states(params, VOCAB, histories=[HISTORY] * n, prompt_lens=[4] * n, max_logit_bias=4,
                              max_stop_ids=4)
            for name, (_, params) in VARIANTS.items()}


def _poison(logits: torch.Tensor, row: int, kind: str) -> torch.Tensor:
    x = logits.clone()
    if kind.endswith("row"):
        x[row] = NAN if kind.startswith("NaN") else -INF
    else:
        x[row, BAD_ID] = {"+inf entry": INF, "-inf entry": -INF, "NaN entry": NAN}[kind]
    return x


def _sample(states, logits, rows, features, fused):
    """Tokens, logprobs, logprob ids and ranks of state `rows` sampled from `logits`."""
    n, cols = len(rows), max(features.num_logprobs, 0) + 1
    out = torch.full((n,), -1, dtype=torch.int32)
    lp, ids, ranks = torch.zeros(n, cols), torch.zeros(n, cols, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    Sampler(states, _fused=fused)(
        logits, torch.tensor(rows, dtype=torch.int32), torch.full((n,), POSITION), features, out,
        out_logprobs=lp, out_logprob_ids=ids, out_ranks=ranks,
    )
    return out, lp, ids, ranks


def _check_bad_row(states, variant, logits, bad, kind, fused, clean):
    """The poisoned batch against the batch without the bad row (`clean(bad)`, cached)."""
    features, params = VARIANTS[variant]
    n = len(params)
    got = _sample(states, _poison(logits, bad, kind), list(range(n)), features, fused)
    keep = [r for r in range(n) if r != bad]
    for g, w in zip(got, clean(bad), strict=True):
        assert torch.equal(g[keep], w), (variant, kind, bad, g, w)
    token = int(got[0][bad])
    assert 0 <= token < VOCAB, (variant, kind, bad, token)
    if features.wants_logprobs:
        assert 0 <= int(got[2][bad].min()) and int(got[2][bad].max()) < VOCAB
        assert 1 <= int(got[3][bad]) <= VOCAB
    greedy_row = params[bad].temperature == 0.0 or not features.any_random
    documented = {"+inf entry": BAD_ID, "-inf row": 0}
    if greedy_row:
        documented.update({"NaN entry": BAD_ID, "NaN row": 0})
    if kind in documented:
        assert token == documented[kind], (variant, kind, bad, token)


def _clean_cache(states, logits, features, fused):
    cache: dict[int, tuple] = {}

    def clean(bad: int) -> tuple:
        if bad not in cache:
            keep = [r for r in range(logits.shape[0]) if r != bad]
            cache[bad] = _sample(states, logits[keep], keep, features, fused)
        return cache[bad]

    return clean


@pytest.mark.parametrize("fused", [
    False, pytest.param(True, marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")),
])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_non_finite_logits_stay_in_their_row(states, variant, fused):
    """Outcome of the bad row: an id in [0, V); +inf entry -> that entry, -inf row -> 0, NaN
    entry / NaN row on a greedy row -> the first NaN / 0; other rows as without it."""
    features, params = VARIANTS[variant]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    clean = _clean_cache(states[variant], logits, features, fused)
    # Torch: every kind in every row. Triton (interpreted: ~0.3 s a call): each kind in one
    # random row (rows 1 and 2 in turn), the rows its kernels sample.
    cases = [(kind, bad) for kind in KINDS for bad in range(len(params))] if not fused else \
        [(kind, 1 + i % 2) for i, kind in enumerate(KINDS)]
    for kind, bad in cases:
        _check_bad_row(states[variant], variant, logits, bad, kind, fused, clean)


@given(seed=st.integers(0, 2**31), variant=st.sampled_from(list(VARIANTS)), kind=st.sampled_from(KINDS),
       bad=st.integers(0, 2), scale=st.sampled_from([0.1, 3.0, 50.0]))
def test_non_finite_logits_any_logits(states, seed, variant, kind, bad, scale):
    """The same on random logits (torch kernels: the Triton ones are checked above)."""
    features, params = VARIANTS[variant]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * scale
    clean = _clean_cache(states[variant], logits, features, False)
    _check_bad_row(states[variant], variant, logits, bad, kind, False, clean)


# --------------------------------------------------------------------------- end to end

E2E = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
           num_kv_blocks=48, seed=0)
SIZES = (1, 2, 4, 8, 16)
PROMPTS = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]  # equal lengths: request 0 stays entry 0
WORKLOADS = {
    "greedy": [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 3,
    "sampled": [SamplingParams(max_tokens=4, temperature=0.9, top_k=40, top_p=0.9, seed=s, ignore_eos=True)
                for s in (1, 2, 3)],
    "all": [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=0.8, seed=7, repetition_penalty=1.2, logprobs=3,
                           ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, seed=8, logit_bias={5: 1.5}, ignore_eos=True)],
}


def _llm(mode: str, **kw) -> LLM:
    if mode == "NONE":
        return LLM("builtin:tiny-llama", enforce_eager=True, **E2E, **kw)
    return LLM("builtin:tiny-llama", enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=SIZES,
               compile_backend="eager", **E2E, **kw)


@pytest.fixture(scope="module")
def llms():
    return {"NONE": _llm("NONE"), "FULL": _llm("FULL")}


@pytest.fixture(scope="module")
def baselines(llms):
    return {w: [o.token_ids for o in llms["NONE"].generate(PROMPTS, params)] for w, params in WORKLOADS.items()}


def _generate(llm: LLM, workload: str) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, WORKLOADS[workload])]


def _head(model):
    """The module whose `logits` every sampling path reads (compute_logits and, for plain greedy
    batches, greedy_tokens when the fused head kernel does not serve them: CPU, fp32, one row)."""
    return model.lm_head if model.lm_head is not None else model.model.embed_tokens


def _poison_entry0(head, kind: str):
    """The head's logits with batch entry 0 (request 0 here) poisoned, as a faulty head would."""
    original = head.logits

    def poisoned(hidden):
        return _poison(original(hidden), 0, kind)

    return poisoned


@pytest.mark.parametrize("mode", ["FULL", "NONE"])
def test_engine_poisoned_request_leaves_others_alone(llms, baselines, mode, monkeypatch):
    """Request 0's logits are poisoned at every step; requests 1 and 2 get the tokens of the
    clean run, request 0 ids in range (all `BAD_ID` for a +inf entry); then the runner serves
    the clean workload again with the clean tokens."""
    llm = llms[mode]
    model = llm.runner.body.model
    replays: list[str] = []
    original_replay = FullGraph.replay

    def spy(self):
        replays.append(self.key)
        return original_replay(self)

    monkeypatch.setattr(FullGraph, "replay", spy)
    for kind in KINDS:
        monkeypatch.setattr(_head(model), "logits", _poison_entry0(_head(model), kind))
        for workload in WORKLOADS:
            got = _generate(llm, workload)
            assert got[1:] == baselines[workload][1:], (mode, kind, workload)
            assert all(0 <= t < llm.vocab_size for t in got[0]), (mode, kind, workload, got[0])
            if kind == "+inf entry":
                assert got[0] == [BAD_ID] * 4
    monkeypatch.undo()
    assert bool(replays) == (mode == "FULL")
    if mode == "FULL":  # every variant served a poisoned batch from a graph
        assert {key.split("[")[1] for key in replays} == {"greedy]", "sampled]", "all]"}
    for workload in WORKLOADS:
        assert _generate(llm, workload) == baselines[workload]


# --------------------------------------------------------------------------- capture out of memory


def _oom_at(n: int, monkeypatch) -> list:
    """FullGraph.capture raising torch.OutOfMemoryError at its n-th call; returns the graphs it was called on."""
    calls: list = []
    original = FullGraph.capture

    def capture(self, **kw):
        calls.append(self)
        if len(calls) == n:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at graph {n})")
        return original(self, **kw)

    monkeypatch.setattr(FullGraph, "capture", capture)
    return calls


def _drain(llm: LLM) -> None:
    """An empty step carrying the ids of the requests that finished last: their rows are freed
    (capture needs an idle runner)."""
    llm.runner.execute_model(llm.scheduler.schedule())
    llm.runner.sample_tokens()


@pytest.fixture(scope="module")
def oom_llm():
    return _llm("FULL_AND_PIECEWISE")


@pytest.mark.parametrize("nth", [1, 5, -1])
def test_capture_out_of_memory_leaves_a_clean_eager_runner(oom_llm, baselines, nth, monkeypatch):
    runner = oom_llm.runner
    graphs = runner.graphs
    # The graphs capture_model() takes (variants captured on first use since are not among them).
    num_full = sum(v in graphs.eager_variants for _, v in graphs.full_graphs)
    nth = nth if nth > 0 else num_full  # -1: the last graph
    _drain(oom_llm)
    calls = _oom_at(nth, monkeypatch)
    with pytest.raises(torch.OutOfMemoryError) as err:
        runner.capture_model(progress=False)
    monkeypatch.undo()
    message = str(err.value)
    failed = calls[-1].key
    assert failed.endswith(("[greedy]", "[sampled]", "[all]")) and failed.startswith("FULL(")
    num_pieces = sum(d.is_piecewise for d in graphs.table.descriptors)  # PIECEWISE sizes come first
    for part in (f"graph {num_pieces + nth} of {num_pieces + num_full}, {failed}", "out of device memory",
                 "device free", "GiB before capture", "reserved by torch", "graph pool grown",
                 f"{num_pieces + nth - 1} graphs captured before it", "cudagraph_capture_sizes"):
        assert part in message, (part, message)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    # Nothing half-captured survives to replay.
    assert not graphs.captured and not graphs.full_graphs and graphs.pool is None
    assert not any(g.captured for g in calls)
    assert graphs.body.compiled.captured_sizes == []
    assert graphs.dispatch(3, 3, 1).is_eager and graphs.dispatch(3, 12, None).is_eager
    # Steps run eagerly with the same tokens.
    replays = []
    monkeypatch.setattr(FullGraph, "replay", lambda self: replays.append(self))
    for workload in WORKLOADS:
        assert _generate(oom_llm, workload) == baselines[workload]
    assert not replays
    monkeypatch.undo()
    # Capture again: the same table, graphs replaying the same tokens.
    _drain(oom_llm)
    runner.capture_model(progress=False)
    assert graphs.captured and len(graphs.full_graphs) == num_full
    assert _generate(oom_llm, "all") == baselines["all"]


def test_capture_other_failure_also_releases_everything(oom_llm, monkeypatch, caplog):
    """Any error while capturing leaves no graph behind; its message gains the graph's name."""
    original = FullGraph.capture
    calls: list = []

    def capture(self, **kw):
        calls.append(self)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return original(self, **kw)

    monkeypatch.setattr(FullGraph, "capture", capture)
    _drain(oom_llm)
    with pytest.raises(RuntimeError, match="not permitted") as err:
        oom_llm.runner.capture_model(progress=False)
    monkeypatch.undo()
    assert any(calls[1].key in r.getMessage() and "released" in r.getMessage() for r in caplog.records)
    assert all(calls[1].key in note for note in getattr(err.value, "__notes__", [calls[1].key]))
    graphs = oom_llm.runner.graphs
    assert not graphs.captured and not graphs.full_graphs and not calls[0].captured
    oom_llm.runner.capture_model(progress=False)
    assert graphs.captured


# --------------------------------------------------------------------------- failing replay


def test_replay_error_names_the_graph_and_keeps_the_cause():
    state = {"fail": None}

    def step():
        if state["fail"] is not None:
            raise state["fail"]

    graph = FullGraph("FULL(t=4,r=4)[sampled]", step, GraphPool(torch.device("cpu")))
    graph.capture()
    graph.replay()
    cuda_error = RuntimeError("CUDA error: an illegal memory access was encountered")
    state["fail"] = cuda_error
    with pytest.raises(GraphReplayError, match=r"graph FULL\(t=4,r=4\)\[sampled\]: replay failed: CUDA error") as err:
        graph.replay()
    assert err.value.__cause__ is cuda_error
    inner = GraphReplayError("graph X: padding invariant broken")
    state["fail"] = inner  # already names its graph: not wrapped again
    with pytest.raises(GraphReplayError) as err:
        graph.replay()
    assert err.value is inner
    state["fail"] = ValueError("not a device error")
    with pytest.raises(ValueError):
        graph.replay()


def test_engine_replay_error_names_the_descriptor(llms, monkeypatch):
    """A CUDA error inside a replayed step reaches the engine's caller naming the graph;
    eagerly the same error arrives as it was raised."""
    for mode in ("FULL", "NONE"):
        model = llms[mode].runner.body.model

        def broken(hidden):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(_head(model), "logits", broken)
        with pytest.raises(RuntimeError, match="illegal memory access") as err:
            _generate(llms[mode], "greedy")
        monkeypatch.undo()
        if mode == "FULL":
            assert isinstance(err.value, GraphReplayError)
            assert str(err.value).startswith("graph FULL(t=16,r=4)[greedy]: replay failed")
            assert "illegal memory access" in str(err.value.__cause__)
        else:
            assert not isinstance(err.value, GraphReplayError)
