"""`FusedMoE`: the sparse MLP of a mixture-of-experts decoder layer.

    x ─▶ router (replicated [E, H] GEMM) ─▶ route: softmax, top-k, optional renormalisation
      ─▶ experts: sum over the chosen experts of weight * down(silu(gate(x)) * up(x))
      (+ sigmoid(shared_gate(x)) * shared_expert(x), Qwen2-MoE)
      ─▶ one all-reduce over the TP group (TP or EP), inside the graph like a dense layer's

Parallelism over the TP group of size P:

  tensor parallel (default)   every rank holds every expert, with 1/P of its intermediate
                              dimension (gate/up rows, down columns); partial sums all-reduced.
  expert parallel             (`TPComm.expert_parallel`, vLLM's `enable_expert_parallel`) rank r
                              holds experts [r E/P, (r+1) E/P) whole. The activations entering
                              the layer are already replicated over the TP group, so a rank
                              picks its own experts' slots locally (`expert_map`, no dispatch
                              collective) and the combine is the same all-reduce of partial sums:
                              one collective per layer whatever the batch, with static sizes, so
                              it is captured in FULL graphs.

Data parallel attention with expert parallelism (`TPComm.dp`, vLLM's `data_parallel_size` with
`enable_expert_parallel`): the experts are partitioned over all D x T ranks, rank (d, t) holding
physical slots [(d T + t) P / (D T), ...). Every DP replica runs the same padded token count each
step (lockstep DP), so a layer all-gathers its input over the DP group ([T, H] -> [D T, H]),
computes its experts' partial outputs for every replica's tokens, reduce-scatters them back
([D T, H] -> [T, H]) and all-reduces over TP as above: three fixed-size collectives, captured.

EPLB: P = E + R physical slots; a logical expert's replicas are bit-identical copies, and token n
takes replica n mod count (`to_physical`), so the placement never changes a token.

The expert computation is chosen once, by device: the Triton kernels of `kernels.py` on CUDA
(routing, alignment, two grouped GEMMs and the top-k sum: five launches, reading only the experts
that received tokens), the torch reference elsewhere. Eagerly and inside FULL graph capture the
kernels run over the model's shared `MoEWorkspace` (`allocate_workspace`); under torch.compile
(op mode, PIECEWISE) they run inside the opaque custom op `graphrunner::fused_moe`, whose
buffers come from the piece's graph pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.config import KernelConfig, ModelConfig
from graphrunner.distributed.comm import TPComm
from graphrunner.kernels.device import device_properties
from graphrunner.kernels.pdl import pdl_max_rows
from graphrunner.layers.linear import MergedColumnLinear, RowLinear
from graphrunner.layers.moe import kernels
from graphrunner.layers.moe.reference import fused_moe_reference, route_reference

# Per-expert checkpoint tensors: (param, part) -> shard id of `load_shard`.
GATE, UP, DOWN = "gate", "up", "down"


def _partial(x: torch.Tensor) -> torch.Tensor:
    """The shared expert's down projection stays a partial sum: it is reduced together with the
    routed experts' partial output, in the layer's one all-reduce."""
    return x


@torch.library.custom_op("graphrunner::fused_moe", mutates_args=())
def fused_moe_op(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 expert_map: torch.Tensor | None, top_k: int, renormalize: bool, w13_scale: torch.Tensor | None,
                 w2_scale: torch.Tensor | None, pdl_rows: int) -> torch.Tensor:
    """Routing and the routed experts (`kernels.route`, `kernels.fused_moe`) as one op that
    torch.compile does not look into: its grids and tiles depend on the token count, which a
    compiled piece knows only at run time."""
    weights, ids = kernels.route(router_logits, top_k, renormalize, pdl_rows)
    return kernels.fused_moe(x, w13, w2, weights, ids, expert_map, w13_scale=w13_scale, w2_scale=w2_scale,
                             pdl_rows=pdl_rows)


@fused_moe_op.register_fake
def _fused_moe_fake(x, router_logits, w13, w2, expert_map, top_k, renormalize, w13_scale, w2_scale,
                    pdl_rows) -> torch.Tensor:
    return torch.empty_like(x)


def placement_tables(physical_to_logical: list[int], num_experts: int,
                     num_redundant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy [E, R + 1] int32, the physical slots of each logical expert in slot order, -1 beyond
    its replicas; replica_count [E] int32) of a placement given as each physical slot's logical expert."""
    slots: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(physical_to_logical):
        slots[e].append(p)
    empty = [e for e, s in enumerate(slots) if not s]
    if empty or len(physical_to_logical) != num_experts + num_redundant:
        raise ValueError(f"a placement of {len(physical_to_logical)} slots must give each of {num_experts} experts "
                         f"at least one of {num_experts + num_redundant} slots; experts without one: {empty}")
    table = [s + [-1] * (num_redundant + 1 - len(s)) for s in slots]
    return torch.tensor(table, dtype=torch.int32), torch.tensor([len(s) for s in slots], dtype=torch.int32)


def to_physical(ids: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor,
                load: torch.Tensor) -> torch.Tensor:
    """Logical expert ids [N, k] -> physical slots [N, k] int32, token n taking replica n mod the
    expert's replica count (deterministic, static shapes, no host sync); adds each slot's tokens
    to `load` [P]. Replicas are bit-identical copies, so the choice does not change the output."""
    logical = ids.long()
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)  # [N, 1]
    replica = rows % replica_count.long()[logical]  # [N, k]
    physical = log2phy.long()[logical, replica]
    load.index_add_(0, physical.flatten(), torch.ones_like(physical.flatten()))
    return physical.to(torch.int32)


@torch.library.custom_op("graphrunner::fused_moe_placed", mutates_args=("expert_load",))
def fused_moe_placed_op(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        expert_map: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor,
                        expert_load: torch.Tensor, top_k: int, renormalize: bool, pdl_rows: int) -> torch.Tensor:
    """`graphrunner::fused_moe` through an EPLB placement (`to_physical`), counting the load."""
    weights, ids = kernels.route(router_logits, top_k, renormalize, pdl_rows)
    ids = to_physical(ids, log2phy, replica_count, expert_load)
    return kernels.fused_moe(x, w13, w2, weights, ids, expert_map, pdl_rows=pdl_rows)


@fused_moe_placed_op.register_fake
def _fused_moe_placed_fake(x, router_logits, w13, w2, expert_map, log2phy, replica_count, expert_load, top_k,
                           renormalize, pdl_rows) -> torch.Tensor:
    return torch.empty_like(x)


class FusedMoE(nn.Module):
    """Router, routed experts and optional shared expert of one sparse layer.

    Parameters: `gate.weight` [E, H] (the router), `w13` [E_local, 2 I_local, H] (gate rows, then
    up rows), `w2` [E_local, H, I_local], and with a shared expert `shared_gate_up`, `shared_down`
    and `shared_expert_gate.weight` [1, H]. `expert_map` (a buffer, expert parallel only) maps a
    physical expert slot to its local index, -1 when another rank holds it. Without EPLB physical
    slot e holds logical expert e; with it (`num_redundant_experts`, `record_expert_load` of the
    TPComm) `log2phy`, `replica_count` and `expert_load` (buffers, rewritten in place by
    `graphrunner.distributed.eplb`) route each token to one replica and count the load.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device,
        tp: TPComm | None = None,
        kernel: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.name}: FusedMoE needs a config with experts (ModelConfig.moe)")
        tp = tp or TPComm()
        self.tp = tp
        h, num_experts, inter = config.hidden_size, moe.num_experts, moe.moe_intermediate_size
        self.hidden_size, self.num_experts, self.intermediate_size = h, num_experts, inter
        self.top_k, self.renormalize = moe.num_experts_per_tok, moe.norm_topk_prob
        self.expert_parallel = tp.expert_parallel and tp.ep_size > 1
        self.dp = tp.dp  # DP + EP: the tokens of every DP replica meet in each layer (DPComm)
        self.num_physical_experts = num_experts
        # EPLB (None without it): [E, R + 1] the physical slots of each logical expert, [E] its
        # replica count, [P] tokens routed to each physical slot.
        self.log2phy: torch.Tensor | None
        self.replica_count: torch.Tensor | None
        self.expert_load: torch.Tensor | None
        for name in ("log2phy", "replica_count", "expert_load"):
            self.register_buffer(name, None, persistent=False)
        if self.expert_parallel:
            ep_size, redundant = tp.ep_size, tp.num_redundant_experts
            physical = num_experts + redundant
            if redundant < 0 or physical % ep_size:
                slots = f" + num_redundant_experts={redundant} = {physical}" if redundant else ""
                raise ValueError(
                    f"expert parallelism over {ep_size} ranks needs num_experts={num_experts}{slots} to be a "
                    f"multiple of {ep_size}"
                )
            self.num_physical_experts = physical
            self.num_local_experts, self.intermediate_local = physical // ep_size, inter
            self.first_expert = tp.ep_rank * self.num_local_experts  # first physical slot of this rank
            # Physical slot p holds logical expert p, the redundant ones replicate experts 0, 1, ...
            # until the EPLB controller (graphrunner.distributed.eplb) places them by load.
            self.physical_to_logical = [p % num_experts for p in range(physical)]
            local = torch.full((physical,), -1, dtype=torch.int32)
            local[self.first_expert : self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32
            )
            self.register_buffer("expert_map", local.to(device), persistent=False)  # [P] physical -> local slot
            if redundant or tp.record_expert_load:
                log2phy, counts = placement_tables(self.physical_to_logical, num_experts, redundant)
                self.register_buffer("log2phy", log2phy.to(device), persistent=False)
                self.register_buffer("replica_count", counts.to(device), persistent=False)
                self.register_buffer("expert_load", torch.zeros(physical, dtype=torch.int64, device=device),
                                     persistent=False)
        else:
            if inter % tp.size:
                raise ValueError(
                    f"moe_intermediate_size={inter} is not divisible by tp_size={tp.size} (use expert parallelism, "
                    "or a TP size that divides it)"
                )
            self.num_local_experts, self.intermediate_local, self.first_expert = num_experts, inter // tp.size, 0
            self.physical_to_logical = list(range(num_experts))
            self.expert_map = None
        e_local, i_local = self.num_local_experts, self.intermediate_local
        self.gate = nn.Linear(h, num_experts, bias=False, dtype=dtype, device=device)
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(torch.empty(e_local, 2 * i_local, h, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e_local, h, i_local, dtype=dtype, device=device), requires_grad=False)
        shared = moe.shared_expert_intermediate_size
        self.shared_gate_up: MergedColumnLinear | None = None
        self.shared_down: RowLinear | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared:
            self.shared_gate_up = MergedColumnLinear(
                h, [shared, shared], dtype=dtype, device=device, tp_size=tp.size, tp_rank=tp.rank, kernel=kernel
            )
            self.shared_down = RowLinear(
                shared, h, dtype=dtype, device=device, tp_size=tp.size, tp_rank=tp.rank,
                all_reduce=_partial if tp.size > 1 else None, kernel=kernel,
            )
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, dtype=dtype, device=device)
            self.shared_expert_gate.weight.requires_grad_(False)
        # fp8 experts (`quantize_fp8`, online quantization): per-output-row scales, None until then.
        self.quant = config.quant
        self.w13_scale: torch.Tensor | None
        self.w2_scale: torch.Tensor | None
        for name in ("w13_scale", "w2_scale"):
            self.register_buffer(name, None, persistent=False)
        self.use_kernels = kernels.fused_moe_available(device) and dtype in kernels.MOE_DTYPES
        # Up to this many tokens the routing and expert kernels launch with PDL (graphrunner.kernels.pdl).
        self.pdl_rows = pdl_max_rows(kernel or KernelConfig(), device_properties(self.w13.device)) \
            if self.use_kernels else 0
        self.op_mode = False  # set by LlamaForCausalLM.use_attention_op: traced by torch.compile
        self.workspace: kernels.MoEWorkspace | None = None  # shared by the model's sparse layers

    def new_workspace(self, max_num_tokens: int) -> kernels.MoEWorkspace | None:
        """Buffers the kernels of a step of up to `max_num_tokens` tokens need (None on the torch
        path); one serves every sparse layer of a model, as they run one after another."""
        if not self.use_kernels:
            return None
        return kernels.MoEWorkspace(max_num_tokens, self.top_k, self.num_local_experts, self.hidden_size,
                                    self.intermediate_local, self.gate.weight.dtype, self.w13.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        num_tokens = x.shape[0]
        # DP + EP: every replica's tokens (the same padded count on each), then this rank's experts
        # over all of them, reduce-scattered back to this replica's tokens: [T, H] -> [D T, H] -> [T, H].
        xs = x if self.dp is None else self.dp.gather_tokens(x)
        logits = F.linear(xs, self.gate.weight)  # [N, E] in x's dtype, as the HF routers compute it
        if self.log2phy is not None:
            out = self._routed_placed(xs, logits)
        elif not self.use_kernels:
            weights, ids = route_reference(logits, self.top_k, self.renormalize)  # [N, k] fp32, int32
            out = fused_moe_reference(xs, self.w13, self.w2, weights, ids, self.expert_map, self.w13_scale,
                                      self.w2_scale)
        elif self.op_mode:
            out = torch.ops.graphrunner.fused_moe(xs, logits, self.w13, self.w2, self.expert_map, self.top_k,
                                                  self.renormalize, self.w13_scale, self.w2_scale, self.pdl_rows)
        else:
            weights, ids = kernels.route(logits, self.top_k, self.renormalize, self.pdl_rows)
            out = kernels.fused_moe(xs, self.w13, self.w2, weights, ids, self.expert_map, self.workspace,
                                    self.w13_scale, self.w2_scale, self.pdl_rows)
        if self.dp is not None:
            out = self.dp.scatter_tokens(out, num_tokens)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_expert_gate is not None, "built together"
            shared = self.shared_down.forward_swiglu(self.shared_gate_up(x))
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return self.tp.all_reduce(out)

    def _routed_placed(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The routed experts through the EPLB placement: logical ids -> physical slots, load counted."""
        assert self.log2phy is not None and self.replica_count is not None and self.expert_load is not None
        if self.use_kernels and self.op_mode:
            return torch.ops.graphrunner.fused_moe_placed(x, logits, self.w13, self.w2, self.expert_map,
                                                          self.log2phy, self.replica_count, self.expert_load,
                                                          self.top_k, self.renormalize, self.pdl_rows)
        if self.use_kernels:
            weights, ids = kernels.route(logits, self.top_k, self.renormalize, self.pdl_rows)
        else:
            weights, ids = route_reference(logits, self.top_k, self.renormalize)
        ids = to_physical(ids, self.log2phy, self.replica_count, self.expert_load)
        if self.use_kernels:
            return kernels.fused_moe(x, self.w13, self.w2, weights, ids, self.expert_map, self.workspace,
                                     pdl_rows=self.pdl_rows)
        return fused_moe_reference(x, self.w13, self.w2, weights, ids, self.expert_map)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Online fp8 (`ModelConfig.quant`): replace the loaded experts by their e4m3 codes with one
        fp32 scale per output row of each expert (`w13_scale` [E_local, 2I], `w2_scale` [E_local, H]).
        The grouped GEMMs read half the bytes; activations keep the model's dtype (weight-only)."""
        from graphrunner.layers.fp8 import quantize_weight_fp8

        if self.log2phy is not None:
            raise ValueError("fp8 experts with EPLB (num_redundant_experts or expert-load recording) are not "
                             "supported: EPLB moves expert weights without their scales")
        for name in ("w13", "w2"):
            w = getattr(self, name)
            e, n, k = w.shape
            q, scale = quantize_weight_fp8(w.reshape(e * n, k))
            setattr(self, name, nn.Parameter(q.view(e, n, k), requires_grad=False))
            self.register_buffer(f"{name}_scale", scale.view(e, n).contiguous(), persistent=False)

    def checkpoint_shape(self, param: str, shard_id: tuple[int, str] | None = None) -> tuple[int, ...]:
        """The full Hugging Face shape of one checkpoint tensor: a per-expert projection
        (`param` "w13" with shard (expert, "gate" | "up"), or "w2" with (expert, "down")), or a
        fused one (shard None: [E, 2I, H] gate|up, [E, H, I] down)."""
        h, inter, num_experts = self.hidden_size, self.intermediate_size, self.num_experts
        if shard_id is None:
            return {"w13": (num_experts, 2 * inter, h), "w2": (num_experts, h, inter)}[param]
        return (h, inter) if shard_id[1] == DOWN else (inter, h)

    @torch.no_grad()
    def load_shard(self, param: str, tensor: torch.Tensor, shard_id: tuple[int, str] | None = None) -> None:
        """Copy this rank's share of a full checkpoint tensor (see `checkpoint_shape`); a
        per-expert tensor of an expert another rank holds is skipped."""
        if shard_id is None:
            self.load_full(param, tensor)
            return
        expert, part = shard_id
        i_local, start = self.intermediate_local, self._inter_start
        for local in self._local_slots_of(expert):  # EPLB: a logical expert may fill several slots
            if part == DOWN:
                self.w2[local].copy_(tensor.narrow(1, start, i_local))
            else:
                row = 0 if part == GATE else i_local
                self.w13[local, row : row + i_local].copy_(tensor.narrow(0, start, i_local))

    @torch.no_grad()
    def load_full(self, param: str, tensor: torch.Tensor) -> None:
        """Load this rank's share of the fused (all experts) `w13` [E, 2I, H] or `w2` [E, H, I]."""
        experts = tensor.index_select(0, torch.tensor(self.local_logical_experts, device=tensor.device))
        i_local, start, inter = self.intermediate_local, self._inter_start, self.intermediate_size
        if param == "w13":
            self.w13[:, :i_local].copy_(experts.narrow(1, start, i_local))
            self.w13[:, i_local:].copy_(experts.narrow(1, inter + start, i_local))
        elif param == "w2":
            self.w2.copy_(experts.narrow(2, start, i_local))
        else:
            raise ValueError(f"FusedMoE has no fused parameter {param!r} (w13, w2)")

    @property
    def local_logical_experts(self) -> list[int]:
        """The logical expert in each of this rank's expert slots (w13 / w2 rows)."""
        first = self.first_expert
        return self.physical_to_logical[first : first + self.num_local_experts]

    def _local_slots_of(self, expert: int) -> list[int]:
        if not self.expert_parallel:
            return [expert]
        return [i for i, e in enumerate(self.local_logical_experts) if e == expert]

    @torch.no_grad()
    def set_placement(self, physical_to_logical: list[int]) -> None:
        """Rewrite the EPLB tables in place for a new placement (its weights are moved separately)."""
        assert self.log2phy is not None and self.replica_count is not None, "EPLB tables (expert parallel)"
        log2phy, counts = placement_tables(physical_to_logical, self.num_experts, self.log2phy.shape[1] - 1)
        self.log2phy.copy_(log2phy)
        self.replica_count.copy_(counts)
        self.physical_to_logical = list(physical_to_logical)

    @property
    def _inter_start(self) -> int:
        """Where this rank's slice of an expert's intermediate dimension starts."""
        return 0 if self.expert_parallel else self.tp.rank * self.intermediate_local
