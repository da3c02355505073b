"""The dispatch table's LoRA dimension (capture/dispatch.py), pure Python, with hypothesis.

- A batch without adapters dispatches exactly as in a table without LoRA (the plain graphs, zero
  cost); a batch with adapters gets a LoRA graph or NONE, never a graph captured without them.
- The LoRA graphs are at most 40% of the plain ones (their capture adds under half the time), and
  every batch a plain graph serves has a LoRA graph too.
- `explain` names the LoRA mismatch and the eager reason.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import DispatchTable, default_capture_sizes, default_lora_capture_sizes
from capture.modes import CUDAGraphMode

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]

tables = st.fixed_dictionaries({
    "mode": st.sampled_from(MODES),
    "max_num_reqs": st.integers(1, 64),
    "max_num_batched_tokens": st.integers(16, 600),
    "q": st.integers(1, 3),
})


def _tables(cfg):
    args = dict(max_num_reqs=cfg["max_num_reqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
                uniform_decode_query_len=cfg["q"])
    return DispatchTable(cfg["mode"], **args), DispatchTable(cfg["mode"], enable_lora=True, **args)


@given(tables, st.data())
def test_lora_dimension(cfg, data):
    plain, lora = _tables(cfg)
    num_reqs = data.draw(st.integers(1, min(cfg["max_num_reqs"], cfg["max_num_batched_tokens"])))
    uniform = data.draw(st.booleans()) and num_reqs * cfg["q"] <= cfg["max_num_batched_tokens"]
    num_tokens = num_reqs * cfg["q"] if uniform else data.draw(
        st.integers(num_reqs, cfg["max_num_batched_tokens"]))
    q = cfg["q"] if uniform else None
    assert lora.dispatch(num_reqs, num_tokens, q) == plain.dispatch(num_reqs, num_tokens, q)
    got = lora.dispatch(num_reqs, num_tokens, q, has_lora=True)
    assert got.has_lora
    assert got.is_eager or got in lora.descriptors
    assert got.is_eager or got.fits(num_reqs, num_tokens, q, True)
    if not plain.dispatch(num_reqs, num_tokens, q).is_eager:  # a plain graph serves it: so does a LoRA one
        assert not got.is_eager
    assert plain.dispatch(num_reqs, num_tokens, q, has_lora=True).is_eager  # no LoRA graphs there
    lora_graphs = [d for d in lora.descriptors if d.has_lora]
    assert {d for d in lora.descriptors if not d.has_lora} == set(plain.descriptors)
    assert len(lora_graphs) <= max(1, 0.4 * len(plain.descriptors)) or len(plain.capture_sizes) < 3


def test_default_lora_ladder():
    sizes = default_capture_sizes(256, 8192)
    assert default_lora_capture_sizes(sizes) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert default_lora_capture_sizes((1, 2, 4, 8, 16)) == (2, 16)
    table = DispatchTable("FULL_AND_PIECEWISE", max_num_reqs=256, max_num_batched_tokens=8192, enable_lora=True)
    n_lora = sum(d.has_lora for d in table.descriptors)
    assert n_lora / (len(table.descriptors) - n_lora) < 0.4
    assert "with LoRA at 15 sizes" in repr(table)
    explicit = DispatchTable("PIECEWISE", max_num_reqs=8, max_num_batched_tokens=64, enable_lora=True,
                             lora_capture_sizes=[8, 4])
    assert explicit.lora_capture_sizes == (4, 8)


def test_explain_names_the_lora_dimension():
    table = DispatchTable("FULL_AND_PIECEWISE", [1, 2, 4, 8], max_num_reqs=8, max_num_batched_tokens=64,
                          enable_lora=True, lora_capture_sizes=[4])
    text = str(table.explain(2, 2, 1, has_lora=True))
    assert "with LoRA adapters" in text and "FULL(t=4,r=4,q=1,lora)" in text and "accepted" in text
    assert "exceeds the largest LoRA graph (4 tokens)" in str(table.explain(2, 6, None, has_lora=True))
    plain = BatchExecutionDescriptor(CUDAGraphMode.FULL, 4, 4, 1)
    assert plain.misfit(2, 2, 1, has_lora=True) == "graph captured without LoRA, the batch has adapters"
    assert not plain.fits(2, 2, 1, has_lora=True)
    with pytest.raises(ValueError, match="has_lora"):
        BatchExecutionDescriptor(CUDAGraphMode.FULL, 4, 4, 1, has_lora=1)  # type: ignore[arg-type]
    no_lora = DispatchTable("FULL", [1, 2], max_num_reqs=2, max_num_batched_tokens=8)
    assert "enable_lora is off" in str(no_lora.explain(1, 1, 1, has_lora=True))
