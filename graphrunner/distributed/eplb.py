"""EPLB: expert load balancing for expert-parallel MoE layers (vLLM's `enable_eplb`).

Each MoE layer holds P = E + R physical expert slots (`num_redundant_experts` R), spread evenly
over the EP ranks (all D x T ranks under DP + EP, the TP ranks otherwise). Inside the step the
layer routes every (token, logical expert) pair to one physical replica through its `log2phy`
and `replica_count` buffers and adds one per routed token to its slot in `expert_load` (a
static-shape scatter-add, captured with the graphs). Between steps, outside the graphs, the
controller:

    step()        moves the step's counts into a window of the last `eplb_window_size` steps;
    every `eplb_step_interval` steps:
      rearrange() the window's logical load per layer -> a placement (`balanced_placement`:
                  replicate the hottest experts; from the current placement, keep every
                  replica that may stay, put the new ones on the least-loaded ranks, then swap
                  replicas between the heaviest rank and a lighter one until the balance is
                  within `PLACEMENT_TOLERANCE` of packing every replica afresh (heaviest first
                  onto the least-loaded rank), or take that packing when swaps cannot get
                  there; experts that stay on a rank keep their slot; a layer whose balance
                  would improve by no more than `MIN_BALANCE_GAIN` keeps its own) -> the weights of
                  every slot whose expert changes, sent between ranks with point-to-point
                  NCCL / gloo -> `log2phy` / `replica_count` rewritten in place.

Buffers change in place only, so captured graphs keep replaying: nothing is recaptured. A
replica is a bit-identical copy, so a placement changes no token. Every EP rank counts the same
tokens (a layer routes every replica's tokens after its all-gather; TP ranks see the same
tokens), and the counts are broadcast from EP rank 0 before placing, so every rank computes
the same placement.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from graphrunner.layers.moe.layer import FusedMoE

__all__ = [
    "MIN_BALANCE_GAIN", "PLACEMENT_TOLERANCE", "EplbController", "balanced_placement", "load_balance", "rank_loads",
    "replacement",
]


# The first rebalance of qwen3-30b-a3b on 2x H200 (128 experts + 8 redundant slots in each of 48
# MoE layers, a router skewed 20x onto 8 experts that all sat on rank 0) used to re-pack every
# replica from scratch: it moved 3,068 of the 6,528 slots (about 29 GB of expert weights) to go
# from a max / mean rank load of 1.427 to 1.000, and the GPUs idled 9% of the run while the
# weights moved. Copying the 8 new hot replicas into the redundant slots that the cold experts
# give up reaches the same balance, so a placement starts from the current one and swaps replicas
# only while that helps. Its result stands while its max / mean is within this of the re-packed one.
PLACEMENT_TOLERANCE = 0.01


def balanced_placement(load: Sequence[float], num_physical: int, num_ranks: int,
                       current: Sequence[int] | None = None) -> list[int]:
    """The logical expert of each of `num_physical` slots (slots [r S, (r+1) S) on rank r) for
    per-expert `load` [E] (pure, deterministic).

    1. Replicate: each of the P - E redundant slots goes to the expert with the highest load per
       replica (ties: the lower id). A replica carries load / replicas of its expert.
    2. Without `current`, pack: replicas, heaviest first, go to the rank with the least load among
       those with a free slot, preferring ranks without a replica of that expert.
    3. With `current`, move little:
       a. keep: each rank keeps the replicas it holds; an expert left with fewer replicas keeps
          those on the ranks with the most load, one per rank first (its freed slots then sit on
          the light ranks, where the new replicas should go);
       b. fill: the new replicas, heaviest first, take free slots on the least-loaded ranks,
          preferring ranks without that expert;
       c. swap: while the heaviest rank carries more than the packed placement's heaviest plus
          `PLACEMENT_TOLERANCE` of the mean, or more than the mean plus the heaviest replica where
          packing stays within that, exchange the pair of replicas between it and the lightest
          rank (the next lightest when no pair helps) that lowers the heavier of the two the most,
          never adding a second replica of an expert to a rank (every rank holds S replicas, so a
          replica moves only in exchange for another).
       The result stands when its max / mean rank load is within `PLACEMENT_TOLERANCE` of the
       packed placement's; otherwise the packed placement is taken.
    4. Order: on each rank an expert that already sits in one of its slots (`current`) stays
       there, so only slots whose expert changes move weights.
    """
    num_experts = len(load)
    if num_physical < num_experts or num_physical % num_ranks:
        raise ValueError(f"num_physical={num_physical} must be >= num_experts={num_experts} and a multiple of "
                         f"num_ranks={num_ranks}")
    if current is not None and len(current) != num_physical:
        raise ValueError(f"current places {len(current)} slots, not num_physical={num_physical}")
    per_rank = num_physical // num_ranks
    replicas = _replica_counts(load, num_physical)
    weight = [load[e] / replicas[e] for e in range(num_experts)]
    packed = _pack(weight, replicas, num_ranks, per_rank)
    if current is None:
        return _order(packed, None, per_rank)
    held = _keep_and_fill(weight, replicas, current, num_ranks, per_rank)
    total = math.fsum([weight[e] * replicas[e] for e in range(num_experts)])
    mean = total / num_ranks
    eps = 1e-9 * total  # rank loads are exact sums (fsum): this only absorbs the rounding of the bounds
    packed_max = max(_rank_load(h, weight) for h in packed)
    limit = packed_max + PLACEMENT_TOLERANCE * mean
    # Within the tolerance, go on down to one replica over the mean where packing is that close: a
    # heaviest rank above it always has a helpful swap (its heaviest replica for the lightest rank's
    # lightest), so this costs a swap or two and keeps packing's bound on every rank.
    _swap_down(held, weight, min(limit, max(packed_max, mean + max(weight))), eps, num_physical)
    if max(_rank_load(h, weight) for h in held) <= limit + eps:
        return _order(held, current, per_rank)
    return _order(packed, current, per_rank)


def _replica_counts(load: Sequence[float], num_physical: int) -> list[int]:
    """Replicas per expert: each redundant slot to the highest load per replica, ties the lower id."""
    replicas = [1] * len(load)
    heap = [(-(load[e] / replicas[e]), e) for e in range(len(load))]
    heapq.heapify(heap)
    for _ in range(num_physical - len(load)):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-(load[e] / replicas[e]), e))
    return replicas


def _rank_load(held: dict[int, int], weight: list[float]) -> float:
    """A rank's load from its replicas per expert, summed exactly: the same replicas give the same
    load whatever order they were added in."""
    return math.fsum([weight[e] * n for e, n in held.items()])


def _pack(weight: list[float], replicas: list[int], num_ranks: int, per_rank: int) -> list[dict[int, int]]:
    """Replicas per expert on each rank: heaviest first onto the least-loaded rank with a free slot,
    ranks without that expert first (ties: the lower rank)."""
    items = sorted(((weight[e], e) for e in range(len(weight)) for _ in range(replicas[e])),
                   key=lambda item: (-item[0], item[1]))
    rank_load = [0.0] * num_ranks
    held: list[dict[int, int]] = [{} for _ in range(num_ranks)]
    size = [0] * num_ranks
    free = [(0.0, r) for r in range(num_ranks)]  # (load, rank) of each rank with a free slot, a heap
    for w, e in items:
        skipped = []
        while free:
            entry = heapq.heappop(free)
            if e not in held[entry[1]]:
                r = entry[1]
                break
            skipped.append(entry)
        else:  # every rank with a free slot holds e: the least-loaded of them
            r = skipped.pop(0)[1]
        for entry in skipped:
            heapq.heappush(free, entry)
        held[r][e] = held[r].get(e, 0) + 1
        rank_load[r] += w
        size[r] += 1
        if size[r] < per_rank:
            heapq.heappush(free, (rank_load[r], r))
    return held


def _keep_and_fill(weight: list[float], replicas: list[int], current: Sequence[int], num_ranks: int,
                   per_rank: int) -> list[dict[int, int]]:
    """Replicas per expert on each rank: those of `current` that stay, then the new ones."""
    holding: list[dict[int, int]] = [{} for _ in range(num_ranks)]
    holders: dict[int, list[int]] = {}  # expert -> the ranks holding it, in rank order
    for p, e in enumerate(current):
        r = p // per_rank
        if e not in holding[r]:
            holders.setdefault(e, []).append(r)
        holding[r][e] = holding[r].get(e, 0) + 1
    # What each rank would carry keeping everything, at the new loads per replica: an expert that
    # lost replicas keeps those on the heaviest ranks, freeing slots on the light ones.
    projected = [_rank_load(h, weight) for h in holding]
    heaviest_first = sorted(range(len(weight)), key=lambda e: (-weight[e], e))
    held: list[dict[int, int]] = [{} for _ in range(num_ranks)]
    left = list(replicas)
    copies = Counter(current)
    for e in heaviest_first:
        ranks = holders.get(e, [])
        if copies[e] <= replicas[e]:
            for r in ranks:
                held[r][e] = holding[r][e]
            left[e] -= copies[e]
            continue
        ranks = sorted(ranks, key=lambda r: (-projected[r], r))
        keep = dict.fromkeys(ranks[: replicas[e]], 1)  # one per rank first
        extra = replicas[e] - len(keep)
        for r in ranks:
            more = min(holding[r][e] - 1, extra)
            if more > 0:
                keep[r] += more
                extra -= more
        for r in ranks:
            projected[r] -= (holding[r][e] - keep.get(r, 0)) * weight[e]
            if r in keep:
                held[r][e] = keep[r]
        left[e] = 0
    rank_load = [_rank_load(h, weight) for h in held]
    size = [sum(h.values()) for h in held]
    for e in heaviest_first:
        for _ in range(left[e]):
            r = min((r for r in range(num_ranks) if size[r] < per_rank), key=lambda r: (e in held[r], rank_load[r], r))
            held[r][e] = held[r].get(e, 0) + 1
            rank_load[r] += weight[e]
            size[r] += 1
    return held


def _swap_down(held: list[dict[int, int]], weight: list[float], target: float, eps: float, max_swaps: int) -> None:
    """Exchange replicas between the heaviest rank and the lightest one that gains from it until
    the heaviest carries at most `target` or no exchange lowers it by more than `eps` (in place).
    Each exchange lowers the sum of squared rank loads, so this ends; `max_swaps` bounds the time."""
    num_ranks = len(held)
    rank_load = [_rank_load(h, weight) for h in held]
    for _ in range(max_swaps):
        hi = max(range(num_ranks), key=lambda r: (rank_load[r], -r))
        if rank_load[hi] <= target + eps:
            return
        for lo in sorted(range(num_ranks), key=lambda r: (rank_load[r], r)):
            if rank_load[lo] >= rank_load[hi] - eps:
                return  # no lighter rank has a helpful exchange
            pair = _best_swap(held[hi], held[lo], rank_load[hi] - rank_load[lo], weight, eps)
            if pair is not None:
                x, y = pair
                for h, gone, came in ((held[hi], x, y), (held[lo], y, x)):
                    h[gone] -= 1
                    if not h[gone]:
                        del h[gone]
                    h[came] = h.get(came, 0) + 1
                rank_load[hi], rank_load[lo] = _rank_load(held[hi], weight), _rank_load(held[lo], weight)
                break
        else:
            return


def _best_swap(hi: dict[int, int], lo: dict[int, int], gap: float, weight: list[float],
               eps: float) -> tuple[int, int] | None:
    """(expert from `hi`, expert from `lo`) whose exchange lowers the heavier of the two ranks (`gap`
    apart) the most, by more than `eps`, without adding a second replica of an expert to a rank
    (unless it removes one too); None when there is none. Ties: the fewer such replicas, lower ids."""
    candidates = sorted(lo, key=lambda y: (weight[y], y))
    weights = [weight[y] for y in candidates]
    best: tuple[float, int, int, int] | None = None
    for x in sorted(hi):
        wx = weight[x]
        # The exchange moves wx - wy from hi to lo; the pair is best off when that is gap / 2:
        # look at the nearest allowed candidate on each side of it.
        at = bisect.bisect_left(weights, wx - gap / 2)
        for side in (range(at, len(candidates)), range(at - 1, -1, -1)):
            for j in side:
                delta = wx - weights[j]
                if delta <= eps or delta >= gap - eps:
                    break
                y = candidates[j]
                doubled = (y in hi) + (x in lo) - (hi[x] > 1) - (lo[y] > 1)
                if y == x or doubled > 0:
                    continue
                key = (max(-delta, delta - gap), doubled, x, y)
                if best is None or key < best:
                    best = key
                break
    return None if best is None else (best[2], best[3])


def _order(held: list[dict[int, int]], current: Sequence[int] | None, per_rank: int) -> list[int]:
    """Slots from replicas per rank: an expert that sits in one of its rank's slots stays there; the
    others fill the remaining slots in expert order."""
    placement = [-1] * (len(held) * per_rank)
    for r, h in enumerate(held):
        want = dict(h)
        slots = range(r * per_rank, (r + 1) * per_rank)
        if current is not None:
            for p in slots:
                if want.get(current[p], 0) > 0:
                    placement[p] = current[p]
                    want[current[p]] -= 1
        rest = iter(sorted(e for e, n in want.items() for _ in range(n)))
        for p in slots:
            if placement[p] < 0:
                placement[p] = next(rest)
    return placement


# A layer's experts move only when the new placement lowers its max / mean rank load by more than
# this. qwen3-30b-a3b on 2x H200 (DP2 + EP, 8 redundant slots): once a skew was balanced, each later
# rebalance moved 2,834-2,940 of the 6,528 slots (about 27 GB of expert weights) to go from a balance
# of 1.007-1.010 to 1.000, and the GPUs idled 17% of the run.
MIN_BALANCE_GAIN = 0.02


def replacement(physical_load: Sequence[float], current: Sequence[int], num_experts: int,
                num_ranks: int) -> tuple[list[int], float, float]:
    """(placement, balance under `current`, balance under the placement) for one layer's window
    of tokens per physical slot: `balanced_placement` of the logical load, or `current` itself
    when that gains no more than `MIN_BALANCE_GAIN` (pure, deterministic)."""
    logical = [0.0] * num_experts
    for p, e in enumerate(current):
        logical[e] += physical_load[p]
    new = balanced_placement(logical, len(current), num_ranks, current)
    replicas = Counter(new)
    before = load_balance(physical_load, num_ranks)
    after = load_balance([logical[e] / replicas[e] for e in new], num_ranks)
    if before - after <= MIN_BALANCE_GAIN:
        return list(current), before, before
    return new, before, after


def rank_loads(physical_load: Sequence[float], num_ranks: int) -> list[float]:
    """Tokens per rank from tokens per physical slot (slots [r S, (r+1) S) on rank r)."""
    per_rank = len(physical_load) // num_ranks
    return [float(sum(physical_load[r * per_rank : (r + 1) * per_rank])) for r in range(num_ranks)]


def load_balance(physical_load: Sequence[float], num_ranks: int) -> float:
    """max / mean of the per-rank load (1.0 = balanced; 1.0 with no load)."""
    loads = rank_loads(physical_load, num_ranks)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Rearrangement:
    """One rebalance: the step it ran after, the window's max/mean rank load (mean over layers)
    under the old placement and as the new placement would spread the same load, slots moved."""

    step: int
    balance_before: float
    balance_predicted: float
    slots_moved: int


class EplbController:
    """The EPLB state of one rank's MoE layers (module docstring).

    layers: the model's expert-parallel FusedMoE layers with EPLB tables, in layer order;
    peers: the global rank of each EP rank, in EP order (the weights move between them);
    dp_group / tp_group: the device groups the counts are broadcast over (None for a group of one).
    """

    def __init__(self, layers: list[FusedMoE], *, ep_size: int, ep_rank: int, peers: list[int],
                 window_size: int, step_interval: int, dp_group: Any = None, tp_group: Any = None) -> None:
        if not layers:
            raise ValueError("enable_eplb=True needs a model with expert-parallel MoE layers")
        first = layers[0]
        assert first.expert_load is not None, "EPLB layers count their load (TPComm.record_expert_load)"
        self.layers = layers
        self.ep_size, self.ep_rank, self.peers = ep_size, ep_rank, peers
        self.num_experts, self.num_physical = first.num_experts, first.num_physical_experts
        self.window_size, self.step_interval = window_size, step_interval
        self.dp_group, self.tp_group = dp_group, tp_group
        device = first.expert_load.device
        # One [L, P] buffer for the step's counts: each layer counts into its row (a view), so
        # the per-step bookkeeping is two launches whatever the number of layers.
        self.step_load = torch.zeros(len(layers), self.num_physical, dtype=torch.int64, device=device)
        for i, layer in enumerate(layers):
            layer.expert_load = self.step_load[i]
        self.window = torch.zeros(window_size, len(layers), self.num_physical, dtype=torch.int64, device=device)
        self.num_steps = 0  # steps counted since start
        self._filled = 0  # steps in the window since the last rearrangement
        self.rearrangements: list[Rearrangement] = []

    # ---- between steps -----------------------------------------------------------------
    def step(self) -> None:
        """After every executed step (a dummy one too), outside the graphs."""
        self.window[self._filled % self.window_size].copy_(self.step_load)
        self.step_load.zero_()
        self.num_steps += 1
        self._filled += 1
        if self.num_steps % self.step_interval == 0:
            self.rearrange()

    def physical_load(self) -> torch.Tensor:
        """[L, P] tokens routed to each physical slot over the window since the last rearrangement (host)."""
        return self.window.sum(0).cpu()

    def balance(self) -> float:
        """max / mean rank load over the window under the current placement, mean over layers."""
        load = self.physical_load()
        return sum(load_balance(row.tolist(), self.ep_size) for row in load) / len(self.layers)

    @torch.no_grad()
    def rearrange(self) -> Rearrangement:
        """Re-place every layer's experts by the window's load; move weights; rewrite the tables."""
        load = self.window.sum(0)  # [L, P] on the device
        for group in (self.dp_group, self.tp_group):  # the same counts on every rank: one placement
            if group is not None:
                dist.broadcast(load, src=dist.get_global_rank(group, 0), group=group)
        load = load.cpu()
        before, predicted, moved = [], [], 0
        for layer, row in zip(self.layers, load, strict=True):
            old = layer.physical_to_logical
            new, balance_before, balance_after = replacement(row.tolist(), old, self.num_experts, self.ep_size)
            before.append(balance_before)
            predicted.append(balance_after)
            if new != old:
                moved += sum(a != b for a, b in zip(old, new, strict=True))
                self._move_weights(layer, old, new)
                layer.set_placement(new)
        self.window.zero_()
        self._filled = 0
        record = Rearrangement(self.num_steps, sum(before) / len(before), sum(predicted) / len(predicted), moved)
        self.rearrangements.append(record)
        return record

    def _move_weights(self, layer: FusedMoE, old: list[int], new: list[int]) -> None:
        """Fill every slot whose logical expert changes from a current holder: a local copy when
        this rank holds it, else point-to-point from the lowest EP rank that does. Every rank
        derives the same transfer list, so sends and receives pair up in the same order."""
        per_rank = self.num_physical // self.ep_size
        holders: dict[int, list[int]] = {}
        for p, e in enumerate(old):
            holders.setdefault(e, []).append(p)
        me, first = self.ep_rank, self.ep_rank * per_rank
        params = (layer.w13, layer.w2)
        incoming: list[tuple[int, list[torch.Tensor]]] = []  # (local slot, its new weights)
        ops: list[dist.P2POp] = []
        for p, e in enumerate(new):
            if old[p] == e:
                continue
            dst = p // per_rank
            local_src = [q for q in holders[e] if q // per_rank == dst]
            src_slot = local_src[0] if local_src else holders[e][0]
            src = src_slot // per_rank
            if dst == me:
                if src == me:  # a copy from the old weights (a snapshot: the slot may be overwritten)
                    incoming.append((p - first, [w[src_slot - first].clone() for w in params]))
                else:
                    bufs = [torch.empty_like(w[0]) for w in params]
                    ops += [dist.P2POp(dist.irecv, b, self.peers[src]) for b in bufs]
                    incoming.append((p - first, bufs))
            elif src == me:
                ops += [dist.P2POp(dist.isend, w[src_slot - first].contiguous(), self.peers[dst]) for w in params]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for slot, weights in incoming:
            for w, value in zip(params, weights, strict=True):
                w[slot].copy_(value)

    def report(self) -> dict[str, Any]:
        """What `inspect simulate` and `bench` print: rebalances and the per-rank load balance."""
        return {
            "steps": self.num_steps,
            "rearrangements": [(r.step, round(r.balance_before, 3), round(r.balance_predicted, 3), r.slots_moved)
                               for r in self.rearrangements],
            "balance_now": round(self.balance(), 3),
        }


def make_eplb(model: Any, tp: Any, groups: Any, window_size: int, step_interval: int) -> EplbController:
    """The controller of `model`'s expert-parallel MoE layers on this rank (`tp`: their TPComm)."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.expert_load is not None]
    if not layers:
        raise ValueError("enable_eplb=True needs a mixture-of-experts model with enable_expert_parallel=True "
                         "over more than one rank")
    # EP rank (d, t) -> global rank: the DP group gives (d, this t), TP ranks are consecutive.
    base = groups.dp.ranks if tp.dp is not None else [groups.tp.ranks[groups.tp_rank]]
    peers = [b - groups.tp_rank + t for b in base for t in range(groups.tp_size)]
    return EplbController(layers, ep_size=tp.ep_size, ep_rank=tp.ep_rank, peers=peers, window_size=window_size,
                          step_interval=step_interval,
                          dp_group=groups.dp.device_group if tp.dp is not None else None,
                          tp_group=groups.tp.device_group)
