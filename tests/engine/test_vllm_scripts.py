"""Short programs written against vLLM's documented offline API, run unchanged on graphrunner.

Each script body is what a vLLM user writes (only the import line names graphrunner); it runs
on the tiny trained-tokenizer model of tests/engine/test_engine_text.py, and its printed text is
checked against what the engine's own token ids decode to. Also: `n` samples equal n separate
requests with vLLM's derived seeds, and share the prompt's KV blocks through the prefix cache.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("graphrunner.runner")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from graphrunner import LLM, SamplingParams  # noqa: E402
from graphrunner.engine.prompts import derived_seed  # noqa: E402
from graphrunner.protocol import SEED_MAX, SEED_MIN  # noqa: E402
from tests.engine.test_engine_text import add_chat_template, make_text_model  # noqa: E402

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                   block_size=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return add_chat_template(make_text_model(tmp_path_factory.mktemp("vllm_scripts")))


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(str(folder), **ENGINE_ARGS)


def run_script(body: str, llm: LLM) -> dict:
    """Run a vLLM-style script body with `llm` bound (as `LLM(model=...)` would give it); its globals."""
    scope: dict = {"llm": llm}
    exec(compile("from graphrunner import LLM, SamplingParams\n" + textwrap.dedent(body), "<script>", "exec"), scope)
    return scope


def test_generate_outputs_text(llm):
    scope = run_script("""
        prompts = ["hello world", "the graph runner"]
        sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=12)
        outputs = llm.generate(prompts, sampling_params)
        lines = []
        for output in outputs:
            prompt = output.prompt
            generated_text = output.outputs[0].text
            lines.append(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    """, llm)
    tok = llm.get_tokenizer()
    outs = scope["outputs"]
    assert [o.prompt for o in outs] == ["hello world", "the graph runner"]
    for o, line in zip(outs, scope["lines"], strict=True):
        text = tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert line == f"Prompt: {o.prompt!r}, Generated text: {text!r}"
        assert o.finished and o.outputs[0].finish_reason in ("stop", "length") and o.request_id


def test_n_samples_and_best_of(llm):
    scope = run_script("""
        params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6)
        out = llm.generate("hello world", params)[0]
        texts = [c.text for c in out.outputs]
        best = llm.generate("hello world", SamplingParams(n=2, best_of=4, temperature=1.0, seed=7, max_tokens=6))[0]
    """, llm)
    out = scope["out"]
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(set(scope["texts"])) > 1
    best = scope["best"].outputs
    assert len(best) == 2 and best[0].cumulative_logprob is None  # not asked for: ranked, then dropped
    # The two kept are the best of the four by cumulative logprob.
    four = llm.generate("hello world", SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, logprobs=0),
                        use_tqdm=False)[0].outputs
    ranked = sorted(four, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]


def test_beam_search(llm):
    scope = run_script("""
        from graphrunner import BeamSearchParams
        outputs = llm.beam_search([{"prompt": "hello world"}], BeamSearchParams(beam_width=3, max_tokens=5))
        best = outputs[0].sequences[0]
    """, llm)
    seqs = scope["outputs"][0].sequences
    assert len(seqs) == 3
    scores = [s.cum_logprob / len(s.tokens) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    tok = llm.get_tokenizer()
    assert scope["best"].text == tok.decode(scope["best"].tokens)
    assert scope["best"].tokens[:len(tok.encode("hello world"))] == tok.encode("hello world")
    # Width 1 is greedy decoding.
    greedy = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0]
    one = llm.beam_search(["hello world"], __import__("graphrunner").BeamSearchParams(
        beam_width=1, max_tokens=5, ignore_eos=True))[0].sequences[0]
    assert one.tokens[-5:] == greedy.outputs[0].token_ids


def test_chat(llm):
    scope = run_script("""
        conversation = [
            {"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "hello world"},
        ]
        outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8))
        reply = outputs[0].outputs[0].text
    """, llm)
    out = scope["outputs"][0]
    assert out.prompt == "system: You are a helpful assistant\nuser: hello world\nassistant:"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)[0]
    assert scope["reply"] == direct.outputs[0].text


def test_prompt_dicts(llm):
    scope = run_script("""
        ids = llm.get_tokenizer().encode("the graph runner")
        params = SamplingParams(temperature=0, max_tokens=6)
        a = llm.generate({"prompt": "the graph runner"}, params)[0]
        b = llm.generate([{"prompt_token_ids": ids}], params)[0]
    """, llm)
    a, b = scope["a"], scope["b"]
    assert a.prompt == "the graph runner" and b.prompt is None
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].text == b.outputs[0].text
    with pytest.raises(ValueError, match="prompt 0: multi_modal_data .* given, but the model is text-only"):
        llm.generate({"prompt": "x", "multi_modal_data": {}})
    with pytest.raises(ValueError, match="prompt 0: keys \\['not_a_field'\\] are not supported"):
        llm.generate({"prompt": "x", "not_a_field": 1})


def test_logprobs_with_decoded_tokens(llm):
    scope = run_script("""
        out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
        pieces = []
        for token_id, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            pieces.append(position[token_id].decoded_token)
    """, llm)
    out = scope["out"].outputs[0]
    tok = llm.get_tokenizer()
    assert scope["pieces"] == [tok.decode([t]) for t in out.token_ids]
    assert all(len(p) >= 3 for p in out.logprobs)
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs,
                                                                                      strict=True)))


def test_stop_strings_with_include_stop_str_in_output(llm):
    tok = llm.get_tokenizer()
    free = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop, free
    scope = run_script(f"""
        kept = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20, stop=[{stop!r}],
                                                            include_stop_str_in_output=True))[0].outputs[0]
        cut = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20, stop=[{stop!r}]))[0].outputs[0]
    """, llm)
    kept, cut = scope["kept"], scope["cut"]
    at = free.find(stop)
    assert cut.text == free[:at] and kept.text == free[:at + len(stop)]
    assert kept.finish_reason == cut.finish_reason == "stop" and kept.stop_reason == stop
    assert tok.decode(kept.token_ids, skip_special_tokens=True).startswith(kept.text)


def test_sampling_params_clone_and_engine_helpers(llm):
    params = SamplingParams(temperature=0.5, stop=["x"], n=2)
    copy = params.clone()
    assert copy == params and copy is not params
    assert llm.reset_prefix_cache() is True
    with pytest.raises(ValueError, match=r"n=0 must be an int in \[1, 1024\]"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"best_of=1 must be None or an int in \[n=2, 1024\]"):
        SamplingParams(n=2, best_of=1)


def test_bad_words_ban_single_token_words(llm):
    tok = llm.get_tokenizer()
    free = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    word = tok.decode([free.token_ids[0]])
    banned = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                        bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert free.token_ids[0] not in banned.token_ids


def test_defaults_and_over_length_error_names_the_default(folder):
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    # No max_model_len: the model's 2048 positions, lowered to the 64 x 8 tokens the cache holds.
    assert llm.scheduler.max_model_len == 512 and llm.scheduler.max_num_seqs == 256
    with pytest.raises(ValueError, match="exceeds max_model_len=512 \\(lowered from the model's 2048"):
        llm.generate([[5] * 600], use_tqdm=False)


def test_n_equals_separate_seeded_requests_and_shares_prompt_blocks(llm):
    prompt = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog, hello world")
    assert len(prompt) > 2 * 8  # at least two full blocks to share
    llm.reset_prefix_cache()
    alloc = llm.scheduler.block_allocator
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    shared = (len(prompt) - 1) // 8 * 8
    assert alloc.num_hit_tokens == 3 * shared  # siblings 1..3 took the first one's prompt blocks
    llm.reset_prefix_cache()
    for c in out.outputs:
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=123 + c.index, max_tokens=6,
                                                      ignore_eos=True), use_tqdm=False)[0]
        assert c.token_ids == alone.outputs[0].token_ids
    assert derived_seed(SEED_MAX, 1) == SEED_MIN  # wraps inside int64


def test_streamed_n_deltas_join_to_the_final(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    final = llm.generate("hello world", params, use_tqdm=False)[0]
    joined: dict[int, list[int]] = {0: [], 1: []}
    last = None
    for delta in llm.generate_stream("hello world", params):
        for c in delta.outputs:
            joined[c.index] += c.token_ids
        last = delta
    assert last is not None and last.finished
    assert [joined[0], joined[1]] == [c.token_ids for c in final.outputs]
    with pytest.raises(ValueError, match="best_of=3 > n=1 cannot stream"):
        llm.generate_stream("x", SamplingParams(best_of=3))


def test_tokenizer_errors_name_the_file(tmp_path, folder):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{broken / 'tokenizer.json'} is not valid JSON"):
        LLM(str(broken), **ENGINE_ARGS)
    # A tokenizer named apart from the model must be there: never silently none.
    with pytest.raises(ValueError, match=f"tokenizer='{tmp_path / 'missing'}': no tokenizer to load \\(no such folder"):
        LLM(str(folder), tokenizer=str(tmp_path / "missing"), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="has neither of \\['tokenizer.json', 'tokenizer_config.json'\\]"):
        LLM(str(folder), tokenizer=str(tmp_path), **ENGINE_ARGS)


def test_refused_arguments_say_why(folder):
    with pytest.raises(ValueError, match="trust_remote_code=True is refused"):
        LLM(str(folder), trust_remote_code=True, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="revision='main'.*local folders"):
        LLM(str(folder), revision="main", **ENGINE_ARGS)
