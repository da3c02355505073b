"""Which tier of the sort-free sampler (pivot_select) serves rows of a model's own logits.

    python -m graphrunner_tools.bench.sampler_tiers [--model builtin:qwen2.5-0.5b] [--temperature 0.8]
        [--top-p 0.95] [--top-k 0] [--min-p 0] [--num-prompts 4] [--device cpu|cuda]

Generates a few tokens greedily, keeps the logits of the last step, and runs `pivot_sample_triton`
on them with the given filters: per row, the probability of the top token, how many tokens hold
the top-p mass, and the tier (-1 reject: the unfiltered draw, proven kept; 0 guess, 1 pivots,
2 refine: pivots narrowed inside an overflowing window, 3 the one-program fallback). The synthetic
logits of `bench sampler` and a trained model's can land in different tiers; this tells which
one an end-to-end run pays for (on a CPU the kernels run under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import sys

import torch

# pivot_reject.TIER_REJECT, pivot_refine.TIER_GUESS .. TIER_FALLBACK
TIER_NAMES = {-1: "reject", 0: "guess", 1: "pivots", 2: "refine", 3: "fallback"}


def last_step_logits(model: str, num_prompts: int, device: str | None) -> torch.Tensor:  # [R, V] float32
    """The logits of the last step of a short greedy generate (dummy weights for builtins)."""
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM(model, device=device, max_num_seqs=num_prompts, max_model_len=256, num_kv_blocks=64,
              enforce_eager=True)
    net = llm.runner.body.model
    seen: list[torch.Tensor] = []
    compute = net.compute_logits

    def keep(hidden):
        logits = compute(hidden)
        seen.append(logits.detach().float().clone())
        return logits

    def greedy(hidden, out):  # plain greedy steps skip compute_logits on a GPU (sample/greedy_head.py)
        return out.copy_(keep(hidden).argmax(dim=-1))

    net.compute_logits = keep
    net.greedy_tokens = greedy
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(8)] for i in range(num_prompts)]
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    return seen[-1][:num_prompts].contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sampler_tiers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:qwen2.5-0.5b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    args = ap.parse_args(argv)
    from graphrunner.sample.pivot_select import pivot_sample_triton

    x = last_step_logits(args.model, args.num_prompts, args.device)
    rows, dev = x.shape[0], x.device
    probs = torch.softmax(x / args.temperature, dim=-1).sort(dim=-1, descending=True).values  # [R, V]
    holding = (probs.cumsum(-1) < args.top_p).sum(-1) + 1  # [R] tokens that hold the top-p mass
    tiers = pivot_sample_triton(
        x, torch.full((rows,), args.temperature, device=dev), torch.arange(rows, dtype=torch.int64, device=dev),
        torch.full((rows,), args.top_k, dtype=torch.int32, device=dev), torch.full((rows,), args.top_p, device=dev),
        torch.full((rows,), args.min_p, device=dev), args.top_k > 0, args.top_p < 1.0, args.min_p > 0.0,
        torch.zeros(rows, dtype=torch.int64, device=dev), torch.zeros(rows, device=dev))
    print(f"{args.model}: {rows} rows x {x.shape[1]} logits, T {args.temperature}, top-k {args.top_k}, "
          f"top-p {args.top_p}, min-p {args.min_p}")
    print("| row | top token prob | tokens holding top-p | tier |")
    print("|---:|---:|---:|---:|")
    for r in range(rows):
        tier = int(tiers[r])
        print(f"| {r} | {probs[r, 0].item():.3g} | {int(holding[r])} | {tier} {TIER_NAMES[tier]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
