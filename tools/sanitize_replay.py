"""One FULL-graph replay per sampling variant on a small model, for compute-sanitizer runs.

    compute-sanitizer --tool memcheck python -m graphrunner_tools.sanitize_replay [DEVICE]   (default cuda)

Builds builtin:tiny-llama on CUDA with FULL graphs at a few sizes, then generates with
greedy, plain-sampled and all-features parameters, so each captured variant (greedy /
sampled / all) replays, at a uniform-decode and a mixed descriptor. Prints the
descriptors that ran; exits non-zero if any variant did not replay.
"""

from __future__ import annotations

import sys

from graphrunner import LLM, SamplingParams
from graphrunner.step.graphs import variant_name

VARIANTS = {
    "greedy": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=7,
                              ignore_eos=True),
    "all": SamplingParams(max_tokens=6, temperature=0.8, top_k=20, repetition_penalty=1.2, presence_penalty=0.3,
                          logit_bias={5: 2.0}, min_tokens=2, logprobs=3, seed=9, ignore_eos=True),
}


def main(device: str = "cuda") -> int:
    llm = LLM("builtin:tiny-llama", device=device, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              block_size=16, num_kv_blocks=32, enforce_eager=False, cudagraph_mode="FULL",
              cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    replayed = set()
    graphs = llm.runner.graphs
    assert graphs is not None, "cudagraph_mode FULL keeps graphs"
    key_of = {id(g): f"{desc}[{variant_name(v)}]" for (desc, v), g in graphs.full_graphs.items()}
    for graph in graphs.full_graphs.values():
        original = graph.replay

        def spy(original=original, graph=graph) -> None:
            replayed.add(key_of[id(graph)])
            original()

        graph.replay = spy
    for name, params in VARIANTS.items():
        outs = llm.generate(prompts, params)
        print(name, [o.token_ids for o in outs])
    print("replayed:", sorted(replayed))
    missing = [n for n in VARIANTS if not any(k.endswith(f"[{n}]") for k in replayed)]
    if missing:
        print("variants that never replayed:", missing)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
