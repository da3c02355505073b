"""The OpenAI-compatible server (`graphrunner serve`), driven by the real `openai` client.

One server per module, on 127.0.0.1 at an ephemeral port, over the tiny trained-tokenizer model
of tests/engine/test_engine_text.py (with a chat template). Expected texts come from the same `LLM`
offline, computed before the server takes it over. Every request loop is bounded in count and
time; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("graphrunner.runner")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from graphrunner import LLM, SamplingParams  # noqa: E402
from graphrunner.engine.serve_cli import make_server  # noqa: E402
from tests.engine.test_engine_text import add_chat_template, make_text_model  # noqa: E402

KEY = "test-key"
PROMPT = "hello world"
MESSAGES = [{"role": "user", "content": "the graph runner"}]
GREEDY = dict(max_tokens=8, temperature=0.0)
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, the LLM, the AsyncEngine, offline expectations) of a running server."""
    folder = add_chat_template(make_text_model(tmp_path_factory.mktemp("served_model")))
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=128, block_size=8, num_kv_blocks=256, async_scheduling=True)
    expected = {
        "completion": llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text,
        "chat": llm.chat(MESSAGES, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text,
        "n": [c.text for c in llm.generate(
            [PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3), use_tqdm=False)[0].outputs],
    }
    server, engine = make_server(llm, host="127.0.0.1", port=0, api_key=KEY, served_model_name="tiny",
                                 max_queued_requests=64)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", llm, engine, expected
    server.should_exit = True
    thread.join(timeout=DEADLINE_S)
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=DEADLINE_S)


def wait_idle(llm, engine) -> None:
    """Until the engine holds no request (bounded); the KV blocks are then all free."""
    deadline = time.monotonic() + DEADLINE_S
    while llm.scheduler.num_unfinished_requests or engine.num_live:
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.02)


def test_completion_equals_offline_generate(served, client):
    out = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == served[3]["completion"] and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0


def test_streamed_completion_joins_to_the_same_text(served, client):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == served[3]["completion"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_and_not(served, client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == served[3]["chat"]
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == served[3]["chat"]
    assert chunks[-1].usage.completion_tokens == 8


def test_n_completions_equal_offline_n(served, client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, n=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == served[3]["n"]


def test_logprobs_carry_decoded_tokens(served, client):
    out = client.completions.create(model="tiny", prompt=PROMPT, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text  # each token's text, decoded
    assert all(len(top) >= 2 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    base = served[0]
    assert httpx.get(base + "/health", timeout=DEADLINE_S).status_code == 200
    text = httpx.get(base + "/metrics", timeout=DEADLINE_S).text
    assert "# TYPE graphrunner:generation_tokens_total counter" in text
    assert 'graphrunner:time_to_first_token_seconds_count{model_name="tiny"}' in text


def test_malformed_bodies_get_400_in_openai_shape(served):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in ("{not json", json.dumps({"model": "tiny"}), json.dumps({"prompt": "x", "max_tokens": 0}),
                 json.dumps({"prompt": "x", "temperature": "hot"})):
        r = httpx.post(served[0] + "/v1/completions", content=body, headers=headers, timeout=DEADLINE_S)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["message"]
    r = httpx.post(served[0] + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, headers=headers,
                   timeout=DEADLINE_S)
    assert "max_tokens=0" in r.json()["error"]["message"]


def test_wrong_api_key_gets_401(served):
    bad = openai.OpenAI(base_url=served[0] + "/v1", api_key="wrong", max_retries=0, timeout=DEADLINE_S)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert "API key" in info.value.body["message"]


def test_disconnect_mid_stream_aborts_and_frees_blocks(served):
    base, llm, engine, _ = served
    aborted_before = engine.stats.finished.get("abort", 0)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break  # leave mid-stream: the connection closes
    wait_idle(llm, engine)
    assert engine.stats.finished.get("abort", 0) == aborted_before + 1
    assert llm.scheduler.block_allocator.num_used == 0


def test_64_concurrent_clients_all_answered_without_leak(served):
    base, llm, engine, _ = served

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0,
                                      timeout=DEADLINE_S) as aclient:
            calls = [aclient.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=4, temperature=0.0,
                                                extra_body={"ignore_eos": True}) for i in range(64)]
            return await asyncio.wait_for(asyncio.gather(*calls), DEADLINE_S)

    outs = asyncio.run(main())
    assert len(outs) == 64 and all(o.usage.completion_tokens == 4 for o in outs)
    wait_idle(llm, engine)
    assert llm.scheduler.block_allocator.num_used == 0 and not engine._live


def test_queue_overflow_gets_429(served):
    """With room for 2 live requests, 8 sent at once: the first 2 run to the end, the rest get 429."""
    base, llm, engine, _ = served
    limit, engine.max_live = engine.max_live, 2

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0,
                                      timeout=DEADLINE_S) as aclient:
            calls = [aclient.completions.create(model="tiny", prompt=PROMPT, max_tokens=100,
                                                extra_body={"ignore_eos": True}) for _ in range(8)]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), DEADLINE_S)

    try:
        outs = asyncio.run(main())
    finally:
        engine.max_live = limit
    refused = [o for o in outs if isinstance(o, openai.RateLimitError)]
    served_ok = [o for o in outs if not isinstance(o, Exception)]
    assert len(refused) + len(served_ok) == 8 and len(served_ok) >= 2 and refused, outs
    assert all(o.usage.completion_tokens == 100 for o in served_ok)
    assert all(e.status_code == 429 and "request limit" in e.body["message"] for e in refused)
    wait_idle(llm, engine)
