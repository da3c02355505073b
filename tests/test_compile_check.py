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

    from graphrunner.sample.greedy_head import _head_argmax_tma_kernel
    from graphrunner_tools.compile_check import _launch_record

    x, w = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16)
    parts = [torch.zeros(4, 2, dtype=d) for d in (torch.float32, torch.int32, torch.int32)]
    args = (TensorDescriptor.from_tensor(x, [16, 32]), TensorDescriptor.from_tensor(w, [32, 32]), *parts, 4, 64, 32, 2)
    consts = {"BM": 16, "BN": 32, "BK": 32, "IEEE": False, "PERSISTENT": True}
    rec = _launch_record(_head_argmax_tma_kernel.fn, args, consts)
    assert rec["sig"]["x_desc"] == "tensordesc<bf16[16, 32]>"
    assert rec["sig"]["w_desc"] == "tensordesc<bf16[32, 32]>"
    assert rec["sig"]["max_ptr"] == "*fp32" and rec["sig"]["num_programs"] == "i32"
