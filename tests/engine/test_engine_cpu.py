"""The reference engine end to end on CPU: `LLM` over the real `ModelRunner`, and the CLI.

Skipped as a whole when `graphrunner.runner` cannot be imported.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("graphrunner.runner", reason="graphrunner.runner (the lead's ModelRunner) is not importable")

from graphrunner.cli import main  # noqa: E402
from graphrunner.engine import LLM  # noqa: E402
from graphrunner.protocol import SamplingParams  # noqa: E402

MODEL = "builtin:tiny-llama"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_llm(**kw) -> LLM:
    kw = {"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64,
          "num_kv_blocks": 64, "block_size": 4, **kw}
    return LLM(MODEL, **kw)


def random_prompts(n: int, seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


def tokens(outputs) -> list[tuple[list[int], str]]:
    return [(o.token_ids, o.finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


def test_generate_returns_outputs_in_input_order(llm):
    prompts = random_prompts(6)
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        assert len(o.token_ids) == 12 and o.finish_reason == "length"
        assert all(0 <= t < llm.vocab_size for t in o.token_ids)
    assert not llm.scheduler.has_unfinished_requests()
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks


def test_greedy_does_not_depend_on_batching(llm):
    """Alone, in one batch, and in tiny chunked steps: the same greedy tokens."""
    prompts = random_prompts(5, seed=1)
    batched = tokens(llm.generate(prompts, GREEDY))
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in prompts]
    assert batched == alone
    chunked = make_llm(max_num_batched_tokens=8, max_num_seqs=3)
    assert tokens(chunked.generate(prompts, GREEDY)) == batched


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)])
def test_preemption_resumes_to_the_same_tokens(llm, params):
    """A cache too small for the batch preempts; resumed requests end exactly as without preemption."""
    prompts = random_prompts(6, seed=2)
    roomy = tokens(llm.generate(prompts, params))
    # 9 blocks of 4 tokens: one request needs up to 9 (prompt <= 23 + 11 generated), six cannot share it.
    tight = make_llm(num_kv_blocks=9)
    assert tokens(tight.generate(prompts, params)) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_same_seed_same_samples():
    prompts = random_prompts(3, seed=3)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, ignore_eos=True)
    a = make_llm(seed=11).generate(prompts, params)
    b = make_llm(seed=11).generate(prompts, params)
    assert tokens(a) == tokens(b)


def test_stop_token_ids_end_to_end(llm):
    prompt = random_prompts(1, seed=4)
    free = llm.generate(prompt, GREEDY)[0].token_ids
    stop = free[4]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))[0]
    first = free.index(stop)
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"


def test_per_prompt_params_and_max_model_len(llm):
    prompts = [[1, 2, 3], list(range(60))]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=50, ignore_eos=True)])
    assert len(outs[0].token_ids) <= 2
    assert len(outs[1].token_ids) == 4 and outs[1].finish_reason == "length"  # 60 + 4 = max_model_len


def test_bad_prompts_are_rejected_and_the_engine_keeps_working(llm):
    with pytest.raises(ValueError, match=f"token id {llm.vocab_size} is out of range"):
        llm.generate([[1, 2], [llm.vocab_size]], GREEDY)
    with pytest.raises(ValueError, match="prompt length 65 exceeds max_model_len=64"):
        llm.generate([[1] * 65], GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([[1]], [GREEDY, GREEDY])
    assert not llm.scheduler.has_unfinished_requests()
    assert len(llm.generate([[1, 2]], GREEDY)[0].token_ids) == 12


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="cudagraph_bogus"):
        LLM(MODEL, device="cpu", cudagraph_bogus=1)


# ------------------------------------------------------------------------------ CLI


def test_cli_generate_prints_throughput(capsys):
    assert main(["generate", "--device", "cpu", "--num-prompts", "4", "--prompt-len", "8", "--max-tokens", "6",
                 "--ignore-eos", "--num-kv-blocks", "64", "--max-model-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "generated tokens: 24" in out
    assert "output tokens/s:" in out and "elapsed seconds:" in out
    assert "model:            builtin:tiny-llama" in out and "device:           cpu" in out
    assert "output 0 (length, 6 tokens): [" in out and "output 3" not in out


def test_cli_generate_with_fp8_kv_cache(capsys):
    assert main(["generate", "--model", MODEL, "--device", "cpu", "--num-prompts", "2", "--prompt-len", "8",
                 "--max-tokens", "3", "--num-kv-blocks", "16", "--max-model-len", "64",
                 "--kv-cache-dtype", "fp8"]) == 0
    assert "(float8_e4m3fn)" in capsys.readouterr().out


def test_cli_generate_reports_the_graph_mode_it_ran(capsys):
    """The summary names the captured mode (read before the engine shuts down and releases its
    graphs), and eager when nothing was captured."""
    common = ["generate", "--device", "cpu", "--num-prompts", "2", "--prompt-len", "4", "--max-tokens", "2",
              "--num-kv-blocks", "32", "--max-model-len", "64"]
    # The eager compile backend: the summary is what is checked (inductor: test_piecewise, ~10 s more here).
    assert main([*common, "--no-enforce-eager", "--cudagraph-mode", "FULL_DECODE_ONLY",
                 "--cudagraph-capture-sizes", "1,2", "--compile-backend", "eager"]) == 0
    assert "cudagraph mode:   FULL_DECODE_ONLY" in capsys.readouterr().out
    assert main(common) == 0
    assert "cudagraph mode:   NONE (eager)" in capsys.readouterr().out


def test_cli_default_run_finishes_quickly(capsys):
    assert main(["generate", "--device", "cpu", "--max-model-len", "256"]) == 0
    assert "num prompts:      8" in capsys.readouterr().out


def test_cli_text_prompt_needs_a_tokenizer():
    with pytest.raises(SystemExit, match="tokenizer.json"):
        main(["generate", "--device", "cpu", "--prompt", "hello"])


def test_cli_text_prompt_with_a_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    hf_fixtures = pytest.importorskip("tests.hf_fixtures")
    folder = hf_fixtures.make_hf_checkpoint("llama", tmp_path / "m")
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    words = ["[UNK]", "hello", "world", "graph"] + [f"w{i}" for i in range(vocab_size - 4)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", "--model", str(folder), "--device", "cpu", "--prompt", "hello world", "graph",
                 "--max-tokens", "3", "--ignore-eos", "--temperature", "0", "--num-kv-blocks", "64",
                 "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "num prompts:      2" in out and "prompt tokens:    3" in out
    assert "output 0 (length, 3 tokens): '" in out  # decoded text (a repr'd str), not a list of ids


def test_flat_prompt_is_a_type_error(llm):
    with pytest.raises(TypeError, match="list of token-id lists"):
        llm.generate([1, 2, 3], GREEDY)
    assert len(llm.generate([np.array([1, 2, 3])], GREEDY)[0].token_ids) == 12  # any sequence of ints per prompt


# ------------------------------------------------------------------------------ async scheduling


def test_async_scheduling_matches_sync_at_the_length_limits(llm):
    """max_tokens and max_model_len end requests whose next step is already planned: same outputs.

    Unseeded sampling draws its seed from the request id, which differs between engines: greedy or seeded only.
    """
    prompts = [[1, 2, 3], list(range(60)), random_prompts(1, seed=9)[0]]
    params = [SamplingParams(max_tokens=2, temperature=0.0),
              SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=1.0, seed=3, ignore_eos=True)]
    async_llm = make_llm(async_scheduling=True)
    assert tokens(async_llm.generate(prompts, params)) == tokens(llm.generate(prompts, params))
    assert async_llm.scheduler.block_allocator.num_free == async_llm.scheduler.num_blocks
    # Requests may be added between generate calls; the engine keeps working.
    assert tokens(async_llm.generate(prompts[:1], GREEDY)) == tokens(llm.generate(prompts[:1], GREEDY))
