"""tools/compile_check.py: kernels the interpreter runs but the compiler refuses are caught on a CPU.

The recorded launches of a kernel that retypes a loop variable (int32 loop, then an int64 one
sharing its name: the interpreter runs it, `triton.compile` refuses it) fail the compile phase;
the same kernel with distinct loop variables compiles. The compile phase runs in a subprocess
without TRITON_INTERPRET, as the tool requires."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from graphrunner.kernels import HAS_TRITON

KERNEL = """
import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, n, m, BLOCK: tl.constexpr):
    todo = tl.load(x_ptr).to(tl.int32)
    for {a} in range(0, n * todo, BLOCK):
        todo = todo + 1
    if todo != 0:
        end = tl.load(x_ptr + 1).to(tl.int64) + m
        for {b} in range(0, end, BLOCK):
            tl.store(x_ptr + {b} + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.int64))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("names, fails", [(("i", "i"), True), (("i", "j"), False)])
def test_compile_phase_catches_what_the_interpreter_accepts(tmp_path, names, fails):
    from graphrunner_tools.compile_check import _launch_record

    (tmp_path / "kernel_mod.py").write_text(textwrap.dedent(KERNEL.format(a=names[0], b=names[1])))
    sys.path.insert(0, str(tmp_path))
    try:
        import kernel_mod

        x = torch.zeros(64, dtype=torch.int64)
        rec = _launch_record(kernel_mod.kernel.fn, (x, 4, 8), {"BLOCK": 16})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kernel_mod", None)
    assert rec["sig"] == {"x_ptr": "*i64", "n": "i32", "m": "i32", "BLOCK": "constexpr"}
    launches = tmp_path / "launches.json"
    launches.write_text(json.dumps([rec]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "graphrunner_tools.compile_check", "compile", "--out", str(launches)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) == fails, done.stdout + done.stderr
    assert ("1 of 1 launches failed" in done.stdout) == fails, done.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_tensor_descriptor_arguments_are_recorded_as_descriptor_types():
    """A kernel taking triton.tools.tensor_descriptor.TensorDescriptor arguments (sample/greedy_head.py's
    descriptor kernel) records them as `tensordesc<dtype[box]>`, the type triton.compile takes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from graphrunner.sample.greedy_head import _head_argmax_persistent_kernel
    from graphrunner_tools.compile_check import _launch_record

    x, w = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16)
    parts = [torch.zeros(4, 2, dtype=d) for d in (torch.float32, torch.int32, torch.int32)]
    args = (TensorDescriptor.from_tensor(x, [16, 32]), TensorDescriptor.from_tensor(w, [32, 32]), *parts, 4, 64, 32, 2)
    consts = {"BM": 16, "BN": 32, "BK": 32, "IEEE": False}
    rec = _launch_record(_head_argmax_persistent_kernel.fn, args, consts)
    assert rec["sig"]["x_desc"] == "tensordesc<bf16[16, 32]>"
    assert rec["sig"]["w_desc"] == "tensordesc<bf16[32, 32]>"
    assert rec["sig"]["max_ptr"] == "*fp32" and rec["sig"]["num_programs"] == "i32"


SPECIALIZED = """
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_dyn"])
def kernel(x_ptr, one, n16, n17, n_dyn, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs * one, tl.load(x_ptr + offs) + n16 + n17 + n_dyn)
"""

PIPELINED = """
import triton
import triton.language as tl


@triton.jit
def kernel(a_ptr, b_ptr, c_ptr, K, stride_a, stride_b, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * stride_a + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_b + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)
"""


def _import_kernel(tmp_path, source: str):
    (tmp_path / "spec_mod.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(tmp_path))
    try:
        import spec_mod

        return spec_mod.kernel
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("spec_mod", None)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_launches_are_specialized_as_on_a_gpu(tmp_path):
    """Triton's launch rule: an int equal to 1 becomes the constant 1, 16-divisible ints and 16-byte-aligned
    tensors carry the divisibility hint, a do_not_specialize argument neither; num_stages is kept."""
    from graphrunner_tools.compile_check import _launch_record

    kernel = _import_kernel(tmp_path, SPECIALIZED)
    decorator = getattr(kernel, "kwargs", None) or {"do_not_specialize": getattr(kernel, "do_not_specialize", ())}
    x = torch.zeros(64, dtype=torch.float32)
    rec = _launch_record(kernel.fn, (x, 1, 32, 17, 48), {"BLOCK": 16, "num_stages": 3}, decorator)
    assert rec["sig"] == {"x_ptr": "*fp32", "one": "constexpr", "n16": "i32", "n17": "i32", "n_dyn": "i32",
                          "BLOCK": "constexpr"}
    assert rec["consts"] == {"one": 1, "BLOCK": 16}
    assert rec["attrs"] == {"0": [["tt.divisibility", 16]], "2": [["tt.divisibility", 16]]}
    assert rec["options"] == {"num_warps": 4, "num_stages": 3}
    offset = _launch_record(kernel.fn, (x[1:], 2, 32, 17, 48), {"BLOCK": 16}, decorator)
    assert "0" not in offset["attrs"] and offset["sig"]["one"] == "i32"  # 4-byte offset: no hint; 2 stays an int


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_resources_report_the_pipeline_depth_num_stages_asks_for(tmp_path):
    """`compile --resources` on a GEMM loop: num_stages 3 multi-buffers its A / B loads (depth >= 2), num_stages
    1 does not; registers come from ptxas."""
    from graphrunner_tools.compile_check import _launch_record

    kernel = _import_kernel(tmp_path, PIPELINED)
    a, b, c = (torch.zeros(64, 64, dtype=torch.float16) for _ in range(3))
    consts = {"BM": 64, "BN": 64, "BK": 32}
    launches = tmp_path / "launches.json"
    launches.write_text(json.dumps([_launch_record(kernel.fn, (a, b, c, 64, 64, 64), consts | {"num_stages": s})
                                    for s in (3, 1)]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])  # spec_mod.py is there
    done = subprocess.run([sys.executable, "-m", "graphrunner_tools.compile_check", "compile", "--resources",
                           "--out", str(launches)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [line for line in done.stdout.splitlines() if line.startswith("spec_mod.kernel")]
    assert len(reports) == 2, done.stdout
    three, one = (json.loads(line[line.index("} {") + 2:]) for line in reports)  # the printed resources
    assert max(three["buffers"], default=0) >= 2 and max(one["buffers"], default=0) <= 1, done.stdout
    assert three["shared"] > one["shared"]
    assert three["registers"] and three["spill_bytes"] == 0
