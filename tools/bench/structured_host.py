"""Host time of a constrained step's engine calls, without a model (structured outputs).

    python -m graphrunner_tools.bench.structured_host [--requests 64 --steps 100 --vocab 151936
        --threads 1,auto --device cpu|cuda --rows consecutive|shuffled]

xgrammar JSON matchers (engine_bench's schema) over engine_bench's synthetic tokenizer walk fixed
token paths (random allowed tokens, none completing the JSON); each step times
`StructuredOutputs.grammar_output` (the deferred accepts and the masks, filled in the runner's
staging block as `StructuredOutputs.sample` does: while the step's forward runs), the runner side
`SamplingStates.write_grammar` (the upload; on --device cuda its launches, not the copy),
`after_output` (between two steps) and the runner's per-step grammar gate in `execute_model`
(`SamplingStates.masked_features`). One engine per `--threads` value (XGrammarBackend fill_threads),
steps interleaved across them; the masks must agree. Prints the median ms per step of each call.

--rows: the requests' state rows in batch order. consecutive (0, 1, ...: requests admitted together)
lets the upload copy the masks straight into place; shuffled (a fixed permutation: rows reused after
churn) takes the scatter path (`state/grammar_masks.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch

from graphrunner.engine.structured import StructuredOutputs, XGrammarBackend
from graphrunner.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput
from graphrunner.state.sampling import SamplingStates
from graphrunner.structured_outputs import StructuredOutputsParams
from graphrunner_tools.bench import engine_bench

PARAMS = StructuredOutputsParams(json=json.dumps(engine_bench.JSON_SCHEMA))


def token_paths(backend: XGrammarBackend, num: int, steps: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`num` paths of `steps` tokens each matcher accepts, none completing its grammar (mostly short
    ids, i.e. structure, so the paths leave strings)."""
    rng = np.random.default_rng(seed)
    row = np.zeros(-(-vocab // 32), dtype=np.int32)
    paths: list[list[int]] = []
    while len(paths) < num:
        matcher, path = backend.compile(PARAMS), list[int]()
        while len(path) < steps and not matcher.is_terminated():
            matcher.fill_bitmask(row)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])
            short = allowed[allowed < 200]
            path.append(int(rng.choice(short if len(short) and rng.random() < 0.6 else allowed)))
            matcher.accept_token(path[-1])
        if not matcher.is_terminated():
            paths.append(path)
    return paths


class _Scheduler:
    def __init__(self, ids: list[str]) -> None:
        self.requests = dict.fromkeys(ids)

    def finish_request(self, req_id: str, status) -> None:
        raise AssertionError(f"{req_id} completed: the paths never do")


def _engine(tokenizer, vocab: int, threads, ids: list[str], rows: np.ndarray, device: str):
    engine = StructuredOutputs(XGrammarBackend(tokenizer, vocab, threads), vocab)
    states = SamplingStates(len(ids) + 1, torch.device(device), vocab_size=vocab)
    for row, rid in zip(rows.tolist(), ids, strict=True):
        engine.add(rid, PARAMS)
        states.add_request(row, rid, SamplingParams(temperature=0.0, structured_outputs=PARAMS), vocab)
    states.apply_staged_writes()
    return engine, states


def run(args) -> dict[str, dict[str, float]]:
    """{threads: {call: median ms per step}}."""
    tokenizer = engine_bench.synthetic_tokenizer(args.vocab)
    ids = [f"r{i}" for i in range(args.requests)]
    threads = [engine_bench.fill_threads(t) for t in args.threads.split(",")]
    paths = token_paths(XGrammarBackend(tokenizer, args.vocab), args.requests, args.steps, args.vocab)
    rows = np.arange(len(ids))
    if args.rows == "shuffled":
        rows = np.random.default_rng(1).permutation(rows)
    engines = {t: _engine(tokenizer, args.vocab, t, ids, rows, args.device) for t in threads}
    times: dict[object, list[list[float]]] = {t: [] for t in threads}
    scheduler = _Scheduler(ids)
    features = engines[threads[0]][1].features(rows)  # the batch's, as the planner computes them
    sync = torch.cuda.synchronize if "cuda" in args.device else None
    for step in range(args.steps):
        so = SchedulerOutput()
        so.num_scheduled_tokens = dict.fromkeys(ids, 1)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[p[step]] for p in paths])
        masks: list[Any] = []
        for t in threads[step % len(threads):] + threads[: step % len(threads)]:  # rotate who goes first
            engine, states = engines[t]
            a = time.perf_counter()
            grammar = engine.grammar_output(so, args.device, states.grammar_block)  # the runner's staging
            b = time.perf_counter()
            states.write_grammar(rows, ids, grammar)
            c = time.perf_counter()
            engine.after_output(out, scheduler)
            d = time.perf_counter()
            assert states.masked_features(rows, features) is not None
            times[t].append([b - a, c - b, d - c, time.perf_counter() - d])
            masks.append(grammar.grammar_bitmask if grammar is not None else None)
            if sync is not None:
                sync()
        assert all(np.array_equal(m, masks[0]) for m in masks), f"step {step}: the fill threads disagree"
    calls = ("grammar_output", "write_grammar", "after_output", "gate")
    return {str(t): dict(zip(calls, np.median(np.array(v) * 1e3, axis=0).tolist(), strict=True))
            for t, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="structured_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--vocab", type=int, default=151936, help="qwen2.5's")
    p.add_argument("--threads", default="1,auto", help="comma-separated XGrammarBackend fill_threads values")
    p.add_argument("--device", default="cpu", help="where the runner's grammar masks live (write_grammar)")
    p.add_argument("--rows", choices=("consecutive", "shuffled"), default="consecutive",
                   help="the requests' state rows in batch order (see the module docstring)")
    args = p.parse_args(argv)
    if "cuda" not in args.device:
        torch.set_num_threads(1)  # CPU masks: small copies, where intra-op threads only wait on a busy host
    print(f"| fill threads | grammar_output ms | write_grammar ms | after_output ms | gate ms |  ({args.requests} "
          f"requests, vocab {args.vocab}, {args.steps} steps, --device {args.device}, --rows {args.rows})")
    print("|---|---:|---:|---:|---:|")
    for t, ms in run(args).items():
        print(f"| {t} | {ms['grammar_output']:.3f} | {ms['write_grammar']:.3f} | {ms['after_output']:.3f} | "
              f"{ms['gate']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
