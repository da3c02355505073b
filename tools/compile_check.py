"""Compile every Triton kernel a CPU test run launches, for a GPU target, without a GPU.

The Triton interpreter (TRITON_INTERPRET=1, what CI runs) executes kernels as Python and accepts
code the real compiler refuses (a loop variable retyped between loops, say), so a kernel can pass
every CPU test and fail its first launch on the device. This tool closes that gap on the CPU:

    TRITON_INTERPRET=1 python -m graphrunner_tools.compile_check record -- -q tests/step/test_runner.py
    python -m graphrunner_tools.compile_check compile [--arch 90]

`record` runs pytest with the interpreter and writes each launch's kernel, argument types and
constexpr values to a JSON file (--out, default /tmp/graphrunner_launches.json); `compile`
(run WITHOUT the interpreter) compiles each distinct one with triton.compile for the
architecture (sm_90: H100/H200) and exits non-zero on any failure, printing the compiler's error.

Each launch is specialized as a GPU launch would be (Triton's own rule: an int argument equal to 1
becomes the constant 1, a 16-divisible int or a 16-byte-aligned tensor gets the divisibility hint, unless
the kernel's `do_not_specialize` lists says otherwise) and keeps its num_warps / num_stages / maxnreg, so
the compiled code is the device's: contiguity hints decide vectorized loads and the cp.async pipelining.
`compile --resources` prints, per launch, the shared memory, the registers and spill bytes ptxas reports
and the depth of each multi-buffered shared-memory allocation (the software pipeline's buffers): an
occupancy and pipelining check without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import sys

_DTYPES = {"torch.float32": "fp32", "torch.int32": "i32", "torch.int64": "i64", "torch.bool": "i1",
           "torch.uint8": "u8", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int8": "i8",
           "torch.int16": "i16"}


_LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def _specialization(value, specialize: bool, align: bool) -> tuple[str, object] | None:
    """Triton's (type, key) for a launch argument on a GPU, or None where this Triton lacks the rule."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:  # another Triton: record types only
        return None
    return native_specialize_impl(CUDABackend, value, False, specialize, align)


def _launch_record(fn, args: tuple, kwargs: dict, decorator: dict | None = None) -> dict:
    """A launch's kernel, Triton signature, constexprs, divisibility hints (as triton.compile takes
    them: `attrs` keyed by the argument's index) and launch options. `decorator`: the @triton.jit
    keywords (do_not_specialize, do_not_specialize_on_alignment)."""
    import torch

    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | kwargs  # trailing args may be defaulted
    decorator = decorator or {}
    no_spec = set(decorator.get("do_not_specialize") or ())
    no_align = set(decorator.get("do_not_specialize_on_alignment") or ())
    sig: dict[str, str] = {}
    consts: dict[str, object] = {}
    attrs: dict[str, list] = {}
    for index, name in enumerate(params):
        value = bound.get(name)
        if "constexpr" in str(params[name].annotation) or value is None:
            sig[name], consts[name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor | int) and not isinstance(value, bool):
            spec = _specialization(value, name not in no_spec and index not in no_spec,
                                   name not in no_align and index not in no_align)
            if spec is not None and spec[0] == "constexpr":  # an int equal to 1
                sig[name], consts[name] = "constexpr", spec[1]
                continue
            if spec is not None and spec[1] == "D":
                attrs[str(index)] = [["tt.divisibility", 16]]
        if isinstance(value, torch.Tensor):
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
    options = {"num_warps": 4} | {k: kwargs[k] for k in _LAUNCH_OPTIONS if kwargs.get(k)}
    return {"module": fn.__module__, "name": fn.__name__, "sig": sig, "consts": consts, "attrs": attrs,
            "options": options}


def record(out: str, pytest_args: list[str]) -> int:
    import pytest
    from triton.runtime import interpreter

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("record runs the tests under the interpreter: set TRITON_INTERPRET=1")
    seen: dict[str, dict] = {}
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, **kwargs):
        rec = _launch_record(self.fn, args, kwargs, getattr(self, "kwargs", None))
        seen[json.dumps(rec, sort_keys=True, default=str)] = rec
        return run(self, *args, grid=grid, **kwargs)

    interpreter.InterpretedFunction.run = recording
    rc = pytest.main(pytest_args)
    with open(out, "w") as f:
        json.dump(list(seen.values()), f, default=str)
    print(f"recorded {len(seen)} distinct launches in {out}")
    return int(rc)


def resources(compiled, arch: int) -> dict[str, object]:
    """Shared memory (bytes), registers and spill bytes per thread (ptxas -v over the kernel's PTX,
    with Triton's bundled ptxas), and the depths of the multi-buffered shared allocations in its
    TTGIR (`memdesc<N x rows x cols x ...>`: N buffers, 1 for a pipeline one load deep)."""
    import subprocess
    import tempfile

    import triton

    found: dict[str, object] = {"shared": compiled.metadata.shared}
    # A multi-buffered allocation is a 3-D memdesc whose leading dimension counts the buffers.
    buffers = sorted({int(n) for n in re.findall(r"!ttg\.memdesc<(\d+)x\d+x\d+x", compiled.asm.get("ttgir", ""))})
    found["buffers"] = buffers
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if os.path.exists(ptxas) and "ptx" in compiled.asm:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            done = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx.name, "-o", os.devnull],
                                  capture_output=True, text=True)
        log = done.stderr
        registers = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores", log)
        found["registers"] = int(registers.group(1)) if registers else None
        found["spill_bytes"] = int(spills.group(1)) if spills else None
    return found


def compile_all(path: str, arch: int, report: bool = False) -> int:
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
        attrs = {(int(index),): hints for index, hints in rec["attrs"].items()}
        options = rec["options"]
        try:
            compiled = triton.compile(ASTSource(kernel, rec["sig"], constexprs=rec["consts"], attrs=attrs),
                                      target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as e:  # the compiler's own message names the line
            failures += 1
            print(f"FAIL {rec['module']}.{rec['name']} {rec['consts']}: {type(e).__name__}: {str(e)[:1500]}")
            continue
        if report:
            print(f"{rec['module']}.{rec['name']} {json.dumps(options)} {json.dumps(resources(compiled, arch))}")
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
    ap.add_argument("--resources", action="store_true",
                    help="compile: print each launch's shared memory, registers, spills and pipeline buffers")
    args = ap.parse_args(argv)
    if args.phase == "record":
        return record(args.out, pytest_args)
    return compile_all(args.out, args.arch, args.resources)


if __name__ == "__main__":
    sys.exit(main())
