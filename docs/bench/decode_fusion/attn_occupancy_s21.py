"""Decode attention with more programs resident per SM: KV splits plus a register cap.

At 256 rows of qwen2.5-0.5b's heads (14/2 x 64) the launch has 514 programs of 2 warps, 3.9 per SM, and
Nsight Compute (docs/bench/s21/call6/attn_ncu.txt, H200) shows 12% achieved occupancy, 0.45 eligible warps
per scheduler and the key loop's loads one block deep: each program waits on its own loads. Two splits
double the programs, but at 154 registers only 6 fit an SM (792 slots for 1,028 programs: a second, partial
wave; session 20 measured 50-56 µs against 43.7 on an H200). Capped at 128 registers (ptxas: 16-24 bytes of
spills) 8 fit, so 1,028 programs are one wave at twice the resident warps. Times each configuration as 20
calls in one CUDA graph (rotary + KV write inside, the merge launch included), at 256 and 64 rows, context
1024 and 2048, and checks each output against the default's. From the repository root with tools/device_env.sh
sourced:

    python3 docs/bench/decode_fusion/attn_occupancy_s21.py
"""

from __future__ import annotations

import functools

import torch

from graphrunner.attention.triton_attn import RopeKV, attention_launch_plan, paged_attention_triton
from graphrunner_tools.bench.attn_sweep import decode_batch, rope_inputs, time_graph
from graphrunner_tools.bench.roofline import measure_copy_bandwidth

CONFIGS = (
    {},
    {"maxnreg": 128},
    {"num_kv_splits": 2},
    {"num_kv_splits": 2, "maxnreg": 128},
    {"num_kv_splits": 2, "maxnreg": 128, "block_n": 32},
    {"num_kv_splits": 3, "maxnreg": 96},
    {"num_kv_splits": 4, "maxnreg": 128},
)


def main() -> None:
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; heads 14/2x64, rope inside")
    for rows in (256, 64):
        for context in (1024, 2048):
            q, cache, md, out = decode_batch(rows, context, 14, 2, 64)
            k, v, pos, cs = rope_inputs(q, md, context, 2)
            rope = RopeKV(k, v, pos, cs, md.slot_mapping)
            floor = 2 * rows * (context + 1) * 2 * 64 * 2 / bw * 1e6
            plan = attention_launch_plan(rows, rows, 14, 2, 64, q.device)
            ref = None
            line = []
            for kw in CONFIGS:
                call = functools.partial(paged_attention_triton, q, cache, md, 0.125, out, rope_kv=rope, **kw)
                try:
                    us = time_graph(call, 20)
                except Exception as e:  # a configuration that does not compile
                    line.append(f"{kw}: {type(e).__name__}")
                    continue
                got = out.clone()
                ref = got if ref is None else ref
                err = (got.float() - ref.float()).abs().max().item()
                line.append(f"{kw or 'plan'}: {us:.1f} us ({100 * floor / us:.0f}%, max|d| {err:.3f})")
            print(f"rows {rows} context {context}: floor {floor:.1f} us; plan splits {plan['num_kv_splits']}, "
                  f"block_n {plan['block_n']}, warps {plan['num_warps']}", flush=True)
            for item in line:
                print("   " + item, flush=True)
            del q, cache, md, out


if __name__ == "__main__":
    main()
