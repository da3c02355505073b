"""`inspect explain`: the descriptor one batch gets, why, and what its padding costs.

A batch is given either by its query lengths (classified as the runner classifies a
step: uniform with q when every request has exactly q tokens) or by its sizes
(`num_tokens` with `uniform` q, or with `num_reqs` for a mixed batch). With a prefill
context parallel size P > 1 it also shows how `PCPPartition` would split the batch across
the P ranks, as the runner splits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture.dispatch import DispatchTable, Explanation
from graphrunner.distributed.pcp import PCPPartition
from graphrunner_tools.inspect.render import descriptor_dict, pct, text_table
from graphrunner_tools.inspect.speculation import explain_lines, explain_summary
from graphrunner_tools.inspect.table import BuiltTable, header_lines


@dataclass(frozen=True)
class BatchShape:
    """What dispatch sees of a batch: request and token counts, and q when uniform."""

    num_reqs: int
    num_tokens: int
    uniform: int | None = None

    @classmethod
    def from_query_lens(cls, query_lens: Sequence[int], q: int) -> BatchShape:
        """Classify like the runner: uniform iff every request has exactly q tokens."""
        lens = [int(n) for n in query_lens]
        if not lens or any(n < 1 for n in lens):
            raise ValueError(f"query_lens={lens} must list at least one request, each with >= 1 token")
        return cls(len(lens), sum(lens), q if all(n == q for n in lens) else None)

    @classmethod
    def from_sizes(cls, num_tokens: int, *, uniform: int | None = None, num_reqs: int | None = None) -> BatchShape:
        """`uniform` q: num_reqs = num_tokens / q (num_reqs, if given, must agree);
        otherwise a mixed batch of `num_reqs` requests."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if uniform is None:
            if num_reqs is None:
                raise ValueError("a mixed batch needs --num-reqs (or give --uniform Q, or --query-lens)")
            return cls(num_reqs, num_tokens, None)
        if uniform < 1 or num_tokens % uniform:
            raise ValueError(f"--uniform={uniform} must be >= 1 and divide num_tokens={num_tokens}")
        if num_reqs is not None and num_reqs * uniform != num_tokens:
            raise ValueError(
                f"num_reqs={num_reqs} disagrees with a uniform batch of num_tokens={num_tokens}, q={uniform} "
                f"({num_tokens // uniform} requests)"
            )
        return cls(num_tokens // uniform, num_tokens, uniform)


def explain_batch(table: DispatchTable, shape: BatchShape, has_lora: bool = False) -> Explanation:
    """`DispatchTable.explain` for the shape (a batch with LoRA adapters when `has_lora`); ValueError
    when it breaks the table's limits."""
    return table.explain(shape.num_reqs, shape.num_tokens, shape.uniform, has_lora)


def explanation_dict(built: BuiltTable, shape: BatchShape, exp: Explanation,
                     pcp: PCPSplit | None = None) -> dict[str, Any]:
    """The explanation as JSON; a `pcp` key only with a PCP split of P > 1."""
    out = {
        "kind": "inspect-explain",
        "mode": built.table.mode.name,
        "batch": {"num_reqs": shape.num_reqs, "num_tokens": shape.num_tokens, "uniform": shape.uniform,
                  "has_lora": exp.has_lora},
        "descriptor": str(exp.chosen),
        "chosen": descriptor_dict(exp.chosen),
        "verdicts": [
            {"descriptor": str(v.descriptor), "verdict": v.label, "reason": v.reason} for v in exp.verdicts
        ],
        "note": exp.note,
        "padding_tokens": exp.padding_tokens,
        "padding_reqs": exp.padding_reqs,
        "waste": exp.waste,  # padding tokens / tokens the step runs
        "speculative": explain_summary(built.spec.speculation, exp),  # None without speculation
        "moe": moe_dict(built.spec.model, exp.chosen.num_tokens),  # None for a dense (or no) model
    }
    if pcp is not None and pcp.pcp_size > 1:
        out["pcp"] = pcp_dict(pcp)
    return out


def explanation_text(built: BuiltTable, shape: BatchShape, exp: Explanation, pcp: PCPSplit | None = None) -> str:
    chosen = exp.chosen
    reqs_run = chosen.num_reqs if chosen.is_full else shape.num_reqs
    lines = [
        *header_lines(built),
        "",
        str(exp),
        "",
        f"descriptor:     {chosen}",
        f"padding:        {exp.padding_tokens} tokens ({chosen.num_tokens} run for {shape.num_tokens} real; "
        f"{pct(exp.waste)} of the step), {exp.padding_reqs} requests ({reqs_run} run for {shape.num_reqs} real)",
        *explain_lines(built.spec.speculation, exp),
        *moe_lines(built.spec.model, chosen.num_tokens),
    ]
    if pcp is not None and pcp.pcp_size > 1:
        lines += pcp_lines(pcp)
    return "\n".join(lines)


# ---- mixture of experts: the expert slots the padded step routes -------------------------------
def moe_dict(model: str | None, num_tokens: int) -> dict[str, Any] | None:
    """For a MoE `model` (one GPU): the step's T x k routing slots, the GEMM row block the MoE
    kernels pick at T, the sorted-slot buffer (each active expert's slots padded to that block)
    and the most experts the step can read; None for a dense model or none given."""
    if model is None:
        return None
    from graphrunner.layers.moe.kernels import max_padded_slots, moe_config
    from graphrunner.models.loader import load_model_config

    cfg = load_model_config(model)
    if cfg.moe is None:
        return None
    e, k = cfg.moe.num_experts, cfg.moe.num_experts_per_tok
    block_m = moe_config(num_tokens, cfg.hidden_size, cfg.moe.moe_intermediate_size, e, k).block_m
    return {"num_experts": e, "top_k": k, "padded_tokens": num_tokens, "slots": num_tokens * k,
            "block_m": block_m, "padded_slots": max_padded_slots(num_tokens, k, e, block_m),
            "max_active_experts": min(num_tokens * k, e)}


def moe_lines(model: str | None, num_tokens: int) -> list[str]:
    moe = moe_dict(model, num_tokens)
    if moe is None:
        return []
    return [f"experts:        {moe['padded_tokens']} padded tokens x top-{moe['top_k']} = {moe['slots']} routing slots "
            f"over {moe['num_experts']} experts; sorted by expert in blocks of {moe['block_m']} rows: at most "
            f"{moe['padded_slots']} rows, at most {moe['max_active_experts']} experts read per layer"]


# ---- prefill context parallelism: how the batch would be split across P ranks ----------
PCP_NOTE = ("the runner's split: each rank runs its tokens (the step is dispatched by them), K/V all-gathered "
            "per layer; a step of decodes only runs whole on every rank")


def check_pcp_size(pcp_size: int) -> int:
    """--prefill-context-parallel-size, checked before anything is built."""
    if pcp_size < 1:
        raise ValueError(f"--prefill-context-parallel-size={pcp_size} must be >= 1")
    return pcp_size


@dataclass(frozen=True)
class PCPSplit:
    """One batch's `PCPPartition` plus what explain assumed to build it.

    A request of at most `decode_query_len` tokens is a decode (held whole, duplicated on every
    rank), as the runner classifies it; every other request is a prefill chunk, split
    DualChunkSwap: rank r takes chunks r and 2P-1-r. No computed context: num_computed = 0.
    """

    query_lens: tuple[int, ...]
    is_decode: tuple[bool, ...]
    decode_query_len: int
    partition: PCPPartition

    @classmethod
    def build(cls, query_lens: Sequence[int], decode_query_len: int, pcp_size: int) -> PCPSplit:
        lens = tuple(int(n) for n in query_lens)
        dec = tuple(n <= decode_query_len for n in lens)
        part = PCPPartition.build(np.array(lens, dtype=np.int64), np.zeros(len(lens), dtype=np.int64),
                                  np.array(dec, dtype=bool), check_pcp_size(pcp_size), 0)
        return cls(lens, dec, decode_query_len, part)

    @property
    def pcp_size(self) -> int:
        return self.partition.pcp_size

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The chunk indices rank `rank` takes of every prefill: its head and its tail."""
        return rank, 2 * self.pcp_size - 1 - rank


def pcp_query_lens(shape: BatchShape, query_lens: Sequence[int] | None) -> tuple[int, ...]:
    """Per-request lengths: given, or implied by a uniform batch; a mixed batch by sizes has none."""
    if query_lens is not None:
        return tuple(int(n) for n in query_lens)
    if shape.uniform is None:
        raise ValueError("--prefill-context-parallel-size needs per-request lengths: "
                         "give --query-lens (or --uniform Q)")
    return (shape.uniform,) * shape.num_reqs


def pcp_dict(split: PCPSplit) -> dict[str, Any]:
    part, size = split.partition, split.pcp_size
    entries = [
        {"entry": i, "kind": "decode" if d else "prefill", "query_len": q,
         "chunk_len": None if d else int(part.chunk_lens[i]),
         "padded_len": None if d else int(part.padded_lens[i]),
         "chunks_by_rank": None if d else [list(split.chunks_of(r)) for r in range(size)],
         "duplicated": d}
        for i, (q, d) in enumerate(zip(split.query_lens, split.is_decode, strict=True))
    ]
    ranks = [
        {"rank": r, "tokens": int(part.tokens_per_rank[r]), "real_tokens": int(part.real_tokens_per_rank[r]),
         "padding": int(part.padding_per_rank[r]), "prefill_work": int(part.prefill_work_per_rank[r]),
         "chunks": list(split.chunks_of(r))}
        for r in range(size)
    ]
    return {"pcp_size": size, "note": PCP_NOTE, "decode_query_len": split.decode_query_len, "num_computed": 0,
            "entries": entries, "ranks": ranks, "work_imbalance_bound": part.work_imbalance_bound}


def pcp_lines(split: PCPSplit) -> list[str]:
    part, size = split.partition, split.pcp_size
    entry_rows = []
    for i, (q, d) in enumerate(zip(split.query_lens, split.is_decode, strict=True)):
        if d:
            entry_rows.append([str(i), "decode", str(q), "-", "-", "whole, duplicated on every rank"])
            continue
        chunks = "  ".join(f"r{r}: {h},{t}" for r in range(size) for h, t in [split.chunks_of(r)])
        entry_rows.append([str(i), "prefill", str(q), str(part.chunk_lens[i]), str(part.padded_lens[i]), chunks])
    rank_rows = [
        [str(r), str(part.tokens_per_rank[r]), str(part.real_tokens_per_rank[r]), str(part.padding_per_rank[r]),
         str(part.prefill_work_per_rank[r]), "{},{}".format(*split.chunks_of(r))]
        for r in range(size)
    ]
    return [
        "",
        f"prefill context parallel: P = {size} ({PCP_NOTE})",
        f"a request of q <= {split.decode_query_len} tokens is a decode, any other a prefill chunk "
        "(rank r takes chunks r and 2P-1-r); num_computed = 0",
        "",
        text_table(["entry", "kind", "tokens", "chunk len", "padded len", "chunks per rank"], entry_rows,
                   numeric=[True, False, True, True, True, False]),
        "",
        text_table(["rank", "tokens", "real", "padding", "prefill work", "chunks"], rank_rows,
                   numeric=[True, True, True, True, True, False]),
        f"tokens are local, padding included (equal on every rank); prefill work = sum of position + 1 over "
        f"real prefill tokens, ranks differ by at most {part.work_imbalance_bound}",
    ]
