"""Compile every Triton kernel a CPU test run launches, for a GPU target, without a GPU.

The Triton interpreter (TRITON_INTERPRET=1, what CI runs) executes kernels as Python and accepts
code the real compiler refuses (a loop variable retyped between loops, say), so a kernel can pass
every CPU test and fail its first launch on the device. This tool closes that gap on the CPU:

    TRITON_INTERPRET=1 python -m graphrunner_tools.compile_check record -- -q tests/test_x.py
    python -m graphrunner_tools.compile_check compile [--arch 90]

`record` runs pytest with the interpreter and writes each launch's kernel, argument types and
constexpr values to a JSON file (--out, default /tmp/graphrunner_launches.json); `compile`
(run WITHOUT the interpreter) compiles each distinct one with triton.compile for the
architecture (sm_90: H100/H200) and exits non-zero on any failure, printing the compiler's error.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys

_DTYPES = {"torch.float32": "fp32", "torch.int32": "i32", "torch.int64": "i64", "torch.bool": "i1",
           "torch.uint8": "u8", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int8": "i8",
           "torch.int16": "i16"}


def _launch_record(fn, args: tuple, kwargs: dict) -> dict:
    """A launch's kernel, Triton signature and constexprs (as triton.compile takes them)."""
    import torch

    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | kwargs  # trailing args may be defaulted
    sig: dict[str, str] = {}
    consts: dict[str, object] = {}
    for name in params:
        value = bound.get(name)
        if "constexpr" in str(params[name].annotation) or value is None:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _DTYPES[str(value.dtype)]
        elif type(value).__name__ == "TensorDescriptor":  # triton.tools.tensor_descriptor: dtype and box
            box = ", ".join(str(int(b)) for b in value.block_shape)
            sig[name] = f"tensordesc<{_DTYPES[str(value.base.dtype)]}[{box}]>"
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name], consts[name] = "constexpr", value
    return {"module": fn.__module__, "name": fn.__name__, "sig": sig, "consts": consts,
            "num_warps": kwargs.get("num_warps", 4)}


def record(out: str, pytest_args: list[str]) -> int:
    import pytest
    from triton.runtime import interpreter

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("record runs the tests under the interpreter: set TRITON_INTERPRET=1")
    seen: dict[str, dict] = {}
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, **kwargs):
        rec = _launch_record(self.fn, args, kwargs)
        seen[json.dumps(rec, sort_keys=True, default=str)] = rec
        return run(self, *args, grid=grid, **kwargs)

    interpreter.InterpretedFunction.run = recording
    rc = pytest.main(pytest_args)
    with open(out, "w") as f:
        json.dump(list(seen.values()), f, default=str)
    print(f"recorded {len(seen)} distinct launches in {out}")
    return int(rc)


def compile_all(path: str, arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile needs the real compiler: unset TRITON_INTERPRET")
    with open(path) as f:
        records = json.load(f)
    failures = 0
    for rec in records:
        kernel = getattr(importlib.import_module(rec["module"]), rec["name"])
        try:
            triton.compile(ASTSource(kernel, rec["sig"], constexprs=rec["consts"]),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": rec["num_warps"]})
        except Exception as e:  # the compiler's own message names the line
            failures += 1
            print(f"FAIL {rec['module']}.{rec['name']} {rec['consts']}: {type(e).__name__}: {str(e)[:1500]}")
    print(f"{failures} of {len(records)} launches failed to compile for sm_{arch}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="compile_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["record", "compile"])
    ap.add_argument("--out", default="/tmp/graphrunner_launches.json")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    return record(args.out, pytest_args) if args.phase == "record" else compile_all(args.out, args.arch)


if __name__ == "__main__":
    sys.exit(main())
