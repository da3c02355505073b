"""CompileCache: torch.compile's and Triton's on-disk caches, one folder per compiled configuration.

    cache = CompileCache.for_runner(config.compilation.compile_cache_dir, model_config, dtype, mode, backend, device)
    with cache.scope():       # compile, profile and capture here
        ...

What compilation produces (inductor's FX-graph and AOTAutograd caches, the Triton kernels
inductor generates and the project's own Triton kernels) is kept under
`root/<key>/`, where the key hashes everything that changes the generated code: the model's
shapes, the dtype, the graph mode, the compile backend, the device (type and compute
capability), torch's and Triton's versions, the project's version and a digest of its
sources. A second start of the same configuration then finds every artifact on disk and
compiles nothing (qwen2.5-0.5b: 48 s of a warm start went to recompiling what a cold start
had already compiled, for want of a stable cache folder).

An entry is trusted only as a whole: after a scope ends, `manifest.json` records every
file's size and SHA-256; a scope that finds a file missing, changed, or not in the manifest
(a run killed mid-compile) deletes the entry and compiles afresh.

Processes of one configuration share its entry. A scope holds a shared lock on `<key>.lock`
beside the entry for its whole length, and checks (and may delete) the entry only when it can
take that lock exclusively: with another process inside, the files it has not yet put in the
manifest are its work in progress, not the leftovers of a killed run. Without the lock, a second
engine starting on one machine deleted the entry under the first, whose Triton then failed to
read a kernel it had just compiled (FileNotFoundError on two H200s).

The folders are set for the length of a scope through torch's and Triton's own APIs, so the
user exports nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

logger = logging.getLogger("graphrunner.compile_cache")

MANIFEST = "manifest.json"
DEFAULT_ROOT = "~/.cache/graphrunner/compile"
_PACKAGES = ("graphrunner", "capture")


@cache
def source_digest() -> str:
    """SHA-256 over the project's Python sources (paths and contents): any code change is a new key."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent.parent
    for package in _PACKAGES:
        for path in sorted((here / package).rglob("*.py")):
            digest.update(str(path.relative_to(here)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _project_version() -> str | None:
    """The installed distribution's version (read here: importing the package would be an import circle)."""
    from importlib import metadata

    try:
        return metadata.version("graphrunner")
    except metadata.PackageNotFoundError:  # a bare checkout: the source digest still keys the code
        return None


def key_fields(model_config: Any, dtype: Any, mode: str, compile_backend: str, device: Any,
               rank: int = 0) -> dict[str, Any]:
    """Every input that changes the generated code, as JSON-ready values; `rank` keeps the ranks of
    a parallel run (whose shards differ) in entries of their own, none deleting another's files."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = None
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    is_config = dataclasses.is_dataclass(model_config) and not isinstance(model_config, type)
    shape = dataclasses.asdict(model_config) if is_config else dict(model_config)
    shape.pop("name", None)  # the same shapes under two names compile alike
    return {
        "model": shape, "dtype": str(dtype), "mode": mode, "compile_backend": compile_backend,
        "device": device.type, "capability": capability, "torch": torch.__version__, "triton": triton_version,
        "graphrunner": _project_version(), "sources": source_digest(), "rank": rank,
    }


def cache_key(fields: Mapping[str, Any]) -> str:
    """A short stable hash of `fields` (the folder name of their entry)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CompileCache:
    """One entry (folder) of the compile cache; `scope()` points torch and Triton at it."""

    def __init__(self, root: str | os.PathLike, fields: Mapping[str, Any]) -> None:
        self.fields = dict(fields)
        self.key = cache_key(self.fields)
        self.path = Path(root).expanduser() / self.key

    @classmethod
    def for_runner(cls, root: str | None, model_config: Any, dtype: Any, mode: str, compile_backend: str,
                   device: Any, rank: int = 0) -> CompileCache | None:
        """The entry of a runner's configuration; None when caching is off (root None or empty)."""
        if not root:
            return None
        return cls(root, key_fields(model_config, dtype, mode, compile_backend, device, rank))

    # ---- trust ------------------------------------------------------------------------
    def _files(self) -> dict[str, Path]:
        return {str(p.relative_to(self.path)): p for p in self.path.rglob("*")
                if p.is_file() and not p.name.startswith(MANIFEST) and p.parent.name != "locks"}

    @staticmethod
    def _sha256(path: Path) -> str:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()

    def verify(self) -> str | None:
        """Why the entry cannot be trusted, or None when every file matches its manifest (or it is empty)."""
        files = self._files()
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            return f"{len(files)} files without a manifest" if files else None
        try:
            manifest = json.loads(manifest_path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return "unreadable manifest"
        for name in sorted(set(files) | set(manifest)):
            if name not in manifest:
                return f"{name} is not in the manifest"
            if name not in files:
                return f"{name} is missing"
            size, digest = manifest[name]
            path = files[name]
            if path.stat().st_size != size or self._sha256(path) != digest:
                return f"{name} differs from its manifest"
        return None

    def prepare(self) -> None:
        """Make the entry trustworthy: delete it when `verify` finds a fault; create the folder."""
        if self.path.exists():
            fault = self.verify()
            if fault is not None:
                logger.warning("compile cache %s: %s; rebuilding it", self.path, fault)
                shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "fields.json").write_text(json.dumps(self.fields, indent=1, sort_keys=True, default=str))

    def write_manifest(self) -> None:
        files = {}
        for name, p in sorted(self._files().items()):
            try:
                files[name] = [p.stat().st_size, self._sha256(p)]
            except FileNotFoundError:  # another process's temporary file, renamed or removed meanwhile
                continue
        # One temporary name per process: ranks sharing the entry write their manifests at once, and
        # a shared name let one rank rename the other's file away (FileNotFoundError at start-up).
        tmp = self.path / f"{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"files": files}))
        tmp.replace(self.path / MANIFEST)  # atomic: a reader sees the old manifest or the new one

    @contextlib.contextmanager
    def _checked_and_shared(self) -> Iterator[None]:
        """The entry prepared when no other process is inside it (else taken as it is), then held
        under a shared lock (module docstring)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / f"{self.key}.lock", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                alone = False
            except OSError as e:  # a file system without locks: checked as before the lock existed
                logger.warning("compile cache %s: cannot lock %s (%s); not shared safely between processes",
                               self.path, lock.name, e)
                self.prepare()
                yield
                return
            if alone:
                self.prepare()
            # Waits only while another process checks the entry (it holds the lock exclusively then).
            fcntl.flock(lock, fcntl.LOCK_SH)
            if not alone:
                self.path.mkdir(parents=True, exist_ok=True)
                logger.info("compile cache %s: in use by another process; shared as it is", self.path)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ---- use --------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Path]:
        """Compile into (and load from) this entry for the length of the block; the manifest is
        written when the block ends without an error."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._checked_and_shared())
            stack.enter_context(_inductor_cache_dir(str(self.path / "inductor")))
            stack.enter_context(_triton_cache_dir(str(self.path / "triton")))
            yield self.path
        self.write_manifest()


@contextlib.contextmanager
def _inductor_cache_dir(path: str) -> Iterator[None]:
    """Inductor's FX-graph and AOTAutograd caches, and the Triton kernels it generates, under `path`."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with temporary_cache_dir(path):
        yield


@contextlib.contextmanager
def _triton_cache_dir(path: str) -> Iterator[None]:
    """The project's own Triton kernels under `path` (triton.knobs; older Triton has no knob and keeps its own)."""
    try:
        from triton import knobs
    except ImportError:
        yield
        return
    old = knobs.cache.dir
    knobs.cache.dir = path
    try:
        yield
    finally:
        knobs.cache.dir = old


__all__ = ["DEFAULT_ROOT", "CompileCache", "cache_key", "key_fields", "source_digest"]
