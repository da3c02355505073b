"""Input preparation of a verifying step: the torch reference vs a plain-Python loop written
from the module docstring, Triton (interpreted on CPU) vs the torch reference bit for bit
(outputs and the token history afterwards), stale outputs and padding fully overwritten,
no stray writes, argument errors; GPU tests at realistic sizes and inside a CUDA graph."""

from __future__ import annotations

import random
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.spec_decode import verify
from graphrunner.spec_decode.verify import prepare_verify

SENTINEL = -7777  # never a valid index, count, position or token id
# Triton tests run compiled on CUDA tensors where a GPU exists, interpreted on CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

OUTPUTS = ("logits_indices", "verify_num_draft", "sample_positions", "num_rejected")


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """One step's uploaded inputs and the row state they index (host lists, CPU tensors)."""

    k: int
    synthetic: bool
    idx_mapping: list[int]  # [R_pad]; padded entries -> the scratch row (the last)
    query_start_loc: list[int]  # [R_pad + 1]
    num_computed: list[int]  # [rows], before the step
    prefill_len: list[int]  # [rows]
    num_draft: list[int]  # [rows]
    draft_token_ids: torch.Tensor  # [rows, k] int32
    all_token_ids: torch.Tensor  # [rows, L] int32

    @property
    def num_reqs(self) -> int:
        return len(self.idx_mapping)

    def tensors(self, device="cpu") -> dict[str, torch.Tensor]:
        i32 = dict(dtype=torch.int32, device=device)
        return dict(
            idx_mapping=torch.tensor(self.idx_mapping, **i32),
            query_start_loc=torch.tensor(self.query_start_loc, **i32),
            num_computed_tokens=torch.tensor(self.num_computed, **i32),
            prefill_len=torch.tensor(self.prefill_len, **i32),
            draft_token_ids=self.draft_token_ids.to(device),
            num_draft=torch.tensor(self.num_draft, **i32),
            all_token_ids=self.all_token_ids.to(device),
        )


def make_batch(
    rng: random.Random, max_num_reqs: int, max_model_len: int, k: int, synthetic: bool, num_reqs: int | None = None
) -> Batch:
    """A random step: real entries on distinct live rows (decodes of 1..k+1 tokens, some
    verifying, and prefill chunks), padded entries on the scratch row."""
    L, num_rows, scratch = max_model_len, max_num_reqs + 1, max_num_reqs
    num_real = rng.randint(0, max_num_reqs if num_reqs is None else min(num_reqs, max_num_reqs))
    if num_reqs is None:
        num_reqs = rng.randint(max(num_real, 1), max_num_reqs)
    rows = rng.sample(range(max_num_reqs), num_real)
    num_computed = [rng.randint(0, L - 1) for _ in range(num_rows)]
    prefill_len = [rng.randint(1, L) for _ in range(num_rows)]
    # The scratch row looks verifiable (nc >= prefill_len) at times: only q = 0 keeps padding out.
    num_computed[scratch] = rng.choice([0, num_computed[scratch]])
    prefill_len[scratch] = rng.choice([0, prefill_len[scratch]])
    qlens = []
    for r in rows:
        if rng.random() < 0.6:  # decode: all known tokens computed, the last sampled + drafts
            prefill_len[r] = rng.randint(1, L - 1)
            q = rng.randint(1, min(k + 1, L - prefill_len[r]))
            num_computed[r] = rng.randint(prefill_len[r], L - q)
        else:  # prefill chunk (q > 1 too, but nc < prefill_len: never verifies)
            num_computed[r] = rng.randint(0, prefill_len[r] - 1)
            q = rng.randint(1, L - num_computed[r])
        qlens.append(q)
    qsl = [0]
    for q in qlens + [0] * (num_reqs - num_real):
        qsl.append(qsl[-1] + q)
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    return Batch(
        k=k,
        synthetic=synthetic,
        idx_mapping=rows + [scratch] * (num_reqs - num_real),
        query_start_loc=qsl,
        num_computed=num_computed,
        prefill_len=prefill_len,
        num_draft=[rng.randint(0, k) for _ in range(num_rows)],
        draft_token_ids=torch.randint(1000, 2000, (num_rows, k), dtype=torch.int32, generator=gen),
        all_token_ids=torch.randint(0, 1000, (num_rows, L), dtype=torch.int32, generator=gen),
    )


batches = st.builds(
    make_batch,
    rng=st.randoms(use_true_random=False),
    max_num_reqs=st.integers(1, 12),
    max_model_len=st.integers(2, 40),
    k=st.integers(0, 4),
    synthetic=st.booleans(),
)


# --------------------------------------------------------------------------- loop reference


def loop_verify(b: Batch) -> tuple[dict[str, list], list[list[int]]]:
    """The module docstring, entry by entry: the outputs and the token history afterwards."""
    k, tokens, drafts = b.k, b.all_token_ids.tolist(), b.draft_token_ids.tolist()
    out: dict[str, list] = {name: [] for name in OUTPUTS}
    for e in range(b.num_reqs):
        r, start, end = b.idx_mapping[e], b.query_start_loc[e], b.query_start_loc[e + 1]
        q, nc = end - start, b.num_computed[r]
        if q > 1 and nc >= b.prefill_len[r]:
            out["logits_indices"].append([start + min(j, q - 1) for j in range(k + 1)])
            out["verify_num_draft"].append(q - 1 if b.synthetic else min(b.num_draft[r], q - 1))
            out["sample_positions"].append(nc + 1)
            out["num_rejected"].append(q - 1)
            for j in range(q - 1):
                tokens[r][nc + 1 + j] = drafts[r][j]
        else:
            out["logits_indices"].append([max(end - 1, 0)] * (k + 1))
            out["verify_num_draft"].append(0)
            out["sample_positions"].append(nc + q)  # padding: the scratch row's nc
            out["num_rejected"].append(0)
    return out, tokens


# --------------------------------------------------------------------------- helpers


def run(impl: str, b: Batch, t: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One implementation on a copy of the history, into junk-filled views of larger buffers
    (the logits indices a strided view); checks that nothing outside the views is written."""
    R, k, dev = b.num_reqs, b.k, t["idx_mapping"].device
    gen = torch.Generator().manual_seed(R * 31 + k)
    junk = dict(
        logits_indices=torch.randint(-99, 99, (R + 2, k + 4), generator=gen, dtype=torch.int64),
        verify_num_draft=torch.randint(-99, 99, (R + 2,), generator=gen, dtype=torch.int32),
        sample_positions=torch.randint(-99, 99, (R + 2,), generator=gen, dtype=torch.int64),
        num_rejected=torch.randint(-99, 99, (R + 2,), generator=gen, dtype=torch.int32),
    )
    bufs = {name: v.to(dev) for name, v in junk.items()}
    for v in bufs.values():  # the parts outside the views
        v[R:] = SENTINEL
    bufs["logits_indices"][:, 0] = SENTINEL
    bufs["logits_indices"][:, k + 2 :] = SENTINEL
    views = {name: v[:R] for name, v in bufs.items()}
    views["logits_indices"] = bufs["logits_indices"][:R, 1 : k + 2]
    history = t["all_token_ids"].clone()
    getattr(verify, f"prepare_verify_{impl}")(
        t["idx_mapping"], t["query_start_loc"], t["num_computed_tokens"], t["prefill_len"], t["draft_token_ids"],
        t["num_draft"], history, views["logits_indices"], views["verify_num_draft"], views["sample_positions"],
        views["num_rejected"], synthetic=b.synthetic,
    )  # fmt: skip
    for name, v in bufs.items():
        assert (v[R:] == SENTINEL).all(), name
    assert (bufs["logits_indices"][:, 0] == SENTINEL).all() and (bufs["logits_indices"][:, k + 2 :] == SENTINEL).all()
    return {name: v.cpu() for name, v in views.items()}, history.cpu()


# --------------------------------------------------------------------------- properties


@settings(deadline=None)
@given(b=batches)
def test_torch_matches_loop_reference(b: Batch):
    out, history = run("torch", b, b.tensors())
    want, tokens = loop_verify(b)
    for name in OUTPUTS:
        assert out[name].tolist() == want[name], name
    assert history.tolist() == tokens
    # The scratch row shared by every padded entry is never written.
    assert torch.equal(history[-1], b.all_token_ids[-1])


@needs_triton
@settings(deadline=None)
@given(b=batches, req_block=st.sampled_from([2, 128]))
def test_triton_matches_torch(b: Batch, req_block: int):
    # Small blocks spread the entries over several programs.
    t = b.tensors(DEVICE)
    ref, ref_history = run("torch", b, t)
    with mock.patch.object(verify, "_REQ_BLOCK", req_block):
        got, got_history = run("triton", b, t)
    for name in OUTPUTS:
        assert torch.equal(got[name], ref[name]), name
    assert torch.equal(got_history, ref_history)


# --------------------------------------------------------------------------- examples and errors


def test_example():
    # Entry 0 verifies 3 slots (2 drafts proposed), entry 1 is a prefill chunk, entry 2 a
    # plain decode, entry 3 padding; k = 3, L = 12.
    b = Batch(
        k=3,
        synthetic=False,
        idx_mapping=[2, 0, 1, 3],
        query_start_loc=[0, 4, 9, 10, 10],
        num_computed=[0, 7, 5, 0],
        prefill_len=[6, 7, 5, 0],
        num_draft=[0, 3, 2, 0],
        draft_token_ids=torch.tensor([[0, 0, 0], [0, 0, 0], [51, 52, 53], [0, 0, 0]], dtype=torch.int32),
        all_token_ids=torch.zeros(4, 12, dtype=torch.int32),
    )
    for impl in ["torch", "triton"] if HAS_TRITON else ["torch"]:
        out, history = run(impl, b, b.tensors("cpu" if impl == "torch" else DEVICE))
        assert out["logits_indices"].tolist() == [[0, 1, 2, 3], [8, 8, 8, 8], [9, 9, 9, 9], [9, 9, 9, 9]]
        assert out["verify_num_draft"].tolist() == [2, 0, 0, 0]
        assert out["sample_positions"].tolist() == [6, 5, 8, 0]
        assert out["num_rejected"].tolist() == [3, 0, 0, 0]
        assert history[2].tolist() == [0] * 6 + [51, 52, 53] + [0] * 3
        assert history[[0, 1, 3]].eq(0).all()


def test_public_api_dispatches_and_overwrites_stale_buffers():
    b = make_batch(random.Random(3), 6, 16, 3, False)
    t = b.tensors()
    R = b.num_reqs
    outs = dict(
        logits_indices_out=torch.full((R, 4), SENTINEL, dtype=torch.int64),
        verify_num_draft_out=torch.full((R,), SENTINEL, dtype=torch.int32),
        sample_positions_out=torch.full((R,), SENTINEL, dtype=torch.int64),
        num_rejected_out=torch.full((R,), SENTINEL, dtype=torch.int32),
    )
    prepare_verify(**t, **outs)
    want, tokens = loop_verify(b)
    for name in OUTPUTS:
        assert outs[f"{name}_out"].tolist() == want[name], name
    assert t["all_token_ids"].tolist() == tokens


def test_argument_errors():
    i32 = dict(dtype=torch.int32)
    good = dict(
        idx_mapping=torch.zeros(2, **i32),
        query_start_loc=torch.zeros(3, **i32),
        num_computed_tokens=torch.zeros(3, **i32),
        prefill_len=torch.zeros(3, **i32),
        draft_token_ids=torch.zeros(3, 2, **i32),
        num_draft=torch.zeros(3, **i32),
        all_token_ids=torch.zeros(3, 8, **i32),
        logits_indices_out=torch.zeros(2, 3, dtype=torch.int64),
        verify_num_draft_out=torch.zeros(2, **i32),
        sample_positions_out=torch.zeros(2, dtype=torch.int64),
        num_rejected_out=torch.zeros(2, **i32),
    )
    cases = [
        (dict(idx_mapping=torch.zeros(0, **i32)), r"idx_mapping has shape \(0,\), expected \[R_pad\] with R_pad >= 1"),
        (dict(idx_mapping=torch.zeros(2, dtype=torch.int64)), r"idx_mapping has dtype torch.int64"),
        (dict(query_start_loc=torch.zeros(2, **i32)), r"query_start_loc has shape \(2,\), expected \(3,\)"),
        (dict(prefill_len=torch.zeros(4, **i32)), r"prefill_len has shape \(4,\), expected \(3,\)"),
        (dict(draft_token_ids=torch.zeros(3, **i32)), r"draft_token_ids has shape \(3,\), expected \[rows, k\]"),
        (dict(all_token_ids=torch.zeros(2, 8, **i32)), r"all_token_ids has shape \(2, 8\), expected \(3, 8\)"),
        (dict(logits_indices_out=torch.zeros(2, 2, dtype=torch.int64)),
         r"logits_indices_out has shape \(2, 2\), expected \(2, 3\)"),
        (dict(sample_positions_out=torch.zeros(2, **i32)), r"sample_positions_out has dtype torch.int32"),
        (dict(num_rejected_out=torch.zeros(2, **i32).to("meta")), r"num_rejected_out is on meta, all_token_ids on cpu"),
    ]  # fmt: skip
    for change, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            prepare_verify(**{**good, **change})
    assert all(v.eq(0).all() for v in good.values())  # a rejected call writes nothing


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@settings(deadline=None)
@given(seed=st.integers(0, 2**30), synthetic=st.booleans())
def test_gpu_triton_matches_torch_large(seed, synthetic):
    # R_pad = 256 entries over 257 rows of L = 4096 tokens, k = 4.
    b = make_batch(random.Random(seed), 256, 4096, 4, synthetic, num_reqs=256)
    t = b.tensors("cuda")
    ref, ref_history = run("torch", b, t)
    got, got_history = run("triton", b, t)
    for name in OUTPUTS:
        assert torch.equal(got[name], ref[name]), name
    assert torch.equal(got_history, ref_history)
    want, tokens = loop_verify(b)
    assert ref["logits_indices"].tolist() == want["logits_indices"] and ref_history.tolist() == tokens


@pytest.mark.gpu
@pytest.mark.parametrize("synthetic", [False, True])
def test_cuda_graph_capture_and_replay(synthetic):
    """Capture `prepare_verify` once; replay after rewriting the inputs and row state in
    place; outputs and history match an eager torch run on copies."""
    R_pad, max_num_reqs, L, k = 64, 96, 512, 4
    rng = random.Random(1)
    inputs = make_batch(rng, max_num_reqs, L, k, synthetic, num_reqs=R_pad).tensors("cuda")
    outs = dict(
        logits_indices_out=torch.empty(R_pad, k + 1, dtype=torch.int64, device="cuda"),
        verify_num_draft_out=torch.empty(R_pad, dtype=torch.int32, device="cuda"),
        sample_positions_out=torch.empty(R_pad, dtype=torch.int64, device="cuda"),
        num_rejected_out=torch.empty(R_pad, dtype=torch.int32, device="cuda"),
    )
    # Warm up (compiles the kernel) on a side stream, then capture.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        prepare_verify(**inputs, **outs, synthetic=synthetic)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepare_verify(**inputs, **outs, synthetic=synthetic)

    verified = 0
    for _ in range(5):
        b = make_batch(rng, max_num_reqs, L, k, synthetic, num_reqs=R_pad)
        for name, v in b.tensors("cuda").items():
            inputs[name].copy_(v)
        ref_inputs = {name: v.clone() for name, v in inputs.items()}
        ref_outs = {name: torch.full_like(v, SENTINEL) for name, v in outs.items()}
        for v in outs.values():
            v.fill_(SENTINEL)
        verify.prepare_verify_torch(**ref_inputs, **ref_outs, synthetic=synthetic)
        graph.replay()
        torch.cuda.synchronize()
        for name in outs:
            assert torch.equal(outs[name], ref_outs[name]), name
        assert torch.equal(inputs["all_token_ids"], ref_inputs["all_token_ids"])
        verified += int(outs["num_rejected_out"].gt(0).sum())
    assert verified > 0  # the replays did place drafts
