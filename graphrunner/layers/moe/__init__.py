"""Mixture-of-experts layers: routing, the fused expert computation, and its reference.

`reference.py` is the torch implementation (CPU, tests, and the specification the Triton
kernels of `kernels.py` are tested against); `layer.py` holds `FusedMoE`, the module a
decoder layer owns, which picks one of them once, by device.
"""
