"""The CUDA driver fast path (capture.cuda_driver) and its torch fallback.

- CPU: without a device the binding is absent and every user falls back to torch.
- GPU: raw event/copy/graph-launch calls give exactly what torch's calls give; the
  output ring's raw path copies what the step wrote although the next step overwrites
  it at once; a graph replayed by cuGraphLaunch matches torch's replay; errors name the
  CUDA error.
"""

from __future__ import annotations

import pytest
import torch

from capture.cuda_driver import CudaDriver, CudaDriverError
from graphrunner.step.output import OutputRing

needs_driver = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_no_driver_without_cuda_and_the_ring_uses_torch():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert CudaDriver.load() is None
    ring = OutputRing(torch.device("cpu"), num_slots=2)
    layout = ring.layout({"x": torch.arange(4, dtype=torch.int32)})
    assert layout.copies is None
    assert ring.launch_layout(layout, lambda h: h["x"].tolist()).get() == [0, 1, 2, 3]


@pytest.mark.gpu
@needs_driver
def test_driver_errors_name_the_cuda_error():
    drv = CudaDriver.load()
    assert drv is not None
    with pytest.raises(CudaDriverError, match=r"cuTest failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        drv._check(1, "cuTest")


@pytest.mark.gpu
@needs_driver
@pytest.mark.parametrize("copy_stream", [True, False], ids=["copy-stream", "compute-stream"])
def test_raw_output_ring_copies_before_the_next_step_overwrites(copy_stream):
    """The raw path (cuEventRecord / cuStreamWaitEvent / cuMemcpyDtoHAsync) under a busy
    device, with the copies on the output copy stream or behind the step."""
    ring = OutputRing(torch.device("cuda"), copy_stream=copy_stream)
    src = torch.zeros(1 << 18, dtype=torch.int32, device="cuda")
    layout = ring.layout({"x": src, "head": src[:7]})
    assert layout.copies is not None, "contiguous sources take the raw path"
    outs = []
    for step in range(6):
        torch.cuda._sleep(1_000_000)  # the host runs ahead of the device
        src.fill_(step)
        outs.append(ring.launch_layout(layout, lambda h: (int(h["x"].min()), int(h["x"].max()), h["head"].tolist())))
        ring.guard_next_step()
        if len(outs) == 3:
            assert outs.pop(0).get() == (step - 2, step - 2, [step - 2] * 7)
    assert [o.get() for o in outs] == [(4, 4, [4] * 7), (5, 5, [5] * 7)]


@pytest.mark.gpu
@needs_driver
def test_non_contiguous_sources_fall_back_to_torch_copies():
    ring = OutputRing(torch.device("cuda"))
    src = torch.arange(40, dtype=torch.float32, device="cuda").reshape(8, 5)
    layout = ring.layout({"cols": src[:, :2]})
    assert layout.copies is None
    assert ring.launch_layout(layout, lambda h: h["cols"].tolist()).get() == src[:, :2].tolist()


@pytest.mark.gpu
@needs_driver
def test_driver_graph_launch_matches_torch_replay():
    from capture.full import FullGraph
    from capture.pool import GraphPool

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(1024, device=device)
    pool = GraphPool(device)
    graph = FullGraph("t", lambda: x.mul_(2).add_(1), pool)
    graph.capture(warmup=0)
    assert graph._launch is not None, "the driver launch is the default on CUDA"
    for _ in range(5):
        graph.replay()
    via_driver = x.clone()
    x.zero_()
    for _ in range(5):
        graph._graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(via_driver, x) and float(x[0]) == 31.0
    graph.release()
    assert graph._launch is None
