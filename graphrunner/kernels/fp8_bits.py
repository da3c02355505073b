"""fp32 -> e4m3 rounding by integer operations, for kernels run by the Triton interpreter.

The interpreter's own fp32 -> fp8 conversion rounds ties up and loses the carry into the exponent
(124.9 became 64), so a kernel that quantizes to e4m3 (the fp8 linear layers, the fp8 KV cache)
takes its bits from `e4m3_bits` when interpreted; compiled for a GPU it keeps the hardware's
round-to-nearest-even cast. Both give the same bits (tests/model/test_fp8_kernels.py covers every
tie of the e4m3 grid).
"""

from __future__ import annotations

from graphrunner.kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def e4m3_bits(v):
        # v fp32 in [-448, 448] -> its e4m3fn bits (uint8), rounded to nearest even, by integer
        # operations only.
        b = v.to(tl.int32, bitcast=True)
        sign = (b >> 24) & 0x80
        a = b & 0x7FFFFFFF
        # Normal results (|v| >= 2^-6): drop 20 of fp32's 23 mantissa bits, ties to even; a carry
        # into the exponent is the right result (448 is the largest input, so none overflows).
        r = (a + 0x7FFFF + ((a >> 20) & 1)) & -1048576
        normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
        # Subnormal results are multiples of 2^-9: rint(|v| * 512), an exact product rounded once by
        # adding and removing 2^23. Its integer is the e4m3 encoding, 8 (2^-6) included.
        f = a.to(tl.float32, bitcast=True)
        sub = ((f * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        return (tl.where(a >= 0x3C800000, normal, sub) | sign).to(tl.uint8)
