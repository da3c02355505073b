"""When each program of the decode attention launch starts and ends: where the launch's excess goes.

Issue #17: at 256 rows of qwen2.5-0.5b's heads (14/2 x 64), context 1024, the launch takes 54.7 µs on an
H100 against a 44.8 µs KV-read floor (42.6 against 31.4 on an H200), yet grows with context at ~98% of
the copy bandwidth. This copies `graphrunner/attention/triton_attn.py` of --tree into a temporary module
whose kernel also stores, per program, %globaltimer at its start and end and its %smid, runs the launch
(rotary + KV write inside, the plan's configuration) and prints: the spread of start times, percentiles
of end times, the number of programs running in each 2 µs bin (the ramp and the tail), and per SM the
number of programs against the last end. From the repository root with tools/device_env.sh sourced:

    python3 docs/bench/decode_fusion/attn_timeline_s22.py [--tree DIR] [--rows 256] [--context 1024]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys
import tempfile

import torch

from graphrunner_tools.bench.attn_sweep import decode_batch, rope_inputs, time_graph

_STAMP = ('tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, '
          'pack=1)')
ROW = 64  # per program: start, end, SM, then up to 61 iteration stamps
_SMID = 'tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)'


def patched_module(tree: pathlib.Path):
    """triton_attn.py of `tree` with a per-program timeline: returns (module, set_buffer)."""
    src = (tree / "graphrunner/attention/triton_attn.py").read_text()
    head = "    def _paged_attn_kernel(\n        q_ptr,\n"
    assert head in src, "kernel signature changed"
    src = src.replace(head, "    def _paged_attn_kernel(\n        timeline_ptr,\n        q_ptr,\n", 1)
    start = "        split = tl.program_id(2)\n        pdl_wait(GDC)\n"
    assert start in src
    src = src.replace(start, start + f"        t_start = {_STAMP}\n", 1)
    # The kernel ends with the search-grid branch's _attend_tile call; append the stores after it.
    end_marker = "    @triton.jit(do_not_specialize=['num_tokens'])\n    def _merge_splits_kernel("
    assert end_marker in src
    stores = (
        f"        t_end = {_STAMP}\n"
        f"        sm = {_SMID}\n"
        "        lin = (pid + tl.num_programs(0) * (kvh + tl.num_programs(1) * split)).to(tl.int64) * 3\n"
        "        tl.store(timeline_ptr + lin, t_start)\n"
        "        tl.store(timeline_ptr + lin + 1, t_end)\n"
        "        tl.store(timeline_ptr + lin + 2, sm.to(tl.int64))\n\n"
    )
    src = src.replace(end_marker, stores + end_marker, 1)
    call = "    _paged_attn_kernel[(num_programs, num_kv_heads, splits)](\n        q,\n"
    assert call in src
    src = src.replace(call, "    _paged_attn_kernel[(num_programs, num_kv_heads, splits)](\n        TIMELINE[0],\n"
                      "        q,\n", 1)
    # Per-iteration stamps: _attend_tile takes the buffer too and stamps each key-block iteration's start.
    src = src.replace("    def _attend_tile(\n", "    def _attend_tile(\n        timeline_ptr,\n", 1)
    for call in ("_attend_tile(\n                    tok0,", "_attend_tile(\n                q_start +"):
        first_arg = call.split("\n")[1].strip()
        src = src.replace(call, call.replace(first_arg, "timeline_ptr, " + first_arg, 1), 1)
    lin = ("(tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1)"
           " * tl.program_id(2))).to(tl.int64) * ROW")
    loop = "        for start in range(kv_lo, kv_end, BLOCK_N):\n"  # before session 22: every block in the loop
    origin = "kv_lo"
    if loop not in src:  # the first block peeled off: stamp it as iteration 0 where its compute starts
        loop = "        for start in range(first + BLOCK_N, kv_end, BLOCK_N):\n"
        origin = "first"
        peeled = "        m_i = tl.full([BLOCK_M], _NEG_BIG_C, tl.float32)\n"
        assert loop in src and peeled in src
        src = src.replace(peeled, f"        tl.store(timeline_ptr + {lin} + 3, {_STAMP})\n" + peeled, 1)
    src = src.replace(loop, loop + (
        f"            _it = (start - {origin}) // BLOCK_N\n"
        "            _lin = (tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1)"
        " * tl.program_id(2))).to(tl.int64) * ROW\n"
        f"            tl.store(timeline_ptr + _lin + 3 + _it, {_STAMP}, mask=_it < ROW - 3)\n"), 1)
    src = src.replace("tl.int64) * 3\n", "tl.int64) * ROW\n")
    imports = "if HAS_TRITON:\n    import triton\n    import triton.language as tl\n"
    src = src.replace(imports, imports + f"\n    ROW = tl.constexpr({ROW})\n", 1)
    src += "\nTIMELINE = [None]\n"
    path = pathlib.Path(tempfile.mkdtemp()) / "attn_timeline_kernel.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("attn_timeline_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attn_timeline_kernel"] = mod
    spec.loader.exec_module(mod)
    return mod


def pct(xs: torch.Tensor, q: float) -> float:
    return float(torch.quantile(xs.double(), q))


def report(name: str, tl_buf: torch.Tensor, floor_us: float, launch_us: float) -> None:
    t = tl_buf.view(-1, ROW).cpu()
    t0, t1, sm = t[:, 0], t[:, 1], t[:, 2]
    its = t[:, 3:]
    base = t0.min()
    s, e = (t0 - base).double() / 1e3, (t1 - base).double() / 1e3  # µs
    dur = e - s
    print(f"## {name}: {t.shape[0]} programs, launch {launch_us:.1f} µs in a graph, floor {floor_us:.1f} µs; "
          f"first start -> last end {float(e.max()):.1f} µs")
    print(f"  starts  p50 {pct(s, .5):.2f}  p90 {pct(s, .9):.2f}  max {float(s.max()):.2f} µs")
    print(f"  ends    min {float(e.min()):.1f}  p10 {pct(e, .1):.1f}  p50 {pct(e, .5):.1f}  p90 {pct(e, .9):.1f}  "
          f"max {float(e.max()):.1f} µs")
    print(f"  program durations min {float(dur.min()):.1f}  p50 {pct(dur, .5):.1f}  max {float(dur.max()):.1f} µs")
    bins = int(e.max() // 2) + 1
    running = [int(((s < 2 * (i + 1)) & (e > 2 * i)).sum()) for i in range(bins)]
    print("  running per 2 µs bin: " + " ".join(str(r) for r in running))
    per_sm: dict[int, list[float]] = {}
    for smid, end in zip(sm.tolist(), e.tolist(), strict=True):
        per_sm.setdefault(int(smid), []).append(end)
    by_count: dict[int, list[float]] = {}
    for ends in per_sm.values():
        by_count.setdefault(len(ends), []).append(max(ends))
    print(f"  SMs used {len(per_sm)}; programs per SM -> (SMs, mean / max of the SM's last end µs): "
          + ", ".join(f"{c}: ({len(v)}, {sum(v) / len(v):.1f} / {max(v):.1f})" for c, v in sorted(by_count.items())))
    real = its[:, 0] > 0  # programs that ran the key loop
    stamps = its[real]
    n_it = int((stamps > 0).sum(1).max())
    rel = (stamps[:, :n_it] - t0[real][:, None]).double() / 1e3
    line = " ".join(f"{i}:{pct(rel[:, i], .5):.1f}" for i in range(n_it))
    print(f"  median µs from program start to iteration i's start: {line}; end {pct(dur[real], .5):.1f}")
    print(f"  globaltimer distinct start values {len(set(t0.tolist()))}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", default=".", help="directory whose graphrunner/attention/triton_attn.py is timed")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--name", default="main")
    p.add_argument("--splits", type=int, default=None)
    p.add_argument("--maxnreg", type=int, default=None)
    p.add_argument("--layout", default="HND", choices=("HND", "NHD"), help="the cache's memory order (kv_shape.py)")
    args = p.parse_args()
    mod = patched_module(pathlib.Path(args.tree))
    from graphrunner_tools.bench.roofline import measure_copy_bandwidth

    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    q, cache, md, out = decode_batch(args.rows, args.context, 14, 2, 64)
    if args.layout == "HND":  # head-major storage, handed out as the same [2, blocks, block, heads, dim] view
        cache = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    k, v, pos, cs = rope_inputs(q, md, args.context, 2)
    rope = mod.RopeKV(k, v, pos, cs, md.slot_mapping)
    kw = {"rope_kv": rope}
    if args.splits:
        kw["num_kv_splits"] = args.splits
    if args.maxnreg:
        kw["maxnreg"] = args.maxnreg
    splits = args.splits or mod.attention_launch_plan(args.rows, args.rows, 14, 2, 64, q.device)["num_kv_splits"]
    progs = (args.rows + 1) * 2 * splits
    buf = torch.zeros(progs * ROW, dtype=torch.int64, device="cuda")
    mod.TIMELINE[0] = buf
    call = functools.partial(mod.paged_attention_triton, q, cache, md, 0.125, out, **kw)
    launch_us = time_graph(call, 20)
    floor = 2 * args.rows * (args.context + 1) * 2 * 64 * 2 / bw * 1e6
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; {args.rows} rows, context {args.context}, "
          f"tree {args.tree}, layout {args.layout}")
    for rep in range(3):
        # A cold-ish single launch after other work, as in the step: flush L2 with a 256 MB write first.
        torch.empty(256 << 20, dtype=torch.uint8, device="cuda").fill_(1)
        buf.zero_()
        call()
        torch.cuda.synchronize()
        report(f"{args.name} rep {rep}", buf, floor, launch_us)


if __name__ == "__main__":
    main()
