"""LoRA from the command line and the OpenAI-compatible server.

`generate` and `serve` turn vLLM's flags (--enable-lora, --max-loras, --max-lora-rank,
--max-cpu-loras) into `LLM` keyword arguments; `generate --lora-path DIR` runs every prompt on that
adapter; `serve --lora-modules NAME=PATH ...` serves adapters by name. Over the real `openai` client:
a request whose `model` names an adapter gets exactly the tokens `LLM.generate(..., lora_request=...)`
gives (and not the base model's), streamed or not, completion or chat; /v1/models lists the adapters;
an unknown name gets 404 naming the served ones. One server and one tiny trained-tokenizer model per
module, on 127.0.0.1 at an ephemeral port; expectations are computed before the server takes the LLM.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("graphrunner.runner")
pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from graphrunner import LLM, LoRARequest, SamplingParams  # noqa: E402
from graphrunner.cli import build_parser, main  # noqa: E402
from graphrunner.engine import serve_cli  # noqa: E402
from graphrunner.engine.cli import engine_kwargs  # noqa: E402
from tests.engine.test_engine_text import add_chat_template, make_text_model  # noqa: E402
from tests.lora.lora_fixtures import make_adapter  # noqa: E402

PROMPT = "hello world"
MESSAGES = [{"role": "user", "content": "the graph runner"}]
GREEDY = dict(max_tokens=8, temperature=0.0)
LLM_ARGS = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128,
                block_size=8, num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=8)
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(model folder, {adapter name: folder}) : the tiny text model and two rank-8 / rank-4 adapters."""
    root = tmp_path_factory.mktemp("lora_serve")
    folder = str(add_chat_template(make_text_model(root / "model")))
    adapters = {"sql": make_adapter(root / "sql", r=8, targets=("q_proj", "v_proj", "down_proj"), seed=1),
                "chat": make_adapter(root / "chat", r=4, targets=("k_proj", "o_proj", "up_proj"), seed=2)}
    return folder, adapters


def _texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def served(world):
    """(base url, the LLM, the AsyncEngine, offline expectations per model name) of a running server."""
    folder, adapters = world
    loras = serve_cli.lora_requests(list(adapters.items()), base_names=("tiny", folder), max_lora_rank=8)
    llm = LLM(folder, async_scheduling=True, **LLM_ARGS)
    serve_cli._read_adapters(llm, loras)  # what `serve` does after loading
    expected: dict = {}
    for name, lora in [("tiny", None), *((lo.lora_name, lo) for lo in loras)]:
        out = llm.generate([PROMPT], SamplingParams(**GREEDY, logprobs=0), use_tqdm=False, lora_request=lora)[0]
        c = out.outputs[0]
        expected[name] = {"text": c.text, "token_ids": list(c.token_ids),
                          "tokens": [lp[t].decoded_token for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
                          "chat": _texts(llm.chat(MESSAGES, SamplingParams(**GREEDY), use_tqdm=False,
                                                  lora_request=lora))[0]}
    server, engine = serve_cli.make_server(llm, host="127.0.0.1", port=0, api_key=None, served_model_name="tiny",
                                           max_queued_requests=16, lora_modules=loras)
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
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)


# ---------------------------------------------------------------- flags
def test_engine_flags_become_llm_kwargs():
    for command in ("generate", "serve"):
        model = ["builtin:tiny-llama"] if command == "serve" else []
        args = build_parser().parse_args([command, *model, "--enable-lora", "--max-loras", "3", "--max-lora-rank",
                                          "32", "--max-cpu-loras", "6"])
        kw = engine_kwargs(args, command)
        assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["max_cpu_loras"]) == (True, 3, 32, 6)
        kw = engine_kwargs(build_parser().parse_args([command, *model]), command)
        assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["max_cpu_loras"]) == (False, 1, 16, None)


def test_lora_path_needs_enable_lora(world):
    with pytest.raises(SystemExit, match=r"--lora-path '.*sql' needs --enable-lora"):
        main(["generate", "--device", "cpu", "--lora-path", world[1]["sql"]])


def test_lora_path_that_is_no_adapter_fails_before_the_model_loads(tmp_path):
    with pytest.raises(SystemExit, match=r"--lora-path: adapter folder '.*nowhere' does not exist"):
        main(["generate", "--device", "cpu", "--enable-lora", "--lora-path", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"--lora-path: '.*' has no adapter_config.json"):
        main(["generate", "--device", "cpu", "--enable-lora", "--lora-path", str(tmp_path)])


def test_generate_lora_path_runs_every_prompt_on_the_adapter(world, capsys):
    folder, adapters = world
    common = ["generate", "--model", folder, "--device", "cpu", "--dtype", "float32", "--num-prompts", "2",
              "--prompt-len", "5", "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "64", "--max-model-len", "64", "--num-kv-blocks", "32", "--no-warmup",
              "--json", "--enable-lora", "--max-lora-rank", "8"]
    runs = {}
    for name, extra in (("base", []), ("sql", ["--lora-path", adapters["sql"]])):
        assert main([*common, *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        runs[name] = [o["completions"][0]["token_ids"] for o in data["outputs"]]
        assert data["lora_path"] == (adapters["sql"] if extra else None)
    from graphrunner.engine.cli import _random_prompts

    with LLM(folder, **{**LLM_ARGS, "max_num_batched_tokens": 64, "max_model_len": 64}) as llm:
        prompts = _random_prompts(2, 5, llm.vocab_size, 0)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False,
                            lora_request=LoRARequest("cli", 1, adapters["sql"]))
    assert runs["sql"] == [list(o.outputs[0].token_ids) for o in outs]
    assert runs["sql"] != runs["base"]


def test_lora_modules_items_parse_in_both_forms():
    args = build_parser().parse_args(["serve", "m", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}',
                                      '{"name": "c", "path": "/x/c=d", "base_model_name": "m"}'])
    assert args.lora_modules == [("a", "/x/a"), ("b", "/x/b"), ("c", "/x/c=d")]
    for bad, why in (("a", "expected NAME=PATH"), ("=p", "must be non-empty"), ("{x", "is not JSON"),
                     ('{"name": "a"}', '"path" must be strings'), ('{"name": "a", "path": "p", "rank": 2}',
                                                                     "unknown keys ['rank']")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "m", "--lora-modules", bad])
        with pytest.raises(Exception, match=why.replace("[", r"\[").replace("]", r"\]")):
            serve_cli._lora_module(bad)


def test_lora_modules_are_checked_and_numbered(world, tmp_path):
    adapters = world[1]
    loras = serve_cli.lora_requests([("b", adapters["chat"]), ("a", adapters["sql"])], base_names=("m",),
                                    max_lora_rank=8)
    assert loras == [LoRARequest("b", 1, adapters["chat"]), LoRARequest("a", 2, adapters["sql"])]
    (tmp_path / "empty").mkdir()
    cases = [([("a", str(tmp_path / "gone"))], r"--lora-modules a=.*gone: adapter folder .* does not exist", 8),
             ([("a", str(tmp_path / "empty"))], r"--lora-modules a=.*empty: .* has no adapter_config.json", 8),
             ([("a", adapters["sql"]), ("a", adapters["chat"])], "the name 'a' is given twice", 8),
             ([("m", adapters["sql"])], "'m' is the base model's name", 8),
             ([("a", adapters["sql"])], r"--lora-modules a=.*sql: .* has rank 8, above --max-lora-rank=4", 4)]
    for modules, why, max_rank in cases:
        with pytest.raises(ValueError, match=why):
            serve_cli.lora_requests(modules, base_names=("m",), max_lora_rank=max_rank)


def test_serve_lora_modules_imply_enable_lora_and_fail_before_the_model_loads(world, monkeypatch, tmp_path):
    import graphrunner.engine.llm as llm_module

    taken: dict = {}

    def fake_llm(**kwargs):
        taken.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    args = build_parser().parse_args(["serve", "builtin:tiny-llama", "--device", "cpu", "--lora-modules",
                                      f"sql={world[1]['sql']}", "--max-lora-rank", "8"])
    with pytest.raises(SystemExit, match="stop here"):
        serve_cli.run(args)
    assert taken["enable_lora"] is True and taken["max_lora_rank"] == 8
    taken.clear()
    args = build_parser().parse_args(["serve", "builtin:tiny-llama", "--lora-modules", f"x={tmp_path / 'gone'}"])
    with pytest.raises(SystemExit, match=r"graphrunner serve: --lora-modules x=.*gone: adapter folder"):
        serve_cli.run(args)
    assert not taken  # the model never loaded


# ---------------------------------------------------------------- the server
def test_models_lists_the_adapters(served, world, client):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["tiny", "sql", "chat"]
    assert models["tiny"].parent is None
    for name, path in world[1].items():
        assert (models[name].parent, models[name].root) == ("tiny", path)


def test_completion_on_an_adapter_equals_offline_generate(served, client):
    expected = served[3]
    for name in ("sql", "chat"):
        assert expected[name]["token_ids"] != expected["tiny"]["token_ids"], name  # the adapter is applied
        out = client.completions.create(model=name, prompt=PROMPT, logprobs=0, **GREEDY)
        assert out.model == name
        assert out.choices[0].text == expected[name]["text"]
        assert out.choices[0].logprobs.tokens == expected[name]["tokens"]
        assert out.usage.completion_tokens == len(expected[name]["token_ids"])
    base = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert base.model == "tiny" and base.choices[0].text == expected["tiny"]["text"]


def test_streamed_completion_and_chat_on_an_adapter(served, client):
    expected = served[3]["sql"]
    chunks = list(client.completions.create(model="sql", prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
    chat = client.chat.completions.create(model="sql", messages=MESSAGES, **GREEDY)
    assert chat.choices[0].message.content == expected["chat"] != served[3]["tiny"]["chat"]
    chunks = list(client.chat.completions.create(model="sql", messages=MESSAGES, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["chat"]


def test_unknown_model_gets_404_naming_the_served_ones(served, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    message = info.value.body["message"]
    assert "'nope'" in message and all(f"'{n}'" in message for n in ("tiny", "sql", "chat")), message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)


def test_make_server_refuses_adapters_without_lora(world):
    class NoLoRA:
        class config:  # noqa: N801 - the shape of LLM.config
            lora = None

    with pytest.raises(ValueError, match=r"lora_modules \['a'\] need an engine built with enable_lora=True"):
        serve_cli.make_server(NoLoRA(), host="127.0.0.1", port=0, api_key=None, served_model_name="m",
                              max_queued_requests=1, lora_modules=[LoRARequest("a", 1, world[1]["sql"])])
