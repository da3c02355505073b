"""capture: CUDA-graph modes, batch descriptors and the dispatch table (model-agnostic).

Keep this file free of torch: `modes`, `descriptor` and `dispatch` are pure standard
library so configs, the inspection tool and hypothesis tests import them without a GPU
stack (tests/capture/test_dispatch.py enforces it). Torch-based modules of this package (FULL
capture, PIECEWISE backend, pool, report) are imported by their own module path.
"""

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import CandidateVerdict, DispatchTable, Explanation, default_capture_sizes, validate_capture_sizes
from capture.modes import (
    DEFAULT_MODE,
    MODE_RULES,
    AttentionCGSupport,
    CUDAGraphMode,
    ModeRule,
    Resolution,
    resolve_mode,
    supported_modes,
)

__all__ = [
    "AttentionCGSupport",
    "BatchExecutionDescriptor",
    "CUDAGraphMode",
    "CandidateVerdict",
    "DEFAULT_MODE",
    "DispatchTable",
    "Explanation",
    "MODE_RULES",
    "ModeRule",
    "Resolution",
    "default_capture_sizes",
    "resolve_mode",
    "supported_modes",
    "validate_capture_sizes",
]
