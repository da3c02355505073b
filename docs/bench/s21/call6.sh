#!/usr/bin/env bash
# Session 21, call 6 (kind nvidia-h200): Nsight Compute over the decode attention launch at 256 rows of
# qwen2.5-0.5b's heads, plain vs rotary + KV write inside (decode_fusion/attn_ncu_s21.py): occupancy,
# registers, DRAM throughput and warp stalls, to explain the launch's fixed cost (next session's attention work).
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
source tools/device_env.sh >/dev/null
timeout 240 ncu --kernel-name regex:_paged_attn_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight \
   --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
   --section MemoryWorkloadAnalysis python3 docs/bench/decode_fusion/attn_ncu_s21.py > "$OUT/attn_ncu.txt" 2>&1
echo "ncu rc=$? $((SECONDS-t0))s"; grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit|Stall|Warp Cycles Per Issued|Dynamic Shared|Static Shared" "$OUT/attn_ncu.txt" | head -60
