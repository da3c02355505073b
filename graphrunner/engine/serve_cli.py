"""`graphrunner serve MODEL`: the OpenAI-compatible HTTP server (graphrunner/engine/server.py).

    graphrunner serve builtin:llama-3.1-8b --port 8000 --api-key KEY
    curl localhost:8000/v1/completions -H 'Authorization: Bearer KEY' \\
        -d '{"prompt": [1, 2, 3], "max_tokens": 16}'

Takes the engine options of `graphrunner generate` (vLLM's names: -tp, --max-model-len,
--gpu-memory-utilization, ...). Async scheduling is on by default here. Needs the `serve`
extra: pip install 'graphrunner[serve]'.

With `--lora-modules sql=/adapters/sql chat=/adapters/chat` it serves two LoRA adapters as well
(implies --enable-lora): a request's `model` field picks one by name, or the base model by its
served name; GET /v1/models lists them all.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from graphrunner.engine.cli import add_engine_args, check_adapter_folder, engine_kwargs, strict_subparser

if TYPE_CHECKING:
    from graphrunner.protocol import LoRARequest

LORA_MODULE_KEYS = ("name", "path", "base_model_name")  # vLLM's JSON form; one base model, so the last is unused


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to the `graphrunner` parser."""
    p = strict_subparser(subparsers, "serve", help="serve a model over an OpenAI-compatible HTTP API",
                         description=__doc__)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="builtin:NAME or a Hugging Face checkpoint folder (or --model)")
    add_engine_args(p, model=None)
    p.set_defaults(async_scheduling=True)  # --no-async-scheduling: from add_engine_args
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (vLLM's default: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: none)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests held beyond --max-num-seqs; more get HTTP 429")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"), help="uvicorn's log level")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters served by name (implies --enable-lora): NAME=PATH, or vLLM's JSON form "
                        '\'{"name": NAME, "path": PATH}\'; a request\'s model field picks one')
    p.set_defaults(func=run)


def _lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules item as (name, path): NAME=PATH, or a JSON object with "name" and "path"."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules item {text!r} is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"--lora-modules item {text!r} must be a JSON object")
        unknown = sorted(set(value) - set(LORA_MODULE_KEYS))
        if unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: unknown keys {unknown} "
                                             f"(allowed: {list(LORA_MODULE_KEYS)})")
        name, path = value.get("name"), value.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: \"name\" and \"path\" must be strings")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: expected NAME=PATH or a JSON object")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: the name and the path must be non-empty")
    return name, path


def lora_requests(modules: Sequence[tuple[str, str]], *, base_names: Sequence[str],
                  max_lora_rank: int) -> list[LoRARequest]:
    """The `LoRARequest`s of --lora-modules, numbered 1, 2, ... in the order given (so each name keeps
    its id while the server runs); ValueError naming the module and its path for a duplicate name, a
    name of the base model, or a folder that is no PEFT adapter."""
    from graphrunner.protocol import LoRARequest

    requests: list[LoRARequest] = []
    seen: set[str] = set()
    for name, path in modules:
        if name in seen:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        if name in base_names:
            raise ValueError(f"--lora-modules: {name}={path}: {name!r} is the base model's name; pick another")
        seen.add(name)
        check_adapter_folder(f"--lora-modules {name}={path}", path, max_lora_rank)
        requests.append(LoRARequest(name, len(requests) + 1, path))
    return requests


def run(args: argparse.Namespace) -> int:
    """Load the engine, then serve until interrupted."""
    model = args.model_tag or args.model
    if model is None:
        raise SystemExit("graphrunner serve: name the model: graphrunner serve MODEL (builtin:NAME or a folder)")
    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit(f"graphrunner serve: MODEL {args.model_tag!r} and --model {args.model!r} differ")
    args.model = model
    if args.max_queued_requests < 0:
        raise SystemExit(f"graphrunner serve: --max-queued-requests={args.max_queued_requests} must be >= 0")
    if args.async_scheduling and (args.pcp > 1 or (args.data_parallel_lockstep and args.dp > 1 and args.pp > 1)):
        # On by this server's default, not by the caller: a layout the async loop cannot run gets the sync one.
        print("graphrunner serve: async scheduling off: it does not run with -pcp > 1 or with "
              "--data-parallel-lockstep and -pp > 1", file=sys.stderr, flush=True)
        args.async_scheduling = False
    served_model_name = args.served_model_name or model
    if args.lora_modules:
        args.enable_lora = True
    try:  # before the model loads: a bad folder fails in a moment
        loras = lora_requests(args.lora_modules or (), base_names=(served_model_name, model),
                              max_lora_rank=args.max_lora_rank)
    except ValueError as e:
        raise SystemExit(f"graphrunner serve: {e}") from None
    kwargs = engine_kwargs(args, "serve")
    try:
        import uvicorn  # noqa: F401

        from graphrunner.engine import server  # noqa: F401  (fastapi)
    except ImportError as e:
        raise SystemExit(f"graphrunner serve needs the serve extra ({e.name} is missing): "
                         "pip install 'graphrunner[serve]'") from None
    from graphrunner.engine.llm import LLM

    print(f"graphrunner serve: loading {model} ...", file=sys.stderr, flush=True)
    try:
        llm = LLM(**kwargs)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"graphrunner serve: {e}") from None
    try:
        _read_adapters(llm, loras)
    except ValueError as e:
        llm.shutdown()
        raise SystemExit(f"graphrunner serve: --lora-modules: {e}") from None
    serve(llm, host=args.host, port=args.port, api_key=args.api_key or None,
          served_model_name=served_model_name, max_queued_requests=args.max_queued_requests,
          log_level=args.uvicorn_log_level, lora_modules=loras)
    return 0


def _read_adapters(llm: Any, loras: Sequence[LoRARequest]) -> None:
    """Read and check every adapter against the loaded model, so that one made for another model fails
    at startup rather than in its first request. A parallel engine's ranks hold the adapters; there each
    is checked by its first request (a 400 naming the problem)."""
    manager = getattr(getattr(llm, "runner", None), "lora", None)
    if manager is None:
        return
    for lora in loras:
        manager.adapter(lora)


def serve(llm: Any, *, host: str, port: int, api_key: str | None, served_model_name: str,
          max_queued_requests: int, log_level: str = "warning", lora_modules: Sequence[LoRARequest] = ()) -> None:
    """Serve `llm` until interrupted (the engine thread and the `LLM` are shut down on the way out)."""
    server, engine = make_server(llm, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                                 max_queued_requests=max_queued_requests, log_level=log_level,
                                 lora_modules=lora_modules)
    adapters = f" and LoRA adapters {[lora.lora_name for lora in lora_modules]}" if lora_modules else ""
    print(f"graphrunner serve: {served_model_name}{adapters} on http://{host}:{port}/v1", file=sys.stderr,
          flush=True)
    try:
        server.run()
    finally:
        engine.shutdown()


def make_server(llm: Any, *, host: str, port: int, api_key: str | None, served_model_name: str,
                max_queued_requests: int, log_level: str = "warning",
                lora_modules: Sequence[LoRARequest] = ()) -> tuple[Any, Any]:
    """(a `uvicorn.Server` not started yet, its `AsyncEngine`) over `llm`: tests and benchmarks
    start it on a thread (`server.run()`) and stop it with `server.should_exit = True`. `lora_modules`:
    the adapters a request's `model` field may name (`llm` built with enable_lora=True)."""
    import uvicorn

    from graphrunner.engine.async_engine import AsyncEngine
    from graphrunner.engine.server import ServerConfig, build_app

    if lora_modules and llm.config.lora is None:
        raise ValueError(f"lora_modules {[lora.lora_name for lora in lora_modules]} need an engine built with "
                         "enable_lora=True")
    # Every DP replica runs up to max_num_seqs requests.
    parallel = llm.config.parallel
    engine = AsyncEngine(llm, max_live=llm.config.scheduler.max_num_seqs * parallel.data_parallel_size
                         + max_queued_requests)
    config = ServerConfig(served_model_name=served_model_name, model=llm.config.load.model, api_key=api_key,
                          max_queued_requests=max_queued_requests, lora_modules=tuple(lora_modules))
    app = build_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    return server, engine
