"""Context-parallel benchmark: time to first token of long prompts, PCP vs one GPU.

    python -m graphrunner_tools.bench.cp_bench --out OUT_DIR [--model builtin:llama-3.1-8b]
        [--prompt-lens 16384,32768] [--configs pcp1,pcp2]

Each configuration runs as its own `graphrunner launch` world (one process per GPU, NCCL),
every rank running the engine (SPMD), bf16, dummy weights, the default FULL_AND_PIECEWISE
mode. For each prompt length L the engine takes one prompt of L tokens with max_tokens=1
and a token budget of L (the whole prefill is one step, split over the PCP ranks); the
time to first token is the wall time of that `generate` call (synchronised), after one
untimed warm-up of the same length; the median of `--repeats` runs is reported. The
first token of each run is recorded, so that configurations can be checked to agree.
Results: OUT_DIR/cp_bench.json and OUT_DIR/cp_bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

CONFIGS = {"pcp1": 1, "pcp2": 2}


def worker(args) -> None:
    import torch

    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    pcp = CONFIGS[args.worker]
    lens = [int(x) for x in args.prompt_lens.split(",")]
    longest = max(lens)
    start = time.perf_counter()
    llm = LLM(
        args.model, dtype="bfloat16", device="cuda", prefill_context_parallel_size=pcp, max_num_seqs=8,
        max_num_batched_tokens=longest, max_model_len=longest + 64, block_size=16,
        num_kv_blocks=(longest + 64) // 16 + 64, enforce_eager=False, cudagraph_capture_sizes=[1, 2, 4, 8],
        collective_timeout_s=args.timeout, seed=0,
    )
    result: dict = {"config": args.worker, "model": args.model, "pcp": pcp, "startup_s": time.perf_counter() - start,
                    "ttft": []}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for L in lens:
        prompt = [(37 * j + 11) % 30000 + 1 for j in range(L)]
        times, firsts = [], []
        for i in range(args.repeats + 1):  # the first run is the warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = llm.generate([prompt], params)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
                firsts.append(out[0].token_ids[0])
        result["ttft"].append({"prompt_len": L, "median_ms": 1e3 * statistics.median(times),
                               "runs_ms": [1e3 * x for x in times], "first_tokens": firsts})
    rank = llm.groups.rank
    llm.shutdown()
    if rank == 0:
        Path(args.result).write_text(json.dumps(result, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--model", default="builtin:llama-3.1-8b")
    p.add_argument("--prompt-lens", default="16384,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="pcp1,pcp2")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per world before it is killed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        sys.stdout.flush()
        os._exit(0)  # never hang in interpreter teardown after a clean shutdown

    import torch

    from graphrunner.distributed.launch import launch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for kind in args.configs.split(","):
        nproc = CONFIGS[kind]
        if nproc > torch.cuda.device_count():
            results.append({"config": kind, "skipped": f"needs {nproc} GPUs"})
            continue
        path = out / f"cp_bench_{kind}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "graphrunner_tools.bench.cp_bench", "--worker", kind, "--result", str(path),
               "--model", args.model, "--prompt-lens", args.prompt_lens, "--repeats", str(args.repeats),
               "--timeout", str(args.timeout)]
        t = time.perf_counter()
        status = launch(cmd, nproc, timeout=args.timeout)
        entry = json.loads(path.read_text()) if status == 0 and path.is_file() else {"config": kind}
        entry.update(status=status, wall_s=round(time.perf_counter() - t, 1))
        results.append(entry)
        (out / "cp_bench.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "cp_bench.md").write_text(text)
    print(text)
    return 0 if all(r.get("status", 0) == 0 for r in results) else 1


def markdown(results: list[dict]) -> str:
    """The TTFT table, with each configuration's speed-up over pcp1 at the same length."""
    base = {t["prompt_len"]: t["median_ms"] for r in results if r.get("config") == "pcp1" for t in r.get("ttft", [])}
    lines = ["| config | prompt tokens | TTFT median ms | speed-up vs pcp1 | first tokens |", "|---|---|---|---|---|"]
    for r in results:
        if "ttft" not in r:
            lines.append(f"| {r.get('config')} | - | {r.get('skipped') or 'failed: status ' + str(r.get('status'))} "
                         "| - | - |")
            continue
        for t in r["ttft"]:
            ref = base.get(t["prompt_len"])
            ratio = f"{ref / t['median_ms']:.2f}x" if ref else "-"
            lines.append(f"| {r['config']} | {t['prompt_len']} | {t['median_ms']:.1f} | {ratio} "
                         f"| {t['first_tokens']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
