"""The compile cache: one entry per configuration, keyed by every input that changes the generated
code; an entry is trusted only when every file matches its manifest; a warm start compiles nothing."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from graphrunner.compile_cache import CompileCache, cache_key, key_fields
from graphrunner.models.registry import BUILTIN_MODELS

TINY = BUILTIN_MODELS["builtin:tiny-llama"]


def _fields(**changes):
    base = dict(model_config=TINY, dtype=torch.float32, mode="FULL", compile_backend="inductor", device="cpu")
    base.update(changes)
    return key_fields(**base)


def test_the_key_is_stable():
    assert cache_key(_fields()) == cache_key(_fields())
    # The model's name is not a shape: two names of one architecture share the entry.
    assert cache_key(_fields(model_config=dataclasses.replace(TINY, name="other"))) == cache_key(_fields())


@pytest.mark.parametrize("field, change", [
    ("model", dict(model_config=dataclasses.replace(TINY, hidden_size=TINY.hidden_size * 2))),
    ("model", dict(model_config=dataclasses.replace(TINY, num_hidden_layers=TINY.num_hidden_layers + 1))),
    ("dtype", dict(dtype=torch.bfloat16)),
    ("mode", dict(mode="PIECEWISE")),
    ("compile_backend", dict(compile_backend="aot_eager")),
    ("rank", dict(rank=1)),
])
def test_each_code_changing_input_changes_the_key(field, change):
    changed = _fields(**change)
    assert changed[field] != _fields()[field]
    assert cache_key(changed) != cache_key(_fields())


@pytest.mark.parametrize("field", ["torch", "triton", "graphrunner", "sources", "device", "capability"])
def test_versions_device_and_sources_are_in_the_key(field):
    fields = _fields()
    assert field in fields
    assert cache_key({**fields, field: "something else"}) != cache_key(fields)


def test_sources_digest_follows_the_code(monkeypatch, tmp_path):
    """A changed source file is a new key (the version alone would not change within a release)."""
    import graphrunner.compile_cache as cc

    for package in ("graphrunner", "capture"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(cc, "__file__", str(tmp_path / "graphrunner" / "compile_cache.py"))
    cc.source_digest.cache_clear()
    try:
        before = cc.source_digest()
        (tmp_path / "capture" / "a.py").write_text("x = 2\n")
        cc.source_digest.cache_clear()
        assert cc.source_digest() != before
    finally:
        cc.source_digest.cache_clear()


def _entry(tmp_path) -> CompileCache:
    cache = CompileCache(tmp_path, _fields())
    with cache.scope() as path:
        (path / "inductor" / "fxgraph").mkdir(parents=True)
        (path / "inductor" / "fxgraph" / "entry").write_bytes(b"compiled code")
        (path / "triton").mkdir(exist_ok=True)
        (path / "triton" / "kernel.cubin").write_bytes(b"\x00kernel")
    return cache


def test_a_sound_entry_is_kept(tmp_path):
    cache = _entry(tmp_path)
    assert cache.verify() is None
    manifest = json.loads((cache.path / "manifest.json").read_text())["files"]
    assert {"inductor/fxgraph/entry", "triton/kernel.cubin", "fields.json"} <= set(manifest)
    with cache.scope():
        pass
    assert (cache.path / "inductor" / "fxgraph" / "entry").read_bytes() == b"compiled code"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "stray", "manifest"])
def test_a_corrupted_entry_is_rebuilt_not_trusted(tmp_path, damage, caplog):
    cache = _entry(tmp_path)
    entry = cache.path / "inductor" / "fxgraph" / "entry"
    if damage == "flip":
        entry.write_bytes(b"compiled cod3")  # same size, other bytes
    elif damage == "truncate":
        entry.write_bytes(b"compiled")
    elif damage == "delete":
        entry.unlink()
    elif damage == "stray":  # a run killed mid-compile left a file no manifest vouches for
        (cache.path / "inductor" / "half-written").write_bytes(b"...")
    else:
        (cache.path / "manifest.json").write_text("{not json")
    assert cache.verify() is not None
    with cache.scope() as path:
        assert not (path / "inductor" / "fxgraph").exists()  # nothing of the old entry survives
    assert "rebuilding it" in caplog.text
    assert cache.verify() is None


def test_scope_points_torch_and_triton_at_the_entry(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from triton import knobs

    outside_triton = knobs.cache.dir
    cache = CompileCache(tmp_path, _fields())
    with cache.scope() as path:
        assert cache_dir() == str(path / "inductor")
        assert knobs.cache.dir == str(path / "triton")
    assert knobs.cache.dir == outside_triton and cache_dir() != str(path / "inductor")


def test_off_when_there_is_nothing_to_keep():
    """CPU runners without inductor compile nothing: no folder is made for them."""
    from graphrunner import LLM

    llm = LLM("builtin:tiny-llama", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=32, num_kv_blocks=8, enforce_eager=False, cudagraph_mode="FULL",
              cudagraph_capture_sizes=(1, 2), compile_backend="eager")
    assert llm.runner.compile_cache_scope().__class__.__name__ == "nullcontext"
    assert llm.runner._compile_cache is None


@pytest.mark.slow
def test_warm_start_compiles_nothing_with_inductor(tmp_path):
    """The second runner of one configuration finds every inductor artifact in the entry the
    first one filled: no FX-graph cache miss (a cold compile costs ~25 s on 2 cores)."""
    from torch._dynamo.utils import counters

    from graphrunner import LLM

    def build() -> LLM:
        return LLM("builtin:tiny-llama", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
                   max_model_len=32, num_kv_blocks=8, enforce_eager=False, cudagraph_mode="PIECEWISE",
                   cudagraph_capture_sizes=(1, 2), compile_backend="inductor", compile_cache_dir=str(tmp_path))

    counters.clear()
    cold = build()
    assert counters["inductor"]["fxgraph_cache_miss"] > 0
    want = cold.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids
    cold.shutdown()
    counters.clear()
    warm = build()
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    assert counters["inductor"]["fxgraph_cache_hit"] > 0
    assert warm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids == want


def test_an_entry_another_process_is_compiling_into_is_not_deleted(tmp_path):
    """A second scope of the same configuration (another engine on the machine) finds files the first has
    not yet put in a manifest: they are its work in progress, kept; the last scope to end writes a
    manifest that vouches for all of them."""
    first, second = CompileCache(tmp_path, _fields()), CompileCache(tmp_path, _fields())
    with first.scope() as path:
        (path / "triton").mkdir(exist_ok=True)
        (path / "triton" / "kernel.source").write_bytes(b"just compiled")
        assert first.verify() is not None  # not in the manifest yet
        with second.scope():
            assert (path / "triton" / "kernel.source").read_bytes() == b"just compiled"
            (path / "triton" / "other.cubin").write_bytes(b"\x00")
    assert first.verify() is None
    alone = CompileCache(tmp_path, _fields())
    (alone.path / "stray").write_bytes(b"...")
    with alone.scope():  # nobody else inside: a stray file means a killed run, and the entry is rebuilt
        assert not (alone.path / "triton").exists()


def test_a_file_system_without_locks_still_gets_a_checked_entry(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    cache = _entry(tmp_path)
    (cache.path / "stray").write_bytes(b"...")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with cache.scope():  # checked (and rebuilt) as without the lock
        assert not (cache.path / "stray").exists()
    assert "cannot lock" in caplog.text and cache.verify() is None


def test_ranks_writing_their_manifests_at_once_do_not_collide(tmp_path, monkeypatch):
    """Two ranks sharing an entry end their scopes together: each writes its manifest under its own
    temporary name, another rank's half-written manifest is not a file of the entry, and a file renamed
    away while the manifest is hashed is left out rather than failing the start."""
    cache = _entry(tmp_path)
    (cache.path / "manifest.json.4242.tmp").write_text("{}")  # another rank's, about to be renamed
    (cache.path / "triton" / "tmp.pid_4242").write_bytes(b"moving")
    real = CompileCache._sha256

    def renamed_meanwhile(path):
        if path.name == "tmp.pid_4242":
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(CompileCache, "_sha256", staticmethod(renamed_meanwhile))
    cache.write_manifest()
    files = json.loads((cache.path / "manifest.json").read_text())["files"]
    assert "triton/tmp.pid_4242" not in files and not any(name.startswith("manifest") for name in files)
    assert "triton/kernel.cubin" in files
    assert not list(cache.path.glob(f"manifest.json.{os.getpid()}.tmp"))
