"""Pooling parity with transformers on the same weights, in every graph mode.

An embedder (a bare Qwen3 decoder, last token + normalize from its modules.json) must give the
embeddings transformers' last hidden state gives (cosine > 0.9999), and a Llama sequence
classifier the same log-probabilities (within 1e-3), for batches of different prompt lengths
served eagerly, from FULL graphs and from PIECEWISE graphs (emulated on a CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphrunner import LLM
from graphrunner.pool import PoolingParams
from tests.pool.conftest import save_pooling_model

MODES = ["NONE", "FULL", "PIECEWISE"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3] * 21, [40, 41], [7]]


def _llm(path, mode: str, **kw) -> LLM:
    args = dict(runner="pooling", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=64, block_size=4, num_kv_blocks=64)
    args.update(kw)
    if mode == "NONE":
        return LLM(str(path), enforce_eager=True, **args)
    return LLM(str(path), enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32),
               compile_backend="eager", debug_cudagraphs=True, **args)


@torch.no_grad()
def _hf_last_hidden(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).last_hidden_state[0]  # [T, H]


@pytest.mark.parametrize("mode", MODES)
def test_embeddings_match_transformers(embedder, mode):
    path, hf = embedder
    llm = _llm(path, mode)
    outs = llm.embed(PROMPTS)
    assert [o.request_id for o in outs] == [str(i) for i in range(len(PROMPTS))]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = F.normalize(_hf_last_hidden(hf, prompt)[-1], dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == hf.config.hidden_size and out.prompt_token_ids == prompt
        assert abs(float(got.norm()) - 1.0) < 1e-5
        assert float(F.cosine_similarity(got, ref, dim=0)) > 0.9999
    if mode != "NONE":
        assert llm.runner.graphs.captured and llm.runner.last_descriptor is not None
        assert not llm.runner.last_descriptor.is_eager  # served from graphs, not silently eager
        # One FULL graph per descriptor: a pooling step has no sampler variants.
        assert all(v == llm.runner.graphs.eager_variants[0] for _, v in llm.runner.graphs.full_graphs)


@pytest.mark.parametrize("mode", MODES)
def test_classifier_log_probs_match_transformers(classifier, mode):
    path, hf = classifier
    llm = _llm(path, mode)
    outs = llm.classify(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
        got = torch.tensor(out.outputs.probs)
        assert out.outputs.num_classes == 3
        assert torch.allclose(got.log(), ref, atol=1e-3), (got.log(), ref)
    raw = llm.classify(PROMPTS[:1], PoolingParams(activation=False))[0].outputs.probs
    with torch.no_grad():
        assert torch.allclose(torch.tensor(raw), hf(torch.tensor([PROMPTS[0]])).logits[0], atol=1e-4)


def test_mean_pooling_dimensions_and_normalize(tmp_path):
    hf = save_pooling_model("embed", tmp_path, pooling="mean_tokens", normalize=False)
    llm = _llm(tmp_path, "NONE", max_model_len=32)  # a mean reads the whole prompt in one step
    assert llm.runner.pooler_config.pooling_type == "MEAN" and not llm.runner.pooler_config.normalize
    plain, short, unit = (llm.embed(PROMPTS, p) for p in (None, PoolingParams(dimensions=16),
                                                          PoolingParams(normalize=True)))
    for i, prompt in enumerate(PROMPTS):
        ref = _hf_last_hidden(hf, prompt).mean(dim=0)  # every position of the prompt, averaged
        assert torch.allclose(torch.tensor(plain[i].outputs.embedding), ref, atol=1e-4)
        assert torch.allclose(torch.tensor(short[i].outputs.embedding), ref[:16], atol=1e-4)  # Matryoshka: cut only
        assert torch.allclose(torch.tensor(unit[i].outputs.embedding), F.normalize(ref, dim=-1), atol=1e-5)


def test_cls_pooling_in_graphs(tmp_path):
    hf = save_pooling_model("embed", tmp_path, pooling="cls_token")
    llm = _llm(tmp_path, "FULL", max_model_len=32)
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS), strict=True):
        ref = F.normalize(_hf_last_hidden(hf, prompt)[0], dim=-1)
        assert float(F.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0)) > 0.9999


def test_score_by_cosine_and_by_cross_encoder(embedder, tmp_path):
    path, hf = embedder
    llm = _llm(path, "NONE")
    scores = llm.score(PROMPTS[0], PROMPTS[1:3])
    for doc, out in zip(PROMPTS[1:3], scores, strict=True):
        a, b = (F.normalize(_hf_last_hidden(hf, p)[-1], dim=-1) for p in (PROMPTS[0], doc))
        assert abs(out.outputs.score - float(a @ b)) < 1e-4
    cross = save_pooling_model("classify", tmp_path, arch="llama", num_labels=1)
    llm = _llm(tmp_path, "NONE")
    pairs = llm.score([PROMPTS[0], PROMPTS[1]], [PROMPTS[2], PROMPTS[3]])
    for (a, b), out in zip([(PROMPTS[0], PROMPTS[2]), (PROMPTS[1], PROMPTS[3])], pairs, strict=True):
        with torch.no_grad():
            ref = torch.sigmoid(cross(torch.tensor([a + b])).logits[0, 0])
        assert abs(out.outputs.score - float(ref)) < 1e-4 and out.prompt_token_ids == a + b


def test_bad_pooling_calls_raise_and_leave_other_requests_alone(embedder, classifier):
    path, _ = embedder
    llm = _llm(path, "NONE")
    with pytest.raises(ValueError, match="classify.*embedding model"):
        llm.classify(PROMPTS)
    with pytest.raises(ValueError, match=r"dimensions=65 must be <= the embedding size 64"):
        llm.embed(PROMPTS, PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="generative runner"):
        llm.generate(PROMPTS)
    with pytest.raises(ValueError, match="prompt length 65 exceeds max_model_len=64"):
        llm.embed([[1] * 65, [2, 3]])
    assert not llm.scheduler.has_unfinished_requests()
    assert len(llm.embed(PROMPTS)) == len(PROMPTS)  # still serves
    gen = LLM("builtin:tiny-llama", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"embed\(\) needs a pooling runner"):
        gen.embed(PROMPTS)
    with pytest.raises(ValueError, match="is a pooling model"):
        LLM(str(classifier[0]), device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
            max_model_len=64, num_kv_blocks=16)


def test_runner_refuses_the_other_kind_of_request(embedder):
    """At the runner API: a pooling request on a generative runner (and the reverse) raises before
    any state changes, and the runner keeps serving."""
    from graphrunner.protocol import NewRequestData, SamplingParams, SchedulerOutput

    def plan(req_id: str, pooling: PoolingParams | None) -> SchedulerOutput:
        new = NewRequestData(req_id, [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0), [0],
                             pooling_params=pooling)
        return SchedulerOutput([new], num_scheduled_tokens={req_id: 3}, total_num_scheduled_tokens=3)

    gen = LLM("builtin:tiny-llama", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=64, num_kv_blocks=16).runner
    with pytest.raises(ValueError, match="'a' is a pooling request"):
        gen.execute_model(plan("a", PoolingParams()))
    assert gen.req_states.num_live == 0
    pool = _llm(embedder[0], "NONE").runner
    with pytest.raises(ValueError, match="'b' has pooling_params=None: a pooling runner serves pooling requests only"):
        pool.execute_model(plan("b", None))
    pool.execute_model(plan("c", PoolingParams(task="embed")))
    out = pool.sample_tokens()
    assert out.req_ids == ["c"] and out.sampled_token_ids == [[]] and out.pooler_output[0].shape == (64,)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_gpu_pooling_matches_transformers_from_cuda_graphs(embedder, classifier, mode):
    """CUDA, fp32, real CUDA graphs (inductor pieces): the same parity as on the CPU."""
    for (path, hf), task in ((embedder, "embed"), (classifier, "classify")):
        llm = LLM(str(path), runner="pooling", device="cuda", dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=32, max_model_len=64, block_size=16, num_kv_blocks=32, cudagraph_mode=mode)
        outs = getattr(llm, task)(PROMPTS)
        assert not llm.runner.last_descriptor.is_eager
        for prompt, out in zip(PROMPTS, outs, strict=True):
            with torch.no_grad():
                if task == "embed":
                    ref = F.normalize(_hf_last_hidden(hf, prompt)[-1], dim=-1)
                    got = torch.tensor(out.outputs.embedding)
                    assert float(F.cosine_similarity(got, ref, dim=0)) > 0.9999
                else:
                    ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
                    assert torch.allclose(torch.tensor(out.outputs.probs).log(), ref, atol=1e-3)
        llm.shutdown()
