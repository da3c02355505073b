"""Multi-LoRA end to end: every request gets the tokens its own PeftModel gives.

One batch mixes two adapters of different ranks and target sets (one rsLoRA) with base-model rows,
and the same prompt under each of them (prefix caching must keep their KV apart), in every graph
mode (FULL graphs emulated on a CPU): greedy tokens equal transformers + peft's, and every step with
adapters ran a LoRA graph or eagerly, never a graph captured without them. Also: an adapter evicted
from its slot (and from host memory) and read again gives the same tokens; more distinct adapters
than `max_loras` queue instead of failing; a missing or malformed adapter folder fails that request
with an error naming it while the others keep running.
"""

from __future__ import annotations

import json

import pytest

from graphrunner import LLM, LoRARequest, SamplingParams
from graphrunner.kernels import HAS_TRITON
from tests.hf_fixtures import make_hf_checkpoint
from tests.lora.lora_fixtures import make_adapter, peft_greedy

pytest.importorskip("peft")

MODES = ["NONE", "FULL", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"]
MAX_TOKENS = 16
PROMPTS = [[1, 5, 9, 22, 31, 40, 7, 8, 9], [3, 4, 5], [7, 8, 100, 200, 300, 11],
           [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]
INT_IDS = {"a1": 1, "a2": 2, "a3": 3}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    ck = str(make_hf_checkpoint("llama", root / "base"))
    adapters = {
        "a1": make_adapter(root / "a1", r=8, targets=("q_proj", "v_proj", "down_proj"), seed=1),
        "a2": make_adapter(root / "a2", r=4, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=2,
                           use_rslora=True, lora_alpha=6),
        "a3": make_adapter(root / "a3", r=2, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"), seed=3),
    }
    refs = {name: peft_greedy(ck, path, PROMPTS, MAX_TOKENS) for name, path in adapters.items()}
    refs[None] = peft_greedy(ck, None, PROMPTS, MAX_TOKENS)
    return ck, adapters, refs, root


def _request(adapters, name):
    return None if name is None else LoRARequest(name, INT_IDS[name], adapters[name])


def _llm(ck, mode, **kw):
    args = dict(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                block_size=4, num_kv_blocks=96, seed=0, enable_lora=True, max_loras=2, max_lora_rank=8)
    args.update(kw)
    if mode == "NONE":
        return LLM(ck, enforce_eager=True, **args)
    return LLM(ck, enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=(1, 2, 4, 8, 16),
               compile_backend="eager", debug_cudagraphs=True, **args)


# (prompt index, adapter): two adapters and the base model, prompt 0 under each of them.
MIX = [(0, "a1"), (1, "a2"), (2, None), (0, "a2"), (0, None), (3, "a1")]


def test_adapters_change_the_tokens(world):
    """The parity below is not vacuous: each adapter's tokens differ from the base model's."""
    _, _, refs, _ = world
    for name in ("a1", "a2", "a3"):
        assert refs[name] != refs[None], name


@pytest.mark.parametrize("mode", MODES)
def test_mixed_batch_matches_peft(world, mode):
    ck, adapters, refs, _ = world
    llm = _llm(ck, mode)
    runs = []
    graphs = llm.runner.graphs
    run = graphs.run

    def spy(desc, batch, graph=None):
        runs.append((desc, batch.has_lora))
        return run(desc, batch, graph)

    graphs.run = spy
    prompts = [PROMPTS[i] for i, _ in MIX]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=[_request(adapters, name) for _, name in MIX], use_tqdm=False)
    for (i, name), out in zip(MIX, outs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i], (mode, i, name)
    assert all(desc.has_lora == has for desc, has in runs if not desc.is_eager), mode
    assert any(has for _, has in runs)
    if mode != "NONE":  # the LoRA graphs served the adapter steps, from their own compile (no recompiles)
        assert any(desc.has_lora and not desc.is_eager for desc, _ in runs), mode
        body = llm.runner.body
        assert body.compiled.num_graphs_compiled == body.compiled_lora.num_graphs_compiled == 1
    # A batch without adapters runs the plain graphs, as without LoRA.
    base = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert base[0].outputs[0].token_ids == refs[None][2][:4]
    assert not runs[-1][0].has_lora


def test_evicted_adapter_reloads_the_same(world):
    """One slot and one host entry: a1, a2, a1 evict each other; a1's tokens do not change."""
    ck, adapters, refs, _ = world
    llm = _llm(ck, "NONE", max_loras=1, max_cpu_loras=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    manager = llm.runner.lora
    for name in ("a1", "a2", "a1"):
        out = llm.generate([PROMPTS[0]], params, lora_request=_request(adapters, name), use_tqdm=False)
        assert out[0].outputs[0].token_ids == refs[name][0], name
    assert manager.num_loads == 3


def test_more_adapters_than_max_loras_queue(world):
    """Three adapters over max_loras=2 (and the base): the scheduler holds one back; no step has more
    than two distinct adapters, and everything finishes with its own tokens."""
    ck, adapters, refs, _ = world
    llm = _llm(ck, "FULL_AND_PIECEWISE")
    seen = []
    execute = llm.runner.execute_model

    def spy(so):
        ids = {r.lora_request.lora_int_id for r in so.scheduled_new_reqs if r.lora_request is not None}
        live = llm.runner.lora.adapter_of
        ids |= {live[r] for r in so.num_scheduled_tokens if r in live}
        seen.append(len(ids))
        return execute(so)

    llm.runner.execute_model = spy
    mix = [(0, "a1"), (1, "a2"), (2, "a3"), (3, None), (1, "a3"), (2, "a1")]
    outs = llm.generate([PROMPTS[i] for i, _ in mix],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=[_request(adapters, n) for _, n in mix], use_tqdm=False)
    for (i, name), out in zip(mix, outs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i], (i, name)
    assert max(seen) == 2


def test_bad_adapter_fails_that_request_only(world, tmp_path):
    """A missing folder and a malformed one fail their request with an error naming the file; the live
    requests keep running to their own tokens."""
    ck, adapters, refs, _ = world
    llm = _llm(ck, "NONE")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm.add_request("good", PROMPTS[0], params, lora_request=_request(adapters, "a1"))
    llm.add_request("base", PROMPTS[2], params)
    llm.step_outputs()  # both are live and running
    with pytest.raises(ValueError, match="does not exist"):
        llm.add_request("missing", PROMPTS[1], params, lora_request=LoRARequest("gone", 7, str(tmp_path / "gone")))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"unreadable JSON.*adapter_config\.json"):
        llm.add_request("broken", PROMPTS[1], params, lora_request=LoRARequest("broken", 8, str(broken)))
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"unreadable safetensors.*adapter_model\.safetensors"):
        llm.add_request("broken2", PROMPTS[1], params, lora_request=LoRARequest("broken", 9, str(broken)))
    with pytest.raises(ValueError, match="does not exist"):  # generate: refused before any step
        llm.generate([PROMPTS[1]], params, lora_request=LoRARequest("gone", 7, str(tmp_path / "gone")))
    done = {}
    while llm.has_unfinished_requests():
        finished, _ = llm.step_outputs()
        done.update({o.request_id: o.outputs[0].token_ids for o in finished})
    assert done == {"good": refs["a1"][0], "base": refs[None][2]}


def test_lora_request_needs_enable_lora(world):
    ck, adapters, _, _ = world
    llm = LLM(ck, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=16,
              enforce_eager=True)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), lora_request=_request(adapters, "a1"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_in_the_model_match_peft(world):
    """The projections through the Triton kernels (interpreted on a CPU; the CUDA path's op) instead of
    the torch reference: the same tokens as peft."""
    ck, adapters, refs, _ = world
    llm = _llm(ck, "NONE")
    for weights in llm.runner.lora.weights.values():
        weights.use_triton = True
    mix = MIX[:3]
    outs = llm.generate([PROMPTS[i] for i, _ in mix], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        lora_request=[_request(adapters, n) for _, n in mix], use_tqdm=False)
    for (i, name), out in zip(mix, outs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i][:6], (i, name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"])
def test_cuda_graphs_match_peft_gpu(world, mode):
    """On CUDA (float32, inductor pieces, real graphs, the Triton kernels): peft's tokens."""
    ck, adapters, refs, _ = world
    llm = LLM(ck, dtype="float32", device="cuda", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              block_size=16, num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8,
              cudagraph_mode=mode, cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32), debug_cudagraphs=True)
    assert all(w.use_triton for w in llm.runner.lora.weights.values())
    outs = llm.generate([PROMPTS[i] for i, _ in MIX], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                      ignore_eos=True),
                        lora_request=[_request(adapters, name) for _, name in MIX], use_tqdm=False)
    for (i, name), out in zip(MIX, outs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i], (mode, i, name)
    # One request at a time: batch-1 steps, where the one-row GEMV reads every slot's A (`LoraWeights.project`)
    assert all(w.gemv_shrink for w in llm.runner.lora.weights.values())
    for i, name in MIX[:2]:
        alone = llm.generate([PROMPTS[i]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                             lora_request=_request(adapters, name), use_tqdm=False)
        assert alone[0].outputs[0].token_ids == refs[name][i], (mode, "alone", i, name)
    llm.shutdown()


@pytest.mark.gpu
def test_lora_capture_time_within_half_again_gpu():
    """Llama-3.2-1B shapes (bf16, dummy weights), the default ladder up to 256 requests: capturing with LoRA
    (8 slots, rank 16) takes at most 1.5x the plain table's capture time (compile time is reported apart)."""
    seconds = {}
    for lora in (False, True):
        kw = dict(enable_lora=True, max_loras=8, max_lora_rank=16) if lora else {}
        llm = LLM("builtin:llama-3.2-1b", device="cuda", max_num_seqs=256, max_model_len=512, num_kv_blocks=512,
                  **kw)
        report = llm.runner.capture_report
        seconds[lora] = report.total_seconds
        llm.shutdown()
        del llm
    assert seconds[True] <= 1.5 * seconds[False], seconds
