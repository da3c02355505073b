"""Reference-engine workloads: prefix caching on vs off, constrained vs free decoding.

    python -m graphrunner_tools.bench.engine_bench prefix [--num-requests 256 --prefix-len 2048
        --suffix-len 128 --max-tokens 128]
    python -m graphrunner_tools.bench.engine_bench structured [--num-requests 64 --prompt-len 128
        --max-tokens 256]

`prefix`: every request is one shared prefix plus its own suffix. The engine runs the
workload with `enable_prefix_caching` off and on (one LLM each, a warm-up first, the cache
reset after it). It reports the time to finish, the tokens the runner executed, the hit rate,
and whether the greedy outputs agree.

`structured`: the same prompts free and constrained. With xgrammar, the constraint is a JSON
schema over the model folder's tokenizer; a folder without one (the builtin models) gets a
synthetic tokenizer of the model's vocabulary size (`synthetic_tokenizer`: single characters
plus random words), so xgrammar's mask time is measured at the real vocabulary size. Without
xgrammar, or with `--grammar token-id`, it is a token-id grammar
over the whole vocabulary (`ModuloGrammar`): half of the ids are allowed after each token.
That measures the runner's side (the mask upload, the all-features sampling variant, the
synchronization a constrained step needs) without xgrammar's own mask time. The bench
reports output tokens/s of each and their ratio (the target: >= 0.9 at 64 requests).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from graphrunner.engine.llm import LLM
from graphrunner.engine.structured import StructuredOutputs, make_structured_outputs
from graphrunner.protocol import SamplingParams
from graphrunner.structured_outputs import StructuredOutputsParams

JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "tags": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "age", "tags"]}


class ModuloGrammar:
    """A grammar over token ids: after token t, the ids with (id + t) even; never complete."""

    def __init__(self, vocab_size: int) -> None:
        bits = np.arange(((vocab_size + 31) // 32) * 32) % 2 == 0
        bits[vocab_size:] = False
        self.even = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
        self.odd = np.packbits(~bits & (np.arange(bits.size) < vocab_size), bitorder="little").view("<u4").view(
            np.int32)

    def compile(self, params: StructuredOutputsParams) -> ModuloMatcher:
        return ModuloMatcher(self)


class ModuloMatcher:
    def __init__(self, grammar: ModuloGrammar) -> None:
        self.grammar, self.history = grammar, [0]

    def fill_bitmask(self, out: np.ndarray) -> None:
        out[:] = self.grammar.even if self.history[-1] % 2 == 0 else self.grammar.odd

    def accept_token(self, token: int) -> bool:
        if (token + self.history[-1]) % 2:
            return False
        self.history.append(token)
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        del self.history[-num_tokens:]


@dataclass
class RunResult:
    label: str
    seconds: float
    tokens_executed: int
    output_tokens: int
    hit_rate: float | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _phase_timers(llm: LLM) -> tuple[dict[str, float], list[tuple[object, str, object]]]:
    """Wrap the engine's per-step host calls with timers: (seconds per phase, what to restore)."""
    seconds: dict[str, float] = {}
    restore = []
    targets = [(llm.scheduler, "schedule"), (llm.runner, "execute_model"), (llm._structured, "grammar_output"),
               (llm.runner, "sample_tokens"), (llm.scheduler, "update_from_output"),
               (llm._structured, "after_output"),
               # inside sample_tokens (nested: their time is also in the line above them)
               (llm.runner.state, "write_grammar"), (llm.runner, "_launch"), (llm.runner.outputs, "collect")]
    for obj, name in targets:
        fn = getattr(obj, name)
        restore.append((obj, name, obj.__dict__.get(name)))

        def timed(*a, _fn=fn, _name=name, **kw):
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                seconds[_name] = seconds.get(_name, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)
    return seconds, restore


def timed_generate(llm: LLM, label: str, prompts, params,
                   phases: bool = False) -> tuple[RunResult, list[list[int]]]:
    """Generate with the runner's executed tokens counted; (result, output token ids). With
    `phases`, also print the host seconds spent in each per-step engine call (a diagnostic:
    with sync scheduling, a call that waits for the GPU includes that wait)."""
    executed = [0]
    execute = llm.runner.execute_model

    def counting(so):
        executed[0] += so.total_num_scheduled_tokens
        return execute(so)

    llm.runner.execute_model = counting
    seconds, restore = _phase_timers(llm) if phases else ({}, [])
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - start
    for obj, name, own in reversed(restore):
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)
    del llm.runner.execute_model  # the class's method again
    if phases:
        spent = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in seconds.items())
        print(f"{label}: {spent} of {total * 1e3:.0f} ms")
    hit = getattr(llm.scheduler.block_allocator, "hit_rate", None)
    tokens = [list(o.token_ids) for o in outs]
    return RunResult(label, total, executed[0], sum(map(len, tokens)), hit), tokens


def build(args, **kw) -> LLM:
    return LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.num_requests, seed=args.seed,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               async_scheduling=args.async_scheduling, **kw)


def run_prefix(args) -> list[RunResult]:
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(0, 1000, args.prefix_len).tolist()
    prompts = [prefix + rng.integers(0, 1000, args.suffix_len).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results, outputs = [], []
    for caching in (False, True):
        llm = build(args, enable_prefix_caching=caching)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (compiles, graphs)
        if caching:
            llm.scheduler.reset_prefix_cache()  # the timed run starts cold: only its own prefix hits
        result, tokens = timed_generate(llm, f"prefix caching {'on' if caching else 'off'}", prompts, params)
        results.append(result)
        outputs.append(tokens)
        llm.shutdown()
    equal = sum(a == b for a, b in zip(*outputs, strict=True))
    # In bf16 a cached prefix is attended in another kernel split than a recomputed one: near-ties of
    # random weights can flip a greedy token there; --dtype float32 shows the equality itself.
    print(f"greedy outputs equal with and without caching: {equal}/{len(prompts)}")
    return results


def synthetic_tokenizer(vocab_size: int, seed: int = 0):
    """A Hugging Face tokenizer of `vocab_size` entries for models without one, shaped like a
    BPE vocabulary: specials, the printable ASCII characters, JSON punctuation pairs, then
    distinct words of 2-10 letters (half with a leading space, a tenth of them digits)."""
    import string

    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    pieces = [*string.printable[:95], *(a + b for a in '{}[]",: ' for b in '{}[]",: ')]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    letters, digits = np.array(list(string.ascii_letters)), np.array(list(string.digits))
    rng = np.random.default_rng(seed)
    while len(vocab) < vocab_size:
        n = int(rng.integers(2, 11))
        word = "".join(rng.choice(digits if rng.random() < 0.1 else letters, n))
        vocab.setdefault((" " if rng.random() < 0.5 else "") + word, len(vocab))
    model = tokenizers.models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=100)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def fill_threads(text: str) -> int | Literal["auto"]:
    """A --grammar-threads value: "auto" (xgrammar's choice) or a thread count."""
    return "auto" if text == "auto" else int(text)


def structured_outputs(llm: LLM, args) -> tuple[StructuredOutputs, StructuredOutputsParams, str]:
    """xgrammar JSON over the model's tokenizer (a synthetic one when the folder has none), else
    the token-id grammar."""
    if args.grammar != "token-id":
        tokenizer, kind = llm.tokenizer, "xgrammar JSON schema"
        if tokenizer is None:
            tokenizer, kind = synthetic_tokenizer(llm.runner.vocab_size), "xgrammar JSON schema, synthetic tokenizer"
        made = make_structured_outputs(tokenizer, llm.runner.vocab_size, fill_threads(args.grammar_threads))
        if made.backend is not None:
            return made, StructuredOutputsParams(json=json.dumps(JSON_SCHEMA)), kind
        if args.grammar == "json":
            raise SystemExit("--grammar json needs xgrammar: pip install 'graphrunner[structured]'")
    return (StructuredOutputs(ModuloGrammar(llm.runner.vocab_size), llm.runner.vocab_size),
            StructuredOutputsParams(regex="modulo"), "token-id grammar (no xgrammar or no tokenizer)")


def run_structured(args) -> list[RunResult]:
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, 1000, (args.num_requests, args.prompt_len)).tolist()
    llm = build(args, enable_prefix_caching=False, structured_output_graphs=args.structured_output_graphs)
    llm._structured, grammar, kind = structured_outputs(llm, args)  # the engine's matchers (a bench seam)
    print(f"constraint: {kind}" + (f", {args.grammar_threads} fill thread(s)" if "xgrammar" in kind else ""))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=1)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=1,
                                 structured_outputs=grammar)
    llm.generate(prompts[:2], [free, constrained])  # warm-up: both sampling variants' graphs
    runs: dict[str, list[RunResult]] = {"unconstrained": [], "constrained": []}
    for i in range(args.repeats):  # ABBA order: neither variant always runs first (host drift)
        order = [("unconstrained", free), ("constrained", constrained)][:: 1 if i % 2 == 0 else -1]
        for label, params in order:
            runs[label].append(timed_generate(llm, label, prompts, params, args.phases)[0])
    llm.shutdown()
    results = [median_run(r) for r in runs.values()]
    pairs = [c.output_tokens_per_s / u.output_tokens_per_s for u, c in zip(*runs.values(), strict=True)]
    print(f"constrained / unconstrained output tokens/s: "
          f"{results[1].output_tokens_per_s / results[0].output_tokens_per_s:.3f}"
          + (f" (medians of {args.repeats} runs each; per pair: {', '.join(f'{x:.3f}' for x in pairs)})"
             if args.repeats > 1 else ""))
    return results


def median_run(runs: list[RunResult]) -> RunResult:
    """The run of median time (the upper median of an even count): one repeat's own figures."""
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engine_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=["prefix", "structured"])
    p.add_argument("--model", default="builtin:qwen2.5-0.5b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", help="model dtype: auto (bf16 on CUDA), float32, ...")
    p.add_argument("--num-requests", type=int, default=None, help="default: 256 (prefix), 64 (structured)")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=None, help="default: 128 (prefix), 256 (structured)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--grammar", choices=["auto", "json", "token-id"], default="auto",
                   help="structured: xgrammar JSON when installed (auto), required (json), or the token-id grammar")
    p.add_argument("--grammar-threads", default="1", metavar="N|auto",
                   help="structured, xgrammar: threads of a step's mask fill (XGrammarBackend fill_threads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-structured-output-graphs", dest="structured_output_graphs", action="store_false",
                   help="structured: run constrained steps whole after their masks (no split forward/sampling graphs)")
    p.add_argument("--phases", action="store_true", help="structured: host seconds per engine call (diagnostic)")
    p.add_argument("--repeats", type=int, default=1,
                   help="structured: timed runs of each variant, alternating their order; the medians are reported")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    prefix = args.workload == "prefix"
    args.num_requests = args.num_requests or (256 if prefix else 64)
    args.max_tokens = args.max_tokens or (128 if prefix else 256)
    results = run_prefix(args) if prefix else run_structured(args)
    print("| run | seconds | tokens executed | output tokens | output tok/s | prefix hit rate |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        hit = "-" if r.hit_rate is None else f"{r.hit_rate:.1%}"
        print(f"| {r.label} | {r.seconds:.2f} | {r.tokens_executed} | {r.output_tokens} | "
              f"{r.output_tokens_per_s:.0f} | {hit} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
