"""The fused mixture-of-experts kernels: routing, token-to-expert alignment, two grouped GEMMs and the top-k sum.

A MoE layer call is five launches, each with a grid that depends on the token count T and static
configuration only, never on the routing, so one CUDA-graph capture at T replays correctly for any
routing (no host synchronisation, no `.item()`, no data-dependent shape):

1. `route`: softmax over the experts (fp32), the top-k by iterative argmax-and-mask, optional
   renormalisation; one program per block of token rows.
2. alignment (`moe_align_block_size`, vLLM's name): the flat slots s = t * k + j grouped by local
   expert, each group padded to a multiple of BLOCK_M with the sentinel T * k, and the expert of
   every BLOCK_M block (-1 past the used blocks). One launch, deterministic, without atomics: each
   program counts every slot's expert (a histogram, cheap next to everything else), so it knows
   every group's start and its own chunk's offsets; it places its chunk's slots and writes the
   sentinels and block experts of its share of the blocks. Real rows and padding rows are
   disjoint, so no program overwrites another's stores and no fill has to precede the scatter.
3. gate|up GEMM: one program per (BLOCK_M block, BLOCK_N tile of I) gathers its rows of x, multiplies
   them with the gate tile and the matching up tile of its block's expert (two fp32 accumulators)
   and stores silu(gate) * up, per slot, in x's dtype.
4. down GEMM: the activation rows times w2[e]^T; the epilogue rounds each expert's output to x's
   dtype (as the reference does) and multiplies it by the slot's fp32 routing weight into a per-slot
   fp32 row.
5. the top-k sum: per token, the rows of its valid slots in slot order (fp32), cast to x's dtype.
   A fixed order instead of atomics keeps the result bitwise reproducible (graph replay is compared
   with eager); a slot whose expert is elsewhere (`expert_map` -1) is never read, so no buffer
   needs zeroing.

Blocks exist only for experts that received tokens, and programs of unused blocks exit before any
load: the GEMMs read the weights of the active experts only, which is what bounds batch-1 decode
(Qwen3-30B-A3B: 8 of 128 experts, ~75 MB of bf16 weights a layer). `fused_moe` makes launches 2-5;
`route` is a call of its own because a model may route differently.

`MoEWorkspace` holds the buffers of launches 2-5 (sorted slots, block experts, the padded count,
the activation, the per-slot rows) at a maximum token count: every layer of a step reuses it
(layers run one after another) and every graph slices it by T, so graphs do not each allocate their
own. `moe_config` picks the tiles, a plain function of the shapes.

Weight layout (as `reference.py`): w13 [E_local, 2I, H] (rows [0, I) gate, [I, 2I) up), w2
[E_local, H, I]. A slot is valid when its expert, through `expert_map` if given, is a local index in
[0, E_local); invalid slots contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor
from graphrunner.kernels.pdl import pdl_launch

__all__ = [
    "MOE_DTYPES",
    "GemmTile",
    "MoETiles",
    "MoEWorkspace",
    "fused_moe",
    "fused_moe_available",
    "max_padded_slots",
    "moe_align_block_size",
    "moe_config",
    "route",
]

MOE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_EXPERTS = 256  # route and alignment keep one row of experts in registers (BLOCK_E)
MAX_TOP_K = 8
_BLOCK_M_CHOICES = (16, 32, 64, 128)
# Two programs per SM of a 132-SM Hopper part (H100 SXM, H200): the decode GEMMs pick the widest N
# tile that still gives each SM about two programs streaming weights, so every SM has loads in flight.
_TARGET_PROGRAMS = 256
# Shared memory a GEMM's pipeline stages may take, so that two programs fit one SM (227 KiB each).
_STAGE_BUDGET_BYTES = 96 * 1024
# Slots placed per alignment program; with 8 warps its [CHUNK, E] one-hot selections stay at <= 64
# registers a thread for 256 experts.
_ALIGN_CHUNK = 64
_ALIGN_WARPS = 8
_ALIGN_SCAN = 1024  # slots per histogram step of the counting pass
_ALIGN_BLOCKS = 32  # blocks per step of the block pass
_ROUTE_ELEMENTS = 4096  # logits per routing program (rows x experts)
_SUM_BLOCK_H = 256


@dataclass(frozen=True)
class GemmTile:
    """One grouped GEMM's tile along N and K and its launch parameters."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoETiles:
    """The tiles of one `fused_moe` call. `block_m` is shared by the alignment and both GEMMs (the
    sorted layout is padded to it); `group_m` blocks share an N sweep for L2 reuse of weight tiles."""

    block_m: int
    group_m: int
    gate_up: GemmTile
    down: GemmTile


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moe_config(num_tokens: int, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
               element_size: int = 2) -> MoETiles:
    """The tiles of `fused_moe` for T tokens, H, I, E_local experts and k, with `element_size`-byte operands.

    - BLOCK_M: the smallest of 16, 32, 64, 128 that holds an expert's average share of the T * k
      slots. Decode (T * k <= E) gets 16, the smallest MMA row count: an active expert with one or
      two slots pads at most 15 rows, and each weight tile is read once per block anyway.
    - BLOCK_N: the widest tile that still gives about `_TARGET_PROGRAMS` programs over the blocks that
      will be active (min(T * k, E) at least), from 16 up to 32 for gate|up (two accumulators: 64
      columns of w13) and 64 for down at BLOCK_M <= 32, twice that above: at batch 1 the GEMMs are a
      pure read of 8 experts' weights (Qwen3-30B-A3B), and thin tiles spread that read over every SM.
      Qwen3-30B-A3B at T = 1: gate|up 8 x 48 programs of 16 columns (each of gate and up), down 8 x 32
      of 64; Mixtral (H = 4096, I = 14336, k = 2) at T = 1: gate|up 2 x 448 of 32, down 2 x 128 of 32.
    - BLOCK_K 128 at BLOCK_M <= 32 (long contiguous weight reads per row), 64 above (register room for
      the larger accumulators); num_stages as many as `_STAGE_BUDGET_BYTES` allows, 2 to 4.
    - GROUP_M 8 once blocks repeat an expert (BLOCK_M >= 64), so concurrent programs share weight tiles
      in L2; 1 at decode, where the N tiles of one block run side by side.
    Tile sizes never exceed the next power of two of the dimension (tiny test shapes), nor drop below 16
    (the MMA minimum)."""
    slots = num_tokens * top_k
    per_expert = slots / max(1, num_experts)
    block_m = next((m for m in _BLOCK_M_CHOICES if per_expert <= m), _BLOCK_M_CHOICES[-1])
    blocks = max(min(slots, num_experts), _cdiv(slots, block_m))
    small = block_m <= 32
    block_k = 128 if small else 64
    warps = 8 if block_m >= 128 else 4

    def tile(n: int, k: int, widest: int, b_tiles: int) -> GemmTile:
        widths = [w for w in (128, 64, 32, 16) if w <= widest]
        block_n = next((w for w in widths if blocks * _cdiv(n, w) >= _TARGET_PROGRAMS), widths[-1])
        block_n = max(16, min(block_n, _next_pow2(n)))
        bk = max(16, min(block_k, _next_pow2(k)))
        stage_bytes = (block_m + b_tiles * block_n) * bk * element_size
        stages = max(2, min(4, _STAGE_BUDGET_BYTES // stage_bytes))
        return GemmTile(block_n, bk, warps, stages)

    return MoETiles(
        block_m=block_m,
        group_m=1 if small else 8,
        gate_up=tile(intermediate_size, hidden_size, 32 if small else 64, 2),
        down=tile(hidden_size, intermediate_size, 64 if small else 128, 1),
    )


def max_padded_slots(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Length of the sorted-slot buffer: T * k slots plus fewer than BLOCK_M padding rows for each
    expert that can be active (at most min(T * k, E_local)), rounded up to whole blocks."""
    slots = num_tokens * top_k
    return _cdiv(slots + min(slots, num_experts) * (block_m - 1), block_m) * block_m


def fused_moe_available(device: torch.device | str) -> bool:
    """True when the Triton kernels of this module serve tensors on `device` (CUDA, with triton)."""
    return HAS_TRITON and torch.device(device).type == "cuda"


class MoEWorkspace:
    """The persistent buffers of `fused_moe` for up to `max_num_tokens` tokens.

    One workspace serves every MoE layer of a model (they run one after another) and every captured
    graph (each slices it by its T), so graphs share these buffers instead of each allocating its own:
    sorted slots and block experts (int32, sized for the largest BLOCK_M any T may pick), the padded
    count [1], the activation [T * k, I] in the model dtype and the per-slot rows [T * k, H] in fp32.
    Allocate it before capture (DESIGN §4: a graph never reads a tensor created after its capture)."""

    def __init__(self, max_num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                 intermediate_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens={max_num_tokens} must be >= 1")
        if not 1 <= top_k <= MAX_TOP_K:  # not bounded by the local experts: the others may be elsewhere
            raise ValueError(f"top_k={top_k} must be in [1, {MAX_TOP_K}]")
        if dtype not in MOE_DTYPES:
            raise ValueError(f"dtype {dtype} must be one of {MOE_DTYPES}")
        self.max_num_tokens, self.top_k, self.num_experts = max_num_tokens, top_k, num_experts
        self.hidden_size, self.intermediate_size, self.dtype = hidden_size, intermediate_size, dtype
        padded = max(max_padded_slots(max_num_tokens, top_k, num_experts, m) for m in _BLOCK_M_CHOICES)
        blocks = max(max_padded_slots(max_num_tokens, top_k, num_experts, m) // m for m in _BLOCK_M_CHOICES)
        slots = max_num_tokens * top_k
        self.sorted_slots = torch.empty(padded, dtype=torch.int32, device=device)
        self.device = self.sorted_slots.device  # resolved ("cuda" -> "cuda:0"), as the inputs' devices read
        self.block_experts = torch.empty(blocks, dtype=torch.int32, device=self.device)
        self.num_padded = torch.empty(1, dtype=torch.int32, device=self.device)
        self.activation = torch.empty(slots, intermediate_size, dtype=dtype, device=self.device)
        self.slot_out = torch.empty(slots, hidden_size, dtype=torch.float32, device=self.device)

    def check(self, num_tokens: int, top_k: int, num_experts: int, hidden_size: int, intermediate_size: int,
              dtype: torch.dtype, device: torch.device) -> None:
        """Raise ValueError unless a call with these shapes fits this workspace."""
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"num_tokens={num_tokens} exceeds the workspace's max_num_tokens={self.max_num_tokens}")
        got = (top_k, num_experts, hidden_size, intermediate_size, dtype, device)
        want = (self.top_k, self.num_experts, self.hidden_size, self.intermediate_size, self.dtype, self.device)
        if got != want:
            raise ValueError(f"(top_k, num_experts, hidden, intermediate, dtype, device) = {got} does not match "
                             f"the workspace's {want}")

    def views(self, num_tokens: int, block_m: int) -> tuple[torch.Tensor, ...]:
        """(sorted slots, block experts, padded count, activation, per-slot rows) for T tokens."""
        padded = max_padded_slots(num_tokens, self.top_k, self.num_experts, block_m)
        slots = num_tokens * self.top_k
        return (self.sorted_slots[:padded], self.block_experts[:padded // block_m], self.num_padded,
                self.activation[:slots], self.slot_out[:slots])


if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.kernels.pdl import pdl_wait

    @triton.jit
    def _moe_route_kernel(logits_ptr, stride_t, weights_ptr, ids_ptr, T, E, TOP_K: tl.constexpr,
                      RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, GDC: tl.constexpr):
        # Rows [pid * BLOCK_T, +BLOCK_T): softmax in fp32, then TOP_K rounds of take-the-max-and-mask.
        pdl_wait(GDC)  # launched with PDL: wait for the kernels before (graphrunner.kernels.pdl)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        r_ok, c_ok = rows < T, cols < E
        x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
                    mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        x = tl.where(c_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        p = tl.where(c_ok[None, :], p, -1.0)  # probabilities are >= 0: the padding columns never win
        ks = tl.arange(0, BLOCK_K)
        weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=1)
            # The lowest index among the maxima, explicitly (not argmax's choice), so ties are the
            # documented rule on every backend; clamped so NaN logits still give an in-range id.
            idx = tl.minimum(tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1), E - 1)
            weights = tl.where(ks[None, :] == j, best[:, None], weights)
            ids = tl.where(ks[None, :] == j, idx[:, None], ids)
            p = tl.where(cols[None, :] == idx[:, None], -1.0, p)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=1)[:, None]  # the unused columns hold 0
        out = rows[:, None] * TOP_K + ks[None, :]
        ok = r_ok[:, None] & (ks[None, :] < TOP_K)
        tl.store(weights_ptr + out, weights, mask=ok)
        tl.store(ids_ptr + out, ids, mask=ok)

    @triton.jit
    def _local_expert(ids_ptr, map_ptr, slots, num_slots, num_global, num_local, HAS_MAP: tl.constexpr):
        # The local expert of each slot, -1 where the slot is invalid (past the end, expert elsewhere).
        e = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1)
        if HAS_MAP:
            e = tl.load(map_ptr + e, mask=(e >= 0) & (e < num_global), other=-1)
        return tl.where((e >= 0) & (e < num_local), e, -1)

    @triton.jit
    def _moe_align_kernel(ids_ptr, map_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, num_slots, num_global,
                      num_local, num_blocks, blocks_per_program, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SCAN: tl.constexpr, BLOCKS: tl.constexpr,
                      GDC: tl.constexpr):
        pdl_wait(GDC)
        pid = tl.program_id(0)
        first = pid * CHUNK  # this program's slots: [first, first + CHUNK)
        experts = tl.arange(0, BLOCK_E)
        # Every expert's slot count, and how many of its slots come before this chunk.
        counts = tl.zeros([BLOCK_E], tl.int32)
        before = tl.zeros([BLOCK_E], tl.int32)
        for s0 in range(0, num_slots, SCAN):
            s = s0 + tl.arange(0, SCAN)
            e = _local_expert(ids_ptr, map_ptr, s, num_slots, num_global, num_local, HAS_MAP)
            valid = e >= 0
            e = tl.where(valid, e, 0)
            counts += tl.histogram(e, BLOCK_E, mask=valid)
            before += tl.histogram(e, BLOCK_E, mask=valid & (s < first))
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        total = tl.sum(padded, axis=0)
        tl.store(num_padded_ptr, total, mask=pid == 0)

        # This chunk's slots go to start[e] + (earlier slots of e): ascending slot order within an expert.
        lane = tl.arange(0, CHUNK)
        s = first + lane
        e = _local_expert(ids_ptr, map_ptr, s, num_slots, num_global, num_local, HAS_MAP)
        earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.sum(tl.where(e[:, None] == experts[None, :], (starts + before)[None, :], 0), axis=1)
        tl.store(sorted_ptr + base + rank, s, mask=e >= 0)

        # This program's share of the blocks: each block's expert (-1 past the used ones) and the
        # sentinel in its rows that no slot takes. Groups start at multiples of BLOCK_M, so a block
        # lies inside one expert's group: e = the number of groups that end at or before it.
        rows = tl.arange(0, BLOCK_M)
        for i0 in range(0, blocks_per_program, BLOCKS):
            i = i0 + tl.arange(0, BLOCKS)
            b = pid * blocks_per_program + i
            b_ok = (i < blocks_per_program) & (b < num_blocks)
            pos = b * BLOCK_M
            eb = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), axis=1)
            in_group = experts[None, :] == eb[:, None]
            taken = tl.sum(tl.where(in_group, (starts + counts)[None, :], 0), axis=1) - pos  # slots in the block
            tl.store(block_experts_ptr + b, tl.where(pos < total, eb, -1), mask=b_ok)
            pad = rows[None, :] >= taken[:, None]
            tl.store(sorted_ptr + pos[:, None] + rows[None, :], num_slots, mask=b_ok[:, None] & pad)

    @triton.jit
    def _block_of(pid, num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # (block, N tile) of program pid: GROUP_M blocks sweep N together (L2 reuse of weight tiles);
        # with GROUP_M = 1 a block's N tiles are consecutive programs.
        num_n = tl.cdiv(N, BLOCK_N)
        if GROUP_M == 1:
            return pid // num_n, pid % num_n
        group = pid // (GROUP_M * num_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
        pid_n = (pid % (GROUP_M * num_n)) // size_m
        return pid_m, pid_n

    @triton.jit
    def _moe_gate_up_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, sorted_ptr, block_experts_ptr, num_slots, num_blocks,
                        inter, H, stride_xt, stride_we, stride_wn, stride_wk, stride_wse, stride_as,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FP8_W: tl.constexpr,
                        GDC: tl.constexpr):
        # The expert of a block is data (the alignment's output), so no weight can load before the wait.
        pdl_wait(GDC)
        pid_m, pid_n = _block_of(tl.program_id(0), num_blocks, inter, BLOCK_N, GROUP_M)
        expert = tl.load(block_experts_ptr + pid_m)
        if expert < 0:  # past the used blocks: no weight is read
            return
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        live = slots < num_slots  # padding rows: masked, no bytes read (the mask is constant along K)
        tokens = (slots // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Columns past I wrap to valid rows of w13 (dropped at the store), so weight loads need no mask.
        w_rows = (cols % inter).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :]
        g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + ks[:, None] * stride_wk
        u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                k_ok = ks < H - k0
                a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=k_ok[:, None], other=0)
                u = tl.load(u_ptrs, mask=k_ok[:, None], other=0)
            if FP8_W:  # e4m3 codes (uint8) -> x's dtype, exactly; the row scales apply after the dots
                g = g.to(tl.float8e4nv, bitcast=True).to(x_ptr.dtype.element_ty)
                u = u.to(tl.float8e4nv, bitcast=True).to(x_ptr.dtype.element_ty)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        if FP8_W:
            scales = ws_ptr + expert.to(tl.int64) * stride_wse + w_rows
            acc_g = acc_g * tl.load(scales)[None, :]
            acc_u = acc_u * tl.load(scales + inter)[None, :]
        act = acc_g * tl.sigmoid(acc_g) * acc_u  # fp32, one rounding at the store
        out = act_ptr + slots.to(tl.int64)[:, None] * stride_as + cols[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < inter))

    @triton.jit
    def _moe_down_kernel(act_ptr, w_ptr, ws_ptr, topk_weights_ptr, out_ptr, sorted_ptr, block_experts_ptr,
                     num_slots, num_blocks, H, inter, stride_as, stride_we, stride_wn, stride_wk, stride_wse,
                     stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FP8_W: tl.constexpr,
                     GDC: tl.constexpr):
        pdl_wait(GDC)
        pid_m, pid_n = _block_of(tl.program_id(0), num_blocks, H, BLOCK_N, GROUP_M)
        expert = tl.load(block_experts_ptr + pid_m)
        if expert < 0:
            return
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        live = slots < num_slots
        rows = slots.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + rows[:, None] * stride_as + ks[None, :]
        b_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + (cols % H).to(tl.int64)[None, :] * stride_wn
                  + ks[:, None] * stride_wk)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_ok = ks < inter - k0
                a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0)
            if FP8_W:
                b = b.to(tl.float8e4nv, bitcast=True).to(act_ptr.dtype.element_ty)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wk
        if FP8_W:
            acc = acc * tl.load(ws_ptr + expert.to(tl.int64) * stride_wse + cols % H)[None, :]
        # Each expert's output rounded to the model dtype before it is weighted, as the reference.
        y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * tl.load(topk_weights_ptr + rows, mask=live)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_os + cols[None, :], y, mask=live[:, None] & (cols[None, :] < H))

    @triton.jit
    def _moe_sum_kernel(slot_out_ptr, ids_ptr, map_ptr, out_ptr, T, H, num_global, num_local, stride_os, stride_ot,
                    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                    GDC: tl.constexpr):
        pdl_wait(GDC)
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        t_ok, c_ok = tokens < T, cols < H
        acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
        for j in tl.static_range(TOP_K):  # slot order: the same sum on every call
            slots = tokens * TOP_K + j
            valid = _local_expert(ids_ptr, map_ptr, slots, T * TOP_K, num_global, num_local, HAS_MAP) >= 0
            rows = slot_out_ptr + slots.to(tl.int64)[:, None] * stride_os + cols[None, :]
            acc += tl.load(rows, mask=valid[:, None] & c_ok[None, :], other=0.0)
        out = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


def _require_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton, which failed to import; use graphrunner.layers.moe.reference")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype, unit stride along E) -> (weights [T, k] fp32, ids [T, k] int32).

    `route_reference` in one launch: softmax over the experts in fp32, the k largest probabilities in
    descending order, renormalised to sum 1 when `renormalize`. Ties go to the lowest expert index
    (torch.topk agrees wherever the probabilities are distinct). NaN logits give an unspecified
    routing with ids still in [0, E). `pdl_rows`: the largest token count launched with PDL
    (`graphrunner.kernels.pdl`; 0: none)."""
    _require_triton("route")
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits {tuple(router_logits.shape)} (strides {router_logits.stride()}) "
                         "must be [T, E] with unit stride along E")
    num_tokens, num_experts = router_logits.shape
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts} must be <= {MAX_EXPERTS}")
    if not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        raise ValueError(f"top_k={top_k} must be in [1, min({MAX_TOP_K}, num_experts={num_experts})]")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens:
        block_e = _next_pow2(num_experts)
        block_t = min(_next_pow2(num_tokens), max(1, _ROUTE_ELEMENTS // block_e))
        launch = pdl_launch(num_tokens, pdl_rows)
        _moe_route_kernel[(_cdiv(num_tokens, block_t),)](
            router_logits, router_logits.stride(0), weights, ids, num_tokens, num_experts, TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=_next_pow2(top_k),
            GDC=bool(launch), num_warps=4, **launch)
    return weights, ids


def _check_routing(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype} must be a contiguous [T, k] int32 tensor")
    if not 1 <= topk_ids.shape[1] <= MAX_TOP_K:
        raise ValueError(f"top_k={topk_ids.shape[1]} must be in [1, {MAX_TOP_K}]")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype != torch.int32
                                   or not expert_map.is_contiguous()):
        raise ValueError(f"expert_map {tuple(expert_map.shape)} {expert_map.dtype} must be a contiguous "
                         "[E_global] int32 tensor")


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         expert_map: torch.Tensor | None = None, *,
                         out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pdl_rows: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 (global ids) -> (sorted_slots, block_experts, num_padded), one launch.

    sorted_slots [max_padded_slots(T, k, E_local, block_m)] int32: the valid slots t * k + j grouped by
    local expert (ascending expert, ascending slot within one), each group padded with the sentinel
    T * k to a multiple of `block_m`, the sentinel also after the last group. block_experts
    [len(sorted_slots) // block_m] int32: each block's local expert, -1 from num_padded on.
    num_padded [1] int32 (vLLM's num_tokens_post_padded): the sum of the padded group sizes. A slot
    is dropped when its expert maps to -1 in `expert_map` ([E_global] int32) or is not in
    [0, num_experts). Every element of the three outputs is written, so `out` (preallocated views of
    these sizes) may hold anything before."""
    _require_triton("moe_align_block_size")
    _check_routing(topk_ids, expert_map)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts} must be in [1, {MAX_EXPERTS}]")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= 16")
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    padded = max_padded_slots(num_tokens, top_k, num_experts, block_m)
    num_blocks = padded // block_m
    device = topk_ids.device
    if out is None:
        out = (torch.empty(padded, dtype=torch.int32, device=device),
               torch.empty(num_blocks, dtype=torch.int32, device=device),
               torch.empty(1, dtype=torch.int32, device=device))
    sorted_slots, block_experts, num_padded = out
    check_tensor("sorted_slots", sorted_slots, (padded,), (torch.int32,))
    check_tensor("block_experts", block_experts, (num_blocks,), (torch.int32,))
    check_tensor("num_padded", num_padded, (1,), (torch.int32,))
    if num_slots == 0:
        num_padded.zero_()
        return out
    programs = _cdiv(num_slots, _ALIGN_CHUNK)
    launch = pdl_launch(num_tokens, pdl_rows)
    _moe_align_kernel[(programs,)](
        topk_ids, expert_map if expert_map is not None else topk_ids, sorted_slots, block_experts, num_padded,
        num_slots, expert_map.shape[0] if expert_map is not None else num_experts, num_experts, num_blocks,
        _cdiv(num_blocks, programs), HAS_MAP=expert_map is not None, BLOCK_M=block_m,
        BLOCK_E=max(16, _next_pow2(num_experts)), CHUNK=_ALIGN_CHUNK, SCAN=_ALIGN_SCAN, BLOCKS=_ALIGN_BLOCKS,
        GDC=bool(launch), num_warps=_ALIGN_WARPS, **launch)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
              workspace: MoEWorkspace | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, pdl_rows: int = 0) -> torch.Tensor:
    """`fused_moe_reference` in four launches (alignment, gate|up, down, top-k sum): x [T, H] -> [T, H].

    w13 [E_local, 2I, H], w2 [E_local, H, I] in x's dtype (bf16, fp16, fp32); topk_weights [T, k] fp32 and
    topk_ids [T, k] int32 (global ids, contiguous; `route` gives both); expert_map [E_global] int32 or
    None. fp32 accumulation; each expert's output is rounded to x's dtype, weighted and summed in fp32,
    rounded once. Graph-safe at every T: the launches' grids depend on T and the shapes only. Bitwise
    deterministic. `workspace` (`MoEWorkspace`) holds the intermediates; None allocates them (tests).

    fp8 experts (weight-only): w13 / w2 in float8_e4m3fn with per-output-row fp32 scales w13_scale
    [E_local, 2I] and w2_scale [E_local, H]; each tile's codes convert exactly to x's dtype on load
    and the row scales multiply the fp32 accumulators (`fused_moe_reference` with the scales).

    `pdl_rows`: up to that many tokens the four launches use programmatic dependent launch
    (`graphrunner.kernels.pdl`): each starts while the one before drains and waits for it before
    reading anything, so a batch-1 layer's chain of small kernels does not pay each launch in full."""
    _require_triton("fused_moe")
    _check_routing(topk_ids, expert_map)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    check_tensor("x", x, (num_tokens, hidden), MOE_DTYPES)
    fp8 = w13.dtype == torch.float8_e4m3fn
    weight_dtype = torch.float8_e4m3fn if fp8 else x.dtype
    check_tensor("w13", w13, (num_experts, 2 * inter, hidden), (weight_dtype,))
    check_tensor("w2", w2, (num_experts, hidden, inter), (weight_dtype,))
    if fp8 != (w13_scale is not None) or fp8 != (w2_scale is not None):
        raise ValueError(f"fp8 experts need w13_scale and w2_scale, other weights neither (w13 {w13.dtype}, "
                         f"w13_scale {None if w13_scale is None else tuple(w13_scale.shape)}, w2_scale "
                         f"{None if w2_scale is None else tuple(w2_scale.shape)})")
    if w13_scale is not None and w2_scale is not None:
        check_tensor("w13_scale", w13_scale, (num_experts, 2 * inter), (torch.float32,))
        check_tensor("w2_scale", w2_scale, (num_experts, hidden), (torch.float32,))
        if w13_scale.stride(1) != 1 or w2_scale.stride(1) != 1:
            raise ValueError("w13_scale and w2_scale must have unit stride along their rows")
    check_tensor("topk_ids", topk_ids, (num_tokens, top_k), (torch.int32,))
    check_tensor("topk_weights", topk_weights, (num_tokens, top_k), (torch.float32,))
    if not topk_weights.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"topk_weights (strides {topk_weights.stride()}) must be contiguous and x (strides "
                         f"{x.stride()}) have unit stride along H")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts} (local) must be in [1, {MAX_EXPERTS}]")
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    config = moe_config(num_tokens, hidden, inter, num_experts, top_k, element_size=x.element_size())
    if workspace is None:
        workspace = MoEWorkspace(num_tokens, top_k, num_experts, hidden, inter, x.dtype, x.device)
    workspace.check(num_tokens, top_k, num_experts, hidden, inter, x.dtype, x.device)
    sorted_slots, block_experts, num_padded, act, slot_out = workspace.views(num_tokens, config.block_m)
    moe_align_block_size(topk_ids, num_experts, config.block_m, expert_map,
                         out=(sorted_slots, block_experts, num_padded), pdl_rows=pdl_rows)
    launch = pdl_launch(num_tokens, pdl_rows)
    gdc = bool(launch)

    num_slots, num_blocks = num_tokens * top_k, block_experts.shape[0]
    bm, gm = config.block_m, config.group_m
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models multiply in fp32, not TF32
    t = config.gate_up
    # fp8 weights travel as their uint8 codes (bitcast in the kernels); unused scale arguments point at x.
    w13_k, w2_k = (w13.view(torch.uint8), w2.view(torch.uint8)) if fp8 else (w13, w2)
    s13 = w13_scale if w13_scale is not None else x
    s2 = w2_scale if w2_scale is not None else x
    _moe_gate_up_kernel[(num_blocks * _cdiv(inter, t.block_n),)](
        x, w13_k, s13, act, sorted_slots, block_experts, num_slots, num_blocks, inter, hidden, x.stride(0),
        w13.stride(0), w13.stride(1), w13.stride(2), s13.stride(0) if fp8 else 0, act.stride(0), TOP_K=top_k,
        BLOCK_M=bm, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=gm, EVEN_K=hidden % t.block_k == 0,
        PRECISION=precision, FP8_W=fp8, GDC=gdc, num_warps=t.num_warps, num_stages=t.num_stages, **launch)
    t = config.down
    _moe_down_kernel[(num_blocks * _cdiv(hidden, t.block_n),)](
        act, w2_k, s2, topk_weights, slot_out, sorted_slots, block_experts, num_slots, num_blocks, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), s2.stride(0) if fp8 else 0, slot_out.stride(0),
        BLOCK_M=bm, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=gm, EVEN_K=inter % t.block_k == 0,
        PRECISION=precision, FP8_W=fp8, GDC=gdc, num_warps=t.num_warps, num_stages=t.num_stages, **launch)
    block_h = min(_SUM_BLOCK_H, _next_pow2(hidden))
    block_t = min(_next_pow2(num_tokens), max(1, 2048 // block_h))
    _moe_sum_kernel[(_cdiv(num_tokens, block_t), _cdiv(hidden, block_h))](
        slot_out, topk_ids, expert_map if expert_map is not None else topk_ids, out, num_tokens, hidden,
        expert_map.shape[0] if expert_map is not None else num_experts, num_experts, slot_out.stride(0),
        out.stride(0), TOP_K=top_k, HAS_MAP=expert_map is not None, BLOCK_T=block_t, BLOCK_H=block_h, GDC=gdc,
        num_warps=4, **launch)
    return out
