"""`graphrunner bench serve`: the OpenAI-compatible server under Poisson load, beside offline generate.

    graphrunner bench serve --model builtin:llama-3.1-8b --request-rate 4,16,64 --num-prompts 256

Starts `graphrunner serve`'s server in this process on 127.0.0.1 (an ephemeral port), or
drives one already running (`--url`). For each request rate it sends `--num-prompts`
streamed `/v1/completions` requests (random token-id prompts, `ignore_eos`, `--max-tokens`
each) with exponential inter-arrival times (a Poisson process; `inf` sends them all at once)
and reports request and output-token throughput, p50/p99 time to first token and p50/p99
inter-token latency (the gaps between a request's streamed chunks, each holding one step's
tokens). Started in-process, the same engine first runs the same prompts offline through
`LLM.generate`; `served_vs_offline` is the output throughput of the highest rate over that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

DEADLINE_S = 3600.0


@dataclass
class _Result:
    ok: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench serve` to the `graphrunner bench` group."""
    from graphrunner.engine.cli import add_engine_args

    p = sub.add_parser("serve", help="the HTTP server under Poisson load (TTFT, ITL, throughput) vs offline",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p, model="builtin:tiny-llama")
    p.add_argument("--url", default=None, help="a running server's base URL (default: start one in this process)")
    p.add_argument("--api-key", default=None, help="the server's API key")
    p.add_argument("--served-model-name", default=None, help="the model name to send (default: --model)")
    p.add_argument("--request-rate", default="4,16,64",
                   help="comma-separated request rates in req/s; 'inf' sends every request at once")
    p.add_argument("--num-prompts", type=int, default=128, help="requests per rate")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                   help="also time LLM.generate on the same prompts (in-process server only)")
    p.add_argument("--max-queued-requests", type=int, default=4096, help="the started server's queue bound")
    p.add_argument("--json", metavar="PATH", default=None, help="write results as JSON ('-' = stdout)")
    p.set_defaults(func=run, async_scheduling=True)


def parse_rates(text: str) -> list[float]:
    """"4,16,inf" -> [4.0, 16.0, inf]; SystemExit naming a bad value."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = math.inf if part == "inf" else float(part)
        except ValueError:
            raise SystemExit(f"graphrunner bench serve: --request-rate={text!r}: {part!r} is not a number or 'inf'") \
                from None
        if not rate > 0:
            raise SystemExit(f"graphrunner bench serve: --request-rate={text!r}: rates must be > 0")
        rates.append(rate)
    return rates


def run(args: argparse.Namespace) -> int:
    """Run the load at every rate; print a table (and write JSON); 0 when every request succeeded."""
    import numpy as np

    rates = parse_rates(args.request_rate)
    if min(args.num_prompts, args.prompt_len, args.max_tokens) < 1:
        raise SystemExit("graphrunner bench serve: --num-prompts, --prompt-len and --max-tokens must be >= 1")
    server = engine = thread = None
    offline = None
    url = args.url
    name = args.served_model_name or args.model
    rng = np.random.default_rng(args.seed)
    try:
        if url is None:
            from graphrunner.engine.cli import engine_kwargs
            from graphrunner.engine.llm import LLM
            from graphrunner.engine.serve_cli import make_server

            _log(f"loading {args.model} ...")
            llm = LLM(**engine_kwargs(args, "bench serve"))
            prompts = rng.integers(0, llm.vocab_size, size=(args.num_prompts, args.prompt_len)).tolist()
            if args.offline:
                offline = _offline(llm, prompts, args.max_tokens)
                _log(f"offline LLM.generate: {offline['output_tokens_per_s']:.1f} output tokens/s")
            server, engine = make_server(llm, host="127.0.0.1", port=0, api_key=args.api_key, served_model_name=name,
                                         max_queued_requests=args.max_queued_requests)
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            while not server.started:
                if not thread.is_alive():
                    raise SystemExit("graphrunner bench serve: the server did not start")
                time.sleep(0.02)
            url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        else:
            vocab = 1000  # a running server's vocabulary is unknown here: low ids exist in every model
            prompts = rng.integers(0, vocab, size=(args.num_prompts, args.prompt_len)).tolist()
        rows = []
        for rate in rates:
            _log(f"rate {rate} req/s: {args.num_prompts} requests ...")
            rows.append(asyncio.run(_drive(url, name, args.api_key, prompts, args.max_tokens, rate,
                                           np.random.default_rng(args.seed + 1))))
    finally:
        if server is not None:
            server.should_exit = True
            if thread is not None:
                thread.join(timeout=30)
        if engine is not None:
            engine.shutdown()
    saturated = max(rows, key=lambda r: math.inf if r["request_rate"] == "inf" else r["request_rate"]) if rows \
        else None
    data = {"kind": "serve", "model": args.model, "url": args.url, "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rates": rows, "offline": offline,
            "served_vs_offline": (saturated["output_tokens_per_s"] / offline["output_tokens_per_s"]
                                  if saturated and offline else None)}
    print(_table(data), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        text = json.dumps(data, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _offline(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Offline `LLM.generate` throughput on the prompts (after an untimed warm-up; prefix cache reset)."""
    from graphrunner.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.reset_prefix_cache()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": len(prompts) / elapsed}


async def _drive(url: str, model: str, api_key: str | None, prompts: list[list[int]], max_tokens: int, rate: float,
                 rng: Any) -> dict[str, Any]:
    """Send every prompt with Poisson arrivals at `rate`; the figures of the run."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results = [_Result() for _ in prompts]
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=DEADLINE_S, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.ensure_future(_one(client, model, prompt, max_tokens, results[i])))
            if rate != math.inf and i + 1 < len(prompts):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    done = [r for r in results if r.ok]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    tokens = sum(r.tokens for r in done)
    errors = sorted({r.error for r in results if r.error})
    return {"request_rate": rate if rate != math.inf else "inf", "completed": len(done),
            "failed": len(results) - len(done), "elapsed_s": elapsed, "requests_per_s": len(done) / elapsed,
            "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "ttft_ms_p50": _pct(ttfts, 50), "ttft_ms_p99": _pct(ttfts, 99),
            "itl_ms_p50": _pct(gaps, 50), "itl_ms_p99": _pct(gaps, 99), "errors": errors[:5]}


async def _one(client: Any, model: str, prompt: list[int], max_tokens: int, result: _Result) -> None:
    """One streamed completion: its first-chunk time, the gaps between chunks, its token count (usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 1.0}
    sent = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - sent
                else:
                    result.gaps.append(now - last)
                last = now
        result.ok = True
    except Exception as e:  # reported per rate, the run goes on
        result.error = f"{type(e).__name__}: {e}"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q) * 1000.0)


def _table(data: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [f"model {data['model']}: {data['num_prompts']} requests per rate, prompt {data['prompt_len']} tokens, "
             f"{data['max_tokens']} output tokens each",
             f"{'rate':>6} {'done':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'ITL p50':>8} {'ITL p99':>8}  (ms)"]
    for r in data["rates"]:
        lines.append(f"{r['request_rate']!s:>6} {r['completed']:>5} {r['requests_per_s']:>7.2f} "
                     f"{r['output_tokens_per_s']:>10.1f} {ms(r['ttft_ms_p50']):>9} {ms(r['ttft_ms_p99']):>9} "
                     f"{ms(r['itl_ms_p50']):>8} {ms(r['itl_ms_p99']):>8}")
        if r["errors"]:
            lines.append(f"       errors: {r['errors']}")
    if data["offline"]:
        lines.append(f"offline LLM.generate: {data['offline']['output_tokens_per_s']:.1f} out tok/s; "
                     f"served at the highest rate / offline = {data['served_vs_offline']:.2f}")
    return "\n".join(lines)


def _log(message: str) -> None:
    print(f"graphrunner bench serve: {message}", file=sys.stderr, flush=True)


__all__ = ["parse_rates", "register", "run"]
