"""Test setup shared by every test module.

TRITON_INTERPRET must be set before any `@triton.jit` decorator runs, so it is set
here, at import time of the first conftest, whenever no GPU is present.
"""

import gc
import os
import sys

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    # The tests' CPU tensors are tiny (a 128-wide model, a few rows of logits): intra-op threads
    # gain nothing there, and on a 2-core machine with anything else running their spin-waits
    # made each op several times slower (a tiny-llama step 5-8x). Processes the tests start
    # (gloo ranks, launched workers) set their own thread counts as before.
    torch.set_num_threads(1)

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interp import install

    install()  # nested @triton.jit calls skip the launch's redundant re-patching (tests/triton_interp.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Graph vs eager at scale on a GPU (tools/gpu_suite.sh scale): >= 2,000 workloads per property.
settings.register_profile("scale", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_finish(session):
    _freeze_survivors()


_MANY_NEW_MODULES = 100  # a test that imported this many modules (dynamo, transformers, xgrammar on first use)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if nextitem is not None and getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _freeze_survivors()
    elif len(sys.modules) >= _frozen_at["modules"] + _MANY_NEW_MODULES:
        # The rest of the module would walk the new imports at every collection (~0.1 s each,
        # dozens in a bench module). What its fixtures hold is frozen too: it is freed by
        # reference counting as before, only a reference cycle in it would stay allocated.
        _freeze_survivors()
    return result


_frozen_at = {"modules": 0}


def _freeze_survivors():
    """Between test modules (their fixtures torn down): what survives a collection is frozen.

    Imports (torch, dynamo, sympy: ~400k objects) and session-long caches outlive every
    module; each full collection walked them again, and runners, bench tools and shutdowns
    collect explicitly (~0.3 s each, ~90 s of a CI run). Frozen, a collection walks only what
    the current module made. Frozen objects still die when their last reference goes; only a
    reference cycle among them would stay (none is expected of what outlives a module).
    """
    gc.collect()
    gc.freeze()
    _frozen_at["modules"] = len(sys.modules)


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """The device tests run on: CUDA when present, else CPU."""
    return torch.device("cuda" if _HAS_CUDA else "cpu")
