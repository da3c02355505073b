"""`graphrunner serve` over several processes: the server drives a `WorkerLLM` (tensor or data
parallel ranks spawned by this pytest process, gloo on the CPU) with the real `openai` client.

Expected texts come from a one-process `LLM` over the same tiny trained-tokenizer model (greedy, so
every layout gives the same tokens); under TP a LoRA adapter named by the `model` field too. Under
DP each request runs on one replica and the replicas' outputs are merged; under TP every rank steps
every request. Bounded in time; 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("graphrunner.runner")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from graphrunner import LLM, LoRARequest, SamplingParams  # noqa: E402
from graphrunner.engine.serve_cli import make_server  # noqa: E402
from graphrunner.engine.workers import WorkerLLM  # noqa: E402
from tests.engine.test_engine_text import add_chat_template, make_text_model  # noqa: E402
from tests.lora.lora_fixtures import make_adapter  # noqa: E402

ARGS = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
            block_size=8, num_kv_blocks=64, collective_timeout_s=30.0)
PROMPTS = ["hello world", "the graph runner"]
MESSAGES = [{"role": "user", "content": "the graph runner"}]
GREEDY = dict(max_tokens=6, temperature=0.0)
DEADLINE_S = 60.0


@pytest.fixture(autouse=True)
def _plain_process(monkeypatch):
    """This process is no rank: `LLM(tensor_parallel_size=2)` spawns its ranks."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return add_chat_template(make_text_model(tmp_path_factory.mktemp("parallel_served_model")))


@pytest.fixture(scope="module")
def expected(folder) -> dict:
    with LLM(str(folder), **ARGS) as llm:
        return {"completions": [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(**GREEDY),
                                                                        use_tqdm=False)],
                "chat": llm.chat(MESSAGES, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text}


LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def lora(folder, tmp_path_factory) -> tuple[LoRARequest, str]:
    """(an adapter, the text one process gives PROMPTS[0] with it, greedy)."""
    pytest.importorskip("peft")
    request = LoRARequest("sql", 1, make_adapter(tmp_path_factory.mktemp("parallel_lora") / "sql", r=8, seed=1))
    with LLM(str(folder), **ARGS, **LORA_ARGS) as llm:
        return request, llm.generate(PROMPTS[:1], SamplingParams(**GREEDY), use_tqdm=False,
                                     lora_request=request)[0].outputs[0].text


@contextlib.contextmanager
def serving(llm, lora_modules=()) -> Iterator[tuple[str, object]]:
    """(base url, AsyncEngine) of a server over `llm` on an ephemeral port; stops it and the ranks after."""
    server, engine = make_server(llm, host="127.0.0.1", port=0, api_key=None, served_model_name="tiny",
                                 max_queued_requests=16, lora_modules=lora_modules)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=DEADLINE_S)
        engine.shutdown()


def wait_idle(llm, engine) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while engine.num_live or llm.scheduler_stats().num_used_blocks:
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.05)


def test_tp2_server_answers_as_one_process(folder, expected, lora):
    llm = LLM(str(folder), tensor_parallel_size=2, async_scheduling=True, **ARGS, **LORA_ARGS)
    assert isinstance(llm, WorkerLLM)
    procs = llm.processes
    with serving(llm, lora_modules=[lora[0]]) as (base, engine):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        out = client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY)
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected["completions"]
        # The adapter reaches the ranks with the request.
        adapted = client.completions.create(model="sql", prompt=PROMPTS[0], **GREEDY).choices[0].text
        assert adapted == lora[1] != expected["completions"][0]
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["chat"]
        with pytest.raises(openai.BadRequestError, match="out of range for vocab_size"):  # a rank's ValueError
            client.completions.create(model="tiny", prompt=[1, 2, 10**6], max_tokens=2)

        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
            assert r.status_code == 200
            for i, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                if i == 1:
                    break  # leave mid-stream: the ranks abort the request and free its blocks
        deadline = time.monotonic() + DEADLINE_S  # the server notices the disconnect on its next write
        while engine.stats.finished.get("abort", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        wait_idle(llm, engine)
        assert engine.stats.finished.get("abort", 0) == 1
        assert 'graphrunner:kv_cache_usage_perc{model_name="tiny"} 0.0' in httpx.get(base + "/metrics").text
    assert not any(p.is_alive() for p in procs)


@pytest.mark.slow
def test_dp2_server_spreads_requests_over_the_replicas(folder, expected):
    llm = LLM(str(folder), data_parallel_size=2, async_scheduling=True, **ARGS)

    async def main(base: str) -> list:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                      timeout=DEADLINE_S) as aclient:
            calls = [aclient.completions.create(model="tiny", prompt=p, **GREEDY) for p in PROMPTS * 2]
            return await asyncio.wait_for(asyncio.gather(*calls), DEADLINE_S)

    with serving(llm) as (base, engine):
        outs = asyncio.run(main(base))
        assert [o.choices[0].text for o in outs] == expected["completions"] * 2
        wait_idle(llm, engine)
        # Each replica looked prompts up in its own prefix cache: each served some of the requests.
        per_replica = llm._leader_results("scheduler_stats")
        assert len(per_replica) == 2 and all(s.prefix_query_tokens > 0 for s in per_replica), per_replica
        assert llm.scheduler_stats().num_running == 0
