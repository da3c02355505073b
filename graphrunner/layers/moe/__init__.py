"""Mixture-of-experts layers: routing, the fused expert computation, and its reference.

`reference.py` is the torch implementation (CPU, tests, and the specification the Triton
kernels of `kernels.py` are tested against); `kernels.py` is the CUDA path (routing,
alignment, grouped GEMMs, top-k sum: five graph-safe launches; `fused_moe_available` says
where it serves); `layer.py` holds `FusedMoE`, the module a decoder layer owns, which picks
one of them once, by device.
"""
