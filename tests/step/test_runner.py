"""ModelRunner on CPU: incremental decoding over the paged cache, and bad input."""

import pytest

from graphrunner.kernels import HAS_TRITON
from graphrunner.protocol import NewRequestData, SamplingParams, SchedulerOutput
from tests.runner_driver import Driver, make_runner


@pytest.fixture(scope="module")
def runner():
    return make_runner()


def _recompute_greedy(runner, prompt, n_tokens, req_prefix):
    """Reference: every token from a fresh full prefill (no KV reuse across steps)."""
    tokens = list(prompt)
    for i in range(n_tokens):
        d = Driver(runner)
        d.add(f"{req_prefix}{i}", tokens)
        out = d.step()
        tokens.append(out[f"{req_prefix}{i}"][0])
        d.finish(f"{req_prefix}{i}")
    return tokens[len(prompt):]


def test_incremental_decode_matches_full_recompute(runner):
    prompts = {"a": [5, 9, 11, 3, 7, 100, 200], "b": [42] * 13, "c": list(range(1, 30))}
    d = Driver(runner)
    for rid, p in prompts.items():
        d.add(rid, p)
    for _ in range(8):
        d.step()
    for rid, p in prompts.items():
        got = d.reqs[rid].outputs
        assert len(got) == 8
        assert got == _recompute_greedy(runner, p, 8, f"ref-{rid}-")
    for rid in list(d.reqs):
        d.finish(rid)


def test_chunked_prefill_matches_single_prefill(runner):
    prompt = list(range(3, 60))
    whole = Driver(runner)
    whole.add("w", prompt)
    while len(whole.reqs["w"].outputs) < 6:
        whole.step()
    chunked = Driver(runner)
    chunked.add("c", prompt)
    while len(chunked.reqs["c"].outputs) < 6:
        chunked.step(chunk=10)
    assert chunked.reqs["c"].outputs == whole.reqs["w"].outputs
    whole.finish("w")
    chunked.finish("c")


def test_seeded_sampling_independent_of_batch(runner):
    params = SamplingParams(temperature=1.0, top_k=20, seed=1234)
    alone = Driver(runner)
    alone.add("s", [7, 8, 9], params)
    for _ in range(5):
        alone.step()
    alone_tokens = alone.reqs["s"].outputs
    alone.finish("s")
    crowd = Driver(runner)
    crowd.add("x", [1, 2, 3, 4, 5], SamplingParams(temperature=0.9, seed=1))
    crowd.add("s", [7, 8, 9], params)
    crowd.add("y", [10] * 20, SamplingParams(temperature=0.0))
    for _ in range(5):
        crowd.step()
    assert crowd.reqs["s"].outputs == alone_tokens
    for rid in ("x", "s", "y"):
        crowd.finish(rid)


def _new(rid, tokens, blocks=(0, 1, 2, 3), **kw):
    return NewRequestData(rid, list(tokens), SamplingParams(temperature=0.0), list(blocks), **kw)


def _step(runner, new=(), cached=(), sched=None, finished=()):
    so = SchedulerOutput(scheduled_new_reqs=list(new),
                         finished_req_ids=finished if isinstance(finished, list) else set(finished))
    for rid, nc, blocks in cached:
        so.scheduled_cached_reqs.req_ids.append(rid)
        so.scheduled_cached_reqs.new_block_ids.append(blocks)
        so.scheduled_cached_reqs.num_computed_tokens.append(nc)
    so.num_scheduled_tokens = dict(sched or {})
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    runner.execute_model(so)
    return runner.sample_tokens()


BAD_STEPS = {
    "prompt too long": (dict(new=[_new("bad", [1] * 129, blocks=range(16))], sched={"bad": 64}), "max_model_len=128"),
    "token out of vocab": (dict(new=[_new("bad", [1, 2, 999999])], sched={"bad": 3}), "999999"),
    "negative token": (dict(new=[_new("bad", [1, -1])], sched={"bad": 2}), "-1"),
    "unknown cached id": (dict(cached=[("ghost", 0, None)], sched={"ghost": 1}), "ghost"),
    "unknown scheduled id": (dict(sched={"nobody": 1}), "nobody"),
    "duplicate new id": (dict(new=[_new("live", [1, 2])], sched={"live": 2}), "already live"),
    "too many tokens": (dict(new=[_new("bad", [1] * 100, blocks=range(13))], sched={"bad": 100}),
                        "max_num_batched_tokens=64"),
    "block id out of range": (dict(new=[_new("bad", [1, 2], blocks=[96])], sched={"bad": 2}), "block id 96"),
    "float token count": (dict(new=[_new("bad", [1, 2, 3])], sched={"bad": 2.5}), r"2.5 \(float\); token counts"),
    "bool token count": (dict(cached=[("live", 4, None)], sched={"live": True}), r"True \(bool\)"),
    "float block id": (dict(new=[_new("bad", [1, 2], blocks=[1.5])], sched={"bad": 2}), r"block id 1.5 \(float\)"),
    "float num_computed": (dict(cached=[("live", 4.0, None)], sched={"live": 1}), r"4.0 \(float\); must be ints"),
    "finished ids not a set": (dict(finished=["live"]), "finished_req_ids must be a set"),
    "too few blocks": (dict(new=[_new("bad", [1] * 20, blocks=[5])], sched={"bad": 20}), "holds 1"),
    "decode of several tokens": (dict(cached=[("live", 4, None)], sched={"live": 3}), "exactly 1"),
    "wrong num_computed": (dict(cached=[("live", 2, None)], sched={"live": 1}), "num_computed_tokens=2"),
    "total mismatch": (None, "total_num_scheduled_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_bad_input_is_rejected_and_runner_keeps_serving(runner, case):
    """Each bad step raises naming the value, changes nothing, and the live request continues exactly."""
    kwargs, needle = BAD_STEPS[case]
    reference = Driver(runner)
    reference.add("ref", [3, 1, 4, 1])
    for _ in range(3):
        reference.step()
    expected = reference.reqs["ref"].outputs
    reference.finish("ref")

    blocks = list(range(40, 56))
    out = _step(runner, new=[NewRequestData("live", [3, 1, 4, 1], SamplingParams(temperature=0.0), blocks)],
                sched={"live": 4})
    tokens = out.sampled_token_ids[0]
    with pytest.raises(ValueError, match=needle):
        if kwargs is None:
            so = SchedulerOutput(num_scheduled_tokens={"live": 1}, total_num_scheduled_tokens=7)
            runner.execute_model(so)
        else:
            _step(runner, **kwargs)
    computed = 4
    for _ in range(2):
        out = _step(runner, cached=[("live", computed, None)], sched={"live": 1})
        computed += 1
        tokens += out.sampled_token_ids[0]
    assert tokens == expected
    _step(runner, finished={"live"})
    assert runner.req_states.num_live == 0


def test_execute_twice_without_sampling_is_an_error_and_the_step_survives(runner):
    """A second execute_model before sample_tokens raises; the pending step is kept and the runner goes on."""
    reference = Driver(runner)
    reference.add("ref2", [2, 7, 1, 8])
    expected = [reference.step()["ref2"][0] for _ in range(2)]
    reference.finish("ref2")

    blocks = list(range(60, 64))
    first = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("twice", [2, 7, 1, 8], SamplingParams(temperature=0.0), blocks)],
        num_scheduled_tokens={"twice": 4}, total_num_scheduled_tokens=4)
    runner.execute_model(first)
    with pytest.raises(RuntimeError, match="twice without sample_tokens"):
        runner.execute_model(SchedulerOutput(num_scheduled_tokens={"twice": 1}, total_num_scheduled_tokens=1))
    tokens = runner.sample_tokens().sampled_token_ids[0]
    out = _step(runner, cached=[("twice", 4, None)], sched={"twice": 1})
    assert tokens + out.sampled_token_ids[0] == expected
    _step(runner, finished={"twice"})
    assert runner.req_states.num_live == 0
    assert runner.sample_tokens().sampled_token_ids == []  # no step pending: an empty output (documented)


def test_not_initialized_errors():
    from graphrunner.runner import ModelRunner
    r = ModelRunner(make_runner().config, "cpu")
    with pytest.raises(RuntimeError, match="load_model"):
        r.execute_model(SchedulerOutput())


@pytest.mark.gpu
def test_gpu_incremental_decode_matches_cpu(tmp_path):
    """The same checkpoint on CUDA (fp32, Triton kernels) and CPU (torch reference) gives the same tokens."""
    from tests.hf_fixtures import make_hf_checkpoint

    path = str(make_hf_checkpoint("qwen2", tmp_path))
    outs = []
    for device in ("cpu", "cuda"):
        r = make_runner(path, device=device, load_format="auto")
        d = Driver(r)
        d.add("a", [5, 9, 11, 3, 7])
        d.add("b", list(range(1, 40)))
        for _ in range(10):
            d.step()
        outs.append({k: v.outputs for k, v in d.reqs.items()})
    assert outs[0] == outs[1]


def test_profile_run_before_kv_cache_uses_no_live_state():
    """determine_num_kv_blocks' profile path runs before initialize_kv_cache (as on CUDA)."""
    from graphrunner.runner import ModelRunner

    r = ModelRunner(make_runner().config, "cpu")
    r.load_model()
    from graphrunner.kv_cache import profile_run

    profile_run(r.body, r.kv_cache_shape)
    assert r.req_states.num_live == 0 and r.buffers.kv_caches == [] and r.buffers.block_tables is None


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def _rows_x32(tile):
    block_n, block_k, warps = tile
    return block_n * 32, block_k, warps


def test_two_runners_in_one_process_keep_their_own_kernel_plans(monkeypatch):
    """Each runner's layers and attention are planned when they are built, from that runner's KernelConfig.
    With GPU-class device properties faked for the CPU (the Triton kernels then run interpreted), one runner's
    projections take the GEMV method (its SwiGLU fusion off by config), the other's torch; the first runner
    keeps its plan after the second is built, and both give the same greedy tokens."""
    import graphrunner.layers.linear as linear
    from graphrunner.config import KernelConfig
    from graphrunner.kernels.device import DeviceProperties

    no_pdl = DeviceProperties((8, 0), 108, 85_000_000_000, 41_943_040, 2.04e12)  # PDL needs 9.0 (not interpreted)
    monkeypatch.setattr(linear, "device_properties", lambda device: no_pdl)
    # The planned tiles, 32x the rows per program: the interpreter pays ~10 ms a program whatever its
    # size, and the plans' 2-4 rows made ~5,800 programs of this test's 5 decode steps (~55 of its 60 s).
    # The kernels' code and K steps are the planned ones; only the grid is coarser.
    for plan in ("gemv_plan", "norm_gemv_plan"):
        planned = getattr(linear, plan)
        monkeypatch.setattr(linear, plan, lambda n, k, device=None, planned=planned: _rows_x32(planned(n, k, device)))
    runners = {"gemv": make_runner(kernel=KernelConfig(swiglu_gemv_max_k=0)),
               "torch": make_runner(kernel=KernelConfig(decode_gemv=False))}
    layers = {name: r.model.model.local_layers[0] for name, r in runners.items()}
    gemv = layers["gemv"].mlp.down_proj.method
    assert isinstance(gemv, linear.GemvMethod) and not gemv.fuse_swiglu and gemv.norm_tile
    assert isinstance(layers["gemv"].self_attn.qkv_proj.method, linear.GemvMethod)
    heads = {name: r.model.lm_head or r.model.model.embed_tokens for name, r in runners.items()}
    assert heads["gemv"].method.name == "gemv"
    for layer in (layers["torch"].mlp.down_proj, layers["torch"].self_attn.o_proj, heads["torch"]):
        assert layer.method is linear.TORCH_LINEAR
    tokens = {}
    for name, r in runners.items():
        driver = Driver(r)
        driver.add("a", [5, 9, 11, 3, 7, 100, 200])
        for _ in range(3):
            driver.step()
        driver.add("b", list(range(1, 12)))
        for _ in range(2):
            driver.step()
        tokens[name] = {rid: req.outputs for rid, req in driver.reqs.items()}
    assert tokens["gemv"] == tokens["torch"]
    assert isinstance(layers["gemv"].mlp.down_proj.method, linear.GemvMethod)
