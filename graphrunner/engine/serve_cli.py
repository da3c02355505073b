"""`graphrunner serve MODEL`: the OpenAI-compatible HTTP server (graphrunner/engine/server.py).

    graphrunner serve builtin:llama-3.1-8b --port 8000 --api-key KEY
    curl localhost:8000/v1/completions -H 'Authorization: Bearer KEY' \\
        -d '{"prompt": [1, 2, 3], "max_tokens": 16}'

Takes the engine options of `graphrunner generate` (vLLM's names: -tp, --max-model-len,
--gpu-memory-utilization, ...). Async scheduling is on by default here. Needs the `serve`
extra: pip install 'graphrunner[serve]'.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from graphrunner.engine.cli import add_engine_args, engine_kwargs, strict_subparser


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
    p.set_defaults(func=run)


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
    if args.async_scheduling and (args.pcp > 1 or (args.data_parallel_lockstep and args.dp > 1)):
        # On by this server's default, not by the caller: a layout the async loop cannot run gets the sync one.
        print("graphrunner serve: async scheduling off: it does not run with -pcp > 1 or --data-parallel-lockstep",
              file=sys.stderr, flush=True)
        args.async_scheduling = False
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
    serve(llm, host=args.host, port=args.port, api_key=args.api_key or None,
          served_model_name=args.served_model_name or model, max_queued_requests=args.max_queued_requests,
          log_level=args.uvicorn_log_level)
    return 0


def serve(llm: Any, *, host: str, port: int, api_key: str | None, served_model_name: str,
          max_queued_requests: int, log_level: str = "warning") -> None:
    """Serve `llm` until interrupted (the engine thread and the `LLM` are shut down on the way out)."""
    server, engine = make_server(llm, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                                 max_queued_requests=max_queued_requests, log_level=log_level)
    print(f"graphrunner serve: {served_model_name} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        engine.shutdown()


def make_server(llm: Any, *, host: str, port: int, api_key: str | None, served_model_name: str,
                max_queued_requests: int, log_level: str = "warning") -> tuple[Any, Any]:
    """(a `uvicorn.Server` not started yet, its `AsyncEngine`) over `llm`: tests and benchmarks
    start it on a thread (`server.run()`) and stop it with `server.should_exit = True`."""
    import uvicorn

    from graphrunner.engine.async_engine import AsyncEngine
    from graphrunner.engine.server import ServerConfig, build_app

    # Every DP replica runs up to max_num_seqs requests.
    parallel = llm.config.parallel
    engine = AsyncEngine(llm, max_live=llm.config.scheduler.max_num_seqs * parallel.data_parallel_size
                         + max_queued_requests)
    config = ServerConfig(served_model_name=served_model_name, model=llm.config.load.model, api_key=api_key,
                          max_queued_requests=max_queued_requests)
    app = build_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    return server, engine
