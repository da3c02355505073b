"""Decode attention at 256 rows of qwen2.5-0.5b's heads, plain and with the rotary + KV write inside (`RopeKV`),
for Nsight Compute: why does the rope launch cost ~1.8 µs more per launch, at every context, and what is the
~4-6 µs fixed cost of either (docs/bench/s21/attn_context_s21_h100.txt)? Runs plain, rope, plain, rope (the
first two compile); profile the last two:

    ncu --kernel-name regex:_paged_attn_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        python3 docs/bench/decode_fusion/attn_ncu_s21.py
"""

from __future__ import annotations

import torch

from graphrunner.attention.triton_attn import RopeKV, paged_attention_triton
from graphrunner_tools.bench.attn_sweep import decode_batch, rope_inputs


def main() -> None:
    q, cache, md, out = decode_batch(256, 1024, 14, 2, 64)
    k, v, pos, cs = rope_inputs(q, md, 1024, 2)
    rope = RopeKV(k, v, pos, cs, md.slot_mapping)
    for _ in range(2):
        paged_attention_triton(q, cache, md, 0.125, out)
        paged_attention_triton(q, cache, md, 0.125, out, rope_kv=rope)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
