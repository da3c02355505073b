"""Speculative decoding in the runner, against plain decoding as the reference.

With the n-gram drafter (one-hot drafts) verification is coupled to the plain sampler's
noise, so a speculative run must give exactly the tokens of a plain run: greedy and seeded
random requests alike, under chunked prefill, preemption and finishes, in every graph mode
(emulated on CPU; real CUDA graphs with GRAPHRUNNER_GRAPH_TEST_DEVICE=cuda). The driver
below is a small scheduler: it places q = 1 + k tokens for each decoding request (the
drafts being placeholders the runner reads on the device) and advances a request by the
tokens it emitted, which the runner checks against its own count at every step.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import CompilationConfig
from graphrunner.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from tests.runner_driver import make_runner

DEVICE = os.environ.get("GRAPHRUNNER_GRAPH_TEST_DEVICE", "cpu")
SIZES = (1, 2, 4, 8, 16, 24, 32)
MAX_MODEL_LEN, BLOCK = 64, 4
VOCAB = 2048  # builtin:tiny-llama


def ngram(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **extra}


def draft(k: int, **extra) -> dict:
    """The tiny model drafting for itself (same weights unless `draft_seed` says otherwise; `model=` another)."""
    return {"method": "draft_model", "model": "builtin:tiny-llama", "num_speculative_tokens": k, **extra}


def build(mode: str, spec: dict | None, device: str = DEVICE):
    if mode == "NONE":
        comp = CompilationConfig(enforce_eager=True)
    else:
        comp = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES, compile_backend="eager",
                                 debug_cudagraphs=True)
    runner = make_runner(speculative=spec, compilation=comp, device=device, max_num_seqs=4,
                         max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN, block_size=BLOCK,
                         num_blocks=4 * MAX_MODEL_LEN // BLOCK)
    if mode != "NONE":
        runner.capture_model(progress=False)
    return runner


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    live: bool = False  # admitted in the runner
    prefill_len: int = 0  # tokens known at admission: the runner decodes once they are computed
    logprobs: list = field(default_factory=list)

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.params.max_tokens or self.known >= MAX_MODEL_LEN


class SpecDriver:
    """Admits up to max_num_seqs requests, chunks prefills under a token budget, preempts
    on request (by recompute), finishes at max_tokens / max_model_len."""

    def __init__(self, runner, chunk: int = 32):
        self.runner, self.chunk = runner, chunk
        self.blocks_per_req = MAX_MODEL_LEN // BLOCK
        self.free_slots = list(range(runner.limits.max_num_reqs))
        self.reqs: dict[str, Req] = {}
        self.finished: set[str] = set()
        self.steps = 0

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.reqs[rid] = Req(list(prompt), params)

    def _admit(self, rid: str, r: Req) -> NewRequestData:
        slot = self.free_slots.pop()
        r.blocks = list(range(slot * self.blocks_per_req, (slot + 1) * self.blocks_per_req))
        r.live, r.computed, r.prefill_len = True, 0, r.known
        return NewRequestData(rid, list(r.prompt), r.params, r.blocks, 0, output_token_ids=list(r.outputs))

    def _release(self, r: Req) -> None:
        self.free_slots.append(r.blocks[0] // self.blocks_per_req)
        r.live, r.blocks = False, []

    def preempt(self, rid: str) -> set[str]:
        r = self.reqs[rid]
        if not r.live or r.done:
            return set()
        self._release(r)
        return {rid}

    def step(self, preempt: str | None = None) -> None:
        preempted = self.preempt(preempt) if preempt else set()
        so = SchedulerOutput(finished_req_ids=self.finished, preempted_req_ids=preempted)
        self.finished = set()
        budget = self.runner.limits.max_num_tokens
        q_spec = self.runner.uniform_decode_query_len
        for rid, r in self.reqs.items():
            if r.done or budget == 0 or (not r.live and not self.free_slots):
                continue
            if not r.live:
                so.scheduled_new_reqs.append(self._admit(rid, r))
            else:
                c = so.scheduled_cached_reqs
                c.req_ids.append(rid), c.new_block_ids.append(None), c.num_computed_tokens.append(r.computed)
            decoding = r.computed >= r.prefill_len  # the runner's rule (a resumed request prefills its outputs too)
            n = min(q_spec, MAX_MODEL_LEN - r.computed) if decoding else min(r.prefill_len - r.computed, self.chunk)
            so.num_scheduled_tokens[rid] = min(n, budget)
            budget -= so.num_scheduled_tokens[rid]
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.runner.execute_model(so)
        out = self.runner.sample_tokens()
        self.steps += 1
        for i, (rid, toks) in enumerate(zip(out.req_ids, out.sampled_token_ids, strict=True)):
            r, n = self.reqs[rid], so.num_scheduled_tokens[rid]
            r.computed += len(toks) if (r.computed >= r.prefill_len and n > 1) else n
            keep = toks[: max(0, r.params.max_tokens - len(r.outputs))]
            r.outputs += keep
            if out.logprobs is not None:
                r.logprobs += out.logprobs[i][: len(keep)]
            if r.done:
                self._release(r)
                self.finished.add(rid)

    def run(self, preemptions: dict[int, str] | None = None, max_steps: int = 400) -> dict[str, list[int]]:
        preemptions = preemptions or {}
        try:
            while not all(r.done for r in self.reqs.values()):
                assert self.steps < max_steps, "driver made no progress"
                self.step(preemptions.get(self.steps))
        finally:  # tell the runner, so that it can be reused (also after a failure)
            self.runner.sample_tokens()  # a pending step, if the failure left one
            live = set(self.runner.req_states.req_id_to_index)
            if live:
                self.runner.execute_model(SchedulerOutput(finished_req_ids=live))
                self.runner.sample_tokens()
        return {rid: r.outputs for rid, r in self.reqs.items()}


def drive(runner, workload, chunk: int = 32, preemptions: dict[int, str] | None = None) -> tuple[dict, int]:
    driver = SpecDriver(runner, chunk)
    for i, (prompt, params) in enumerate(workload):
        driver.add(f"r{i}", prompt, params)
    return driver.run(preemptions), driver.steps


def repetitive(rng: random.Random, n: int) -> list[int]:
    pattern = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
    return (pattern * n)[:n]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, min_tokens=3, frequency_penalty=0.4, max_tokens=8, ignore_eos=True),
]


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    reqs = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, 24))
        prompt = repetitive(rng, n) if draw(st.booleans()) else [rng.randrange(VOCAB) for _ in range(n)]
        reqs.append((prompt, draw(st.sampled_from(PARAMS))))
    chunk = draw(st.sampled_from([3, 8, 32]))
    preemptions = draw(st.dictionaries(st.integers(1, 12), st.sampled_from([f"r{i}" for i in range(len(reqs))]),
                                       max_size=2))
    return reqs, chunk, preemptions


SPEC_RUNNERS = [("NONE", 1), ("NONE", 3), ("FULL", 3), ("PIECEWISE", 3), ("FULL_AND_PIECEWISE", 2),
                ("FULL", "draft")]
# The FULL runner's draft model: tiny-llama with 2 of its 4 layers (still several layers' KV caches to
# keep apart). Its 1 + k passes a step made that runner 3x the cost of the others; the drafter's rules
# do not depend on the draft's depth (the 4-layer self-draft runs in the tests below).
TWO_LAYER_DRAFT = "builtin:tiny-llama-2l"


@pytest.fixture(scope="module")
def runners():
    from graphrunner.models import registry

    builtins = registry.BUILTIN_MODELS
    two = replace(builtins["builtin:tiny-llama"], name=TWO_LAYER_DRAFT, num_hidden_layers=2)
    registry.BUILTIN_MODELS = MappingProxyType({**builtins, TWO_LAYER_DRAFT: two})
    try:
        built = {("NONE", 0): build("NONE", None)}
        built.update({(mode, k): build(mode, ngram(k) if k != "draft" else
                                       draft(3, draft_seed=5, model=TWO_LAYER_DRAFT))
                      for mode, k in SPEC_RUNNERS})
        yield built
    finally:
        registry.BUILTIN_MODELS = builtins


@given(workloads())
def test_speculative_tokens_equal_plain_tokens_in_every_mode(runners, case):
    """Greedy and seeded requests, penalties and min_tokens, chunked prefill, preemption."""
    workload, chunk, preemptions = case
    expected, _ = drive(runners[("NONE", 0)], workload, chunk)
    for key in SPEC_RUNNERS:
        got, _ = drive(runners[key], workload, chunk, preemptions)
        assert got == expected, key


def test_repetitive_text_takes_fewer_steps(runners):
    """The drafts get accepted: a repetitive prompt decodes in fewer steps than tokens."""
    rng = random.Random(0)
    workload = [(repetitive(rng, 20), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
                for _ in range(2)]
    plain, plain_steps = drive(runners[("NONE", 0)], workload)
    spec, spec_steps = drive(runners[("NONE", 3)], workload)
    assert spec == plain
    assert spec_steps < plain_steps, (spec_steps, plain_steps)


def test_logprobs_of_every_emitted_token(runners):
    prompt = repetitive(random.Random(1), 12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    drivers = {}
    for key in (("NONE", 0), ("NONE", 3)):
        d = drivers[key] = SpecDriver(runners[key])
        d.add("a", prompt, params)
        d.run()
    plain, spec = drivers[("NONE", 0)].reqs["a"], drivers[("NONE", 3)].reqs["a"]
    assert spec.outputs == plain.outputs and len(spec.logprobs) == len(spec.outputs)
    for tok, got, want in zip(spec.outputs, spec.logprobs, plain.logprobs, strict=True):
        assert next(iter(got)) == tok and set(got) == set(want)
        assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-4)


def _decoding_step(runner, rid, prompt, params, drafts=None):
    """Admit `rid`, prefill it, and return the SchedulerOutput of its first decode step."""
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(rid, prompt, params, list(range(16)), 0)],
        num_scheduled_tokens={rid: len(prompt)}, total_num_scheduled_tokens=len(prompt)))
    runner.sample_tokens()
    q = 1 + (len(drafts) if drafts is not None else runner.uniform_decode_query_len - 1)
    so = SchedulerOutput(scheduled_cached_reqs=CachedRequestData([rid], [None], [len(prompt)]),
                         num_scheduled_tokens={rid: q}, total_num_scheduled_tokens=q)
    if drafts is not None:
        so.scheduled_spec_decode_tokens = {rid: drafts}
    return so


def _finish(runner, *rids):
    runner.execute_model(SchedulerOutput(finished_req_ids=set(rids)))
    runner.sample_tokens()


def test_scheduler_placed_drafts_are_verified(runners):
    """Real draft ids in scheduled_spec_decode_tokens replace the runner's own: the plain
    continuation is accepted in full, a wrong one is rejected; the tokens stay the plain ones."""
    prompt, params = [11, 12, 13, 14, 15], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain, _ = drive(runners[("NONE", 0)], [(prompt, params)])
    runner = runners[("NONE", 3)]
    cont = plain["r0"]  # cont[0] comes from the prefill; cont[1:4] are the right drafts
    for drafts, accepted in ((cont[1:4], 3), ([(t + 1) % VOCAB for t in cont[1:4]], 0), (cont[1:2] + [0, 0], 1)):
        so = _decoding_step(runner, "x", prompt, params, drafts)
        runner.execute_model(so)
        out = runner.sample_tokens()
        assert out.sampled_token_ids[0] == cont[1 : 2 + accepted]
        _finish(runner, "x")


BAD_DRAFTS = [
    (lambda so: so.scheduled_spec_decode_tokens.update(x=[VOCAB, 1, 2]), r"draft token id 2048 outside \[0, vocab"),
    (lambda so: so.scheduled_spec_decode_tokens.update(x=[-2, 1, 2]), r"draft token id -2 outside"),
    (lambda so: so.scheduled_spec_decode_tokens.update(x=[1, 2, 3, 4]), r"4 draft tokens, more than num_spec"),
    (lambda so: so.scheduled_spec_decode_tokens.update(x=[1, 2]), r"4 scheduled tokens, but a verifying request"),
    (lambda so: so.scheduled_spec_decode_tokens.update(x=[1, -1, 2]), r"mix placeholders"),
    (lambda so: so.scheduled_spec_decode_tokens.update(x=[1.5, 2, 3]), r"draft token id 1\.5 \(float\)"),
    (lambda so: so.scheduled_spec_decode_tokens.update(y=[1]), r"drafts for request 'y', which is not scheduled"),
    (lambda so: so.num_scheduled_tokens.update(x=5),
     r"1 token plus at most num_speculative_tokens=3 draft slots, got 5"),
]


@pytest.mark.parametrize("corrupt,message", BAD_DRAFTS)
def test_bad_drafts_are_rejected_and_the_runner_keeps_serving(runners, corrupt, message):
    runner = runners[("NONE", 3)]
    prompt, params = [5, 6, 7, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    so = _decoding_step(runner, "x", prompt, params, [-1, -1, -1])
    corrupt(so)
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    with pytest.raises(ValueError, match=message):
        runner.execute_model(so)
    ok = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["x"], [None], [len(prompt)]),
                         num_scheduled_tokens={"x": 4}, total_num_scheduled_tokens=4)
    runner.execute_model(ok)  # the same step, valid: served as if nothing happened
    assert 1 <= len(runner.sample_tokens().sampled_token_ids[0]) <= 4
    _finish(runner, "x")


def test_drafts_for_a_request_in_prefill_are_rejected(runners):
    runner = runners[("NONE", 3)]
    so = SchedulerOutput(scheduled_new_reqs=[NewRequestData("p", [1, 2, 3], SamplingParams(), list(range(4)), 0)],
                         num_scheduled_tokens={"p": 3}, total_num_scheduled_tokens=3,
                         scheduled_spec_decode_tokens={"p": [1, 2]})
    with pytest.raises(ValueError, match=r"drafts for request 'p', which is in prefill"):
        runner.execute_model(so)
    assert runner.req_states.num_live == 0


def test_synthetic_acceptance_is_a_benchmarking_aid():
    """Rate 1 accepts every slot (q tokens per decode step), rate 0 none (1 token)."""
    prompt, params = [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for rate, per_step in ((1.0, 4), (0.0, 1)):
        runner = build("NONE", ngram(3, rejection_sample_method="synthetic", synthetic_acceptance_rate=rate), "cpu")
        so = _decoding_step(runner, "s", prompt, params)
        runner.execute_model(so)
        assert len(runner.sample_tokens().sampled_token_ids[0]) == per_step


def test_take_draft_token_ids_returns_the_proposals(runners):
    runner = runners[("NONE", 3)]
    so = _decoding_step(runner, "t", [9, 8, 7, 9, 8, 7, 9, 8], SamplingParams(temperature=0.0, ignore_eos=True))
    runner.execute_model(so)
    out = runner.sample_tokens()
    drafts = runner.take_draft_token_ids()
    assert drafts is not None and drafts.req_ids == ["t"] and len(drafts.draft_token_ids[0]) <= 3
    assert runner.take_draft_token_ids() is None  # taken once
    history = [9, 8, 7, 9, 8, 7, 9, 8] + out.sampled_token_ids[0]
    for d in drafts.draft_token_ids[0]:
        assert 0 <= d < VOCAB and d in history  # prompt lookup proposes tokens of the history
    _finish(runner, "t")


def test_a_draft_model_of_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size=151936, the target 2048"):
        make_runner(speculative={"method": "draft_model", "model": "builtin:qwen2.5-0.5b", "num_speculative_tokens": 2})


def test_an_identical_draft_model_accepts_every_draft():
    """Same weights: every greedy draft is the target's token, so each decode emits k + 1."""
    k, max_tokens = 3, 17
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    workload = [([random.Random(2).randrange(VOCAB) for _ in range(9)], params)]
    plain, _ = drive(build("NONE", None, "cpu"), workload)
    got, steps = drive(build("NONE", draft(k), "cpu"), workload)
    assert got == plain
    assert steps == 1 + -(-(max_tokens - 1) // (k + 1))  # one prefill step, then k + 1 tokens a step


def test_draft_model_kv_stays_inside_the_rows_blocks():
    """The draft model's lookahead never writes KV outside the blocks a request holds: here
    the row's next table entry is stale (block 0, another request's) and must stay untouched."""
    runner = build("NONE", draft(3), "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    other = NewRequestData("b", [7, 8, 9], params, [0], 0)
    runner.execute_model(SchedulerOutput(scheduled_new_reqs=[other], num_scheduled_tokens={"b": 3},
                                         total_num_scheduled_tokens=3))
    runner.sample_tokens()
    before = [c[:, 0].clone() for c in runner.buffers.draft_kv_caches]  # b's block, written by its prefill
    a = NewRequestData("a", [1, 2, 3], params, [5], 0)  # 3 tokens + the new one fill block 5 exactly
    runner.execute_model(SchedulerOutput(scheduled_new_reqs=[a], num_scheduled_tokens={"a": 3},
                                         total_num_scheduled_tokens=3))
    runner.sample_tokens()
    drafts = runner.take_draft_token_ids()
    assert drafts is not None and len(drafts.draft_token_ids[0]) == 1  # room for one draft's KV in block 5
    for c, old in zip(runner.buffers.draft_kv_caches, before, strict=True):
        assert torch.equal(c[:, 0], old)


@pytest.mark.gpu
def test_speculative_cuda_graphs_match_plain_decoding_on_gpu():
    """Real CUDA graphs (FULL and FULL_AND_PIECEWISE) with the Triton kernels."""
    rng = random.Random(5)
    workload = [(repetitive(rng, 16) if i % 2 else [rng.randrange(VOCAB) for _ in range(9)], PARAMS[i % len(PARAMS)])
                for i in range(4)]
    expected, _ = drive(build("NONE", None, "cuda"), workload, 8)
    for mode, spec in (("NONE", ngram(3)), ("FULL", ngram(3)), ("FULL_AND_PIECEWISE", ngram(3)),
                       ("FULL", draft(3, draft_seed=5)), ("FULL_AND_PIECEWISE", draft(2))):
        got, _ = drive(build(mode, spec, "cuda"), workload, 8, {3: "r1"})
        assert got == expected, (mode, spec)
