"""capture.jit_events: counting Triton specializations while a graph is captured."""

from __future__ import annotations

import pytest

from capture.jit_events import count_triton_jit


def test_counts_hook_calls_chains_the_previous_hook_and_restores_it():
    knobs = pytest.importorskip("triton").knobs
    seen = []
    knobs.runtime.jit_cache_hook = lambda *a, **k: seen.append(k) or None
    try:
        with count_triton_jit() as count:
            assert knobs.runtime.jit_cache_hook(key="k1") is None and knobs.runtime.jit_cache_hook(key="k2") is None
        assert count[0] == 2 and [k["key"] for k in seen] == ["k1", "k2"]  # the earlier hook still ran
        knobs.runtime.jit_cache_hook(key="after")
        assert count[0] == 2 and len(seen) == 3  # uninstalled: only the earlier hook
    finally:
        knobs.runtime.jit_cache_hook = None


@pytest.mark.gpu
def test_a_capture_report_counts_the_kernels_first_compiled_there():
    """A fresh process's first graph specializes kernels; the same graph captured again specializes none."""
    from graphrunner import LLM

    llm = LLM("builtin:tiny-llama", device="cuda", max_num_seqs=8, max_model_len=128, num_kv_blocks=64,
              cudagraph_capture_sizes=(1, 2))
    first = llm.runner.capture_report.records
    assert sum(r.jit_kernels for r in first) > 0
    report = llm.runner.capture_model()
    assert all(r.jit_kernels == 0 for r in report.records)


def test_records_each_specialization_with_its_kernel_name_and_time():
    import time
    from types import SimpleNamespace

    knobs = pytest.importorskip("triton").knobs
    from capture.jit_events import record_triton_jit

    before = time.monotonic()
    with record_triton_jit() as events:
        knobs.runtime.jit_cache_hook(key="k1", fn=SimpleNamespace(name="_paged_attn_kernel"))
    assert knobs.runtime.jit_cache_hook is None
    assert [name for _, name in events] == ["_paged_attn_kernel"] and before <= events[0][0] <= time.monotonic()
