"""SharedStorageConnector: KV blocks through a directory (vLLM's example connector).

A producer writes every prompt block it computes to `shared_storage_path`, one file per block named
by its prefix hash (`base.prefix_hashes`; a prompt's partial last block by `base.tail_digest`, once
the prompt is complete). A consumer's scheduler side, admitting a request, reads the blocks that
follow its local prefix-cache hit from the directory, as long as they chain, and verifies each; the
runner copies them into the paged cache before the step, so only the rest of the prompt is
prefilled: with every block there, only its last token (the step samples after it). Two processes,
or two machines sharing a file system, share a directory.

A block file is `MAGIC`, an 8-byte little-endian header length, a JSON header, then the payload:
the block's K and V of every layer, [num_layers, 2, block_size, kv_heads, head_dim] in the cache's
dtype. The header names the model (`base.model_identity`), the geometry, the dtype, the block's
hash and keys (its token ids, with an image's or prompt embeddings' content hash at the positions
it fills: `base.request_keys`), and the payload's length and sha256. A file that is missing, truncated, corrupt
(checksum), written for other tokens or another model, or of another geometry or dtype is not
loaded: the chain stops before it (logged), and the request computes the rest of its prompt.
A different block size names different blocks (their tokens differ), so it simply misses.

Blocks are verified when they are matched, by the scheduler side, and handed to the runner in the
step's metadata: once a request is planned with loaded tokens, nothing can fail under it.
Files are written to a temporary name and renamed, so a reader never sees a half-written block.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphrunner.config import KVTransferConfig
from graphrunner.kv_shape import KVCacheShape
from graphrunner.kv_transfer.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    block_keys,
    block_runs,
    connector_extra,
    gather_blocks,
    logger,
    request_keys,
    scatter_blocks,
)

MAGIC = b"GRKVBLK1"
VERSION = 1
_LEN = struct.Struct("<Q")
_EXTRA_KEYS = ("shared_storage_path",)


def storage_path(config: KVTransferConfig) -> Path:
    """`kv_connector_extra_config["shared_storage_path"]`, created if missing; ValueError without it."""
    extra = connector_extra(config, _EXTRA_KEYS)
    path = extra.get("shared_storage_path")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"SharedStorageConnector needs kv_connector_extra_config['shared_storage_path'] (a "
                         f"directory), got {path!r}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    return root


def block_file(root: Path, block_hash: str) -> Path:
    return root / f"{block_hash}.kvblock"


def _header(shape: KVCacheShape, model_id: str) -> dict[str, Any]:
    return {"version": VERSION, "model": model_id, "dtype": str(shape.dtype).removeprefix("torch."),
            "block_size": shape.block_size, "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim}


def encode_block(shape: KVCacheShape, model_id: str, block_hash: str, tokens: Sequence[int | str],
                 data: torch.Tensor) -> bytes:
    """A block file's bytes; `data`: [num_layers, 2, block_size, kv_heads, head_dim] on the host."""
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    header = _header(shape, model_id) | {"hash": block_hash, "tokens": block_keys(tokens),
                                          "payload_bytes": len(payload),
                                          "sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(head)) + head + payload


def decode_block(raw: bytes, shape: KVCacheShape, model_id: str, block_hash: str,
                 tokens: Sequence[int | str]) -> torch.Tensor:
    """The payload of a block file, [num_layers, 2, block_size, kv_heads, head_dim]; ValueError saying
    why when the file is not this block of this model in this geometry."""
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + _LEN.size:
        raise ValueError("not a KV block file (bad magic)")
    (head_len,) = _LEN.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(raw[start:start + head_len])
    except ValueError:
        raise ValueError("truncated or corrupt header") from None
    expected = _header(shape, model_id)
    for key, want in expected.items():
        if header.get(key) != want:
            raise ValueError(f"{key}={header.get(key)!r} does not match this instance's {want!r}")
    if header.get("hash") != block_hash or header.get("tokens") != block_keys(tokens):
        raise ValueError("written for other tokens (foreign file)")
    payload = raw[start + head_len:]
    if len(payload) != header.get("payload_bytes"):
        raise ValueError(f"truncated: {len(payload)} of {header.get('payload_bytes')} payload bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("checksum mismatch (corrupt payload)")
    s = shape
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(s.dtype).reshape(
        s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim)


@dataclass
class _Load:
    req_id: str
    block_ids: list[int]
    data: torch.Tensor  # [num_layers, 2, n, block_size, kv_heads, head_dim], host


@dataclass
class _Save:
    req_id: str
    block_ids: list[int]
    hashes: list[str]
    tokens: list[list[int | str]]  # each block's keys (`base.block_keys`)


@dataclass
class SharedStorageMetadata:
    """One step's work for the runner: verified blocks to load, computed blocks to save."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


class PrefixBlockScheduler(KVConnectorScheduler):
    """Matches waiting requests' blocks in a block store, chained from the local prefix-cache hit
    (consumer), and plans the saves of every prompt block computed, the partial last one with the
    prompt's last chunk (producer). Subclasses say where a block comes from (`fetch_block`) and may
    ask to wait for blocks on their way (`in_flight`)."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str) -> None:
        super().__init__(config, shape, model_id)
        # request id -> its verified blocks (as `block_runs`) and their hashes, until admitted
        self._matched: dict[str, tuple[list[torch.Tensor], list[str]]] = {}
        self._loads: list[_Load] = []
        self._saved: dict[str, int] = {}  # prefilling request id -> prompt blocks planned for saving so far
        self._asked: set[str] = set()  # waiting request ids already counted in the hit rate
        self.num_rejected_blocks = 0  # store entries found but refused (logged)

    def fetch_block(self, req: Any, index: int, block_hash: str, tokens: Sequence[int | str]) -> torch.Tensor | None:
        """Block `index` of `req` ([num_layers, 2, block_size, kv_heads, head_dim]), verified, or None
        where the chain stops (missing or refused: logged, counted in `num_rejected_blocks`)."""
        raise NotImplementedError

    def in_flight(self, req: Any, block_hash: str) -> bool:
        """Whether block `block_hash`, the first `req` misses, is on its way (admission then waits for it:
        `get_num_new_matched_tokens` returns None). False: the request computes the rest."""
        return False

    def blocks_admitted(self, req: Any, hashes: Sequence[str]) -> None:
        """`req` was admitted with the blocks `hashes` loaded into the paged cache (the local prefix
        cache holds them from now on): a bounded store may let them go, and whatever else of `req`'s
        prompt it holds or receives later."""

    def get_num_new_matched_tokens(self, req: Any, num_computed_tokens: int) -> int | None:
        self._matched.pop(req.req_id, None)
        if not self.config.is_consumer:
            return 0
        if req.req_id not in self._asked:
            self._asked.add(req.req_id)
            self.note_query(req)
        # Every prompt token but the last (which the step computes, to sample after it), up to the end
        # of the prompt's last block, partial or not: a request whose whole prompt arrived runs one token,
        # a decode-shaped step, where loading whole blocks only left up to 16 tokens to prefill.
        bs, n = self.block_size, req.num_prompt_tokens
        first, limit = num_computed_tokens // bs, min(req.num_tokens - 1, n)
        stop = -(-limit // bs)  # the blocks holding tokens before `limit`
        if first >= stop:
            return 0
        hashes = self.prompt_hashes(req)
        tokens = request_keys(req)
        blocks: list[torch.Tensor] = []
        for i in range(first, stop):
            block = self.fetch_block(req, i, hashes[i], tokens[i * bs:min((i + 1) * bs, n)])
            if block is None:
                if self.in_flight(req, hashes[i]):
                    return None
                break
            blocks.append(block)
        if not blocks:
            return 0
        self._matched[req.req_id] = (block_runs(blocks), hashes[first:first + len(blocks)])  # [L, 2, n, bs, h, d]s
        return min((first + len(blocks)) * bs, limit) - first * bs

    def update_state_after_alloc(self, req: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        runs, hashes = self._matched.pop(req.req_id)
        n = -(-num_external_tokens // self.block_size)  # the last may be partly used
        self.blocks_admitted(req, hashes[:n])
        at = (req.num_computed_tokens - num_external_tokens) // self.block_size  # after the local hit
        for data in runs:
            take = min(data.shape[2], n)
            if take <= 0:
                break
            self._loads.append(_Load(req.req_id, list(block_ids[at:at + take]), data[:, :, :take]))
            at, n = at + take, n - take
        self.num_external_hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any, requests: dict[str, Any]) -> SharedStorageMetadata | None:
        meta = SharedStorageMetadata(loads=self._loads)
        self._loads = []
        if self.config.is_producer:
            # Only requests whose prompt is not saved yet are looked at: a decode step costs nothing here.
            for new in scheduler_output.scheduled_new_reqs:
                self._saved.setdefault(new.req_id, 0)
                self.prefill_started(requests[new.req_id])
            bs, scheduled = self.block_size, scheduler_output.num_scheduled_tokens
            for req_id in [r for r in self._saved if r in scheduled]:
                req = requests[req_id]
                n = req.num_prompt_tokens
                computed = min(req.num_computed_tokens + scheduled[req_id], n)
                full = computed // bs
                done = self._saved[req_id]
                # The prompt's partial last block too, once the step completes the prompt.
                end = -(-n // bs) if computed == n else full
                if end > done:
                    hashes = self.prompt_hashes(req) if end > full else self.hashes(req, full)
                    tokens = request_keys(req)
                    keys = [block_keys(tokens[i * bs:min((i + 1) * bs, n)]) for i in range(done, end)]
                    meta.saves.append(_Save(req_id, list(req.block_ids[done:end]), hashes[done:end], keys))
                if computed == n:
                    del self._saved[req_id]
                else:
                    self._saved[req_id] = full
        return meta if meta.loads or meta.saves else None

    def prefill_started(self, req: Any) -> None:
        """Producer: `req`'s prefill is scheduled for the first time (its blocks will be saved)."""

    def request_finished(self, req: Any) -> None:
        super().request_finished(req)
        self._matched.pop(req.req_id, None)
        self._saved.pop(req.req_id, None)
        self._asked.discard(req.req_id)

    def request_preempted(self, req: Any) -> None:
        """Its KV is dropped; what it had saved stays in the store (re-admitted, it is looked at anew)."""
        self._matched.pop(req.req_id, None)
        self._saved.pop(req.req_id, None)


class SharedStorageScheduler(PrefixBlockScheduler):
    """Reads blocks from the directory (module docstring)."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str) -> None:
        super().__init__(config, shape, model_id)
        self.root = storage_path(config)

    def fetch_block(self, req: Any, index: int, block_hash: str, tokens: Sequence[int | str]) -> torch.Tensor | None:
        path = block_file(self.root, block_hash)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("KV store: cannot read %s (%s); request %r computes it", path, e, req.req_id)
            return None
        try:
            return decode_block(raw, self.shape, self.model_id, block_hash, tokens)
        except ValueError as e:
            self.num_rejected_blocks += 1
            logger.warning("KV store: %s refused: %s; request %r computes its prompt from token %d", path, e,
                           req.req_id, index * self.block_size)
            return None


class PrefixBlockWorker(KVConnectorWorker):
    """Copies verified blocks into the paged cache; hands computed blocks to `store_blocks`."""

    num_saved_blocks = 0

    def load(self, metadata: SharedStorageMetadata) -> None:
        for entry in metadata.loads:
            scatter_blocks(self.kv_caches, entry.block_ids, entry.data)

    def save(self, metadata: SharedStorageMetadata) -> None:
        for entry in metadata.saves:
            todo = [i for i, h in enumerate(entry.hashes) if not self.stored(h)]
            if todo:
                data = gather_blocks(self.kv_caches, [entry.block_ids[i] for i in todo])
                self.store_blocks([entry.hashes[i] for i in todo], [entry.tokens[i] for i in todo], data,
                                  req_id=entry.req_id)

    def stored(self, block_hash: str) -> bool:
        """Whether the store holds `block_hash` already (it is not saved again)."""
        return False

    def store_blocks(self, hashes: list[str], tokens: list[list[int | str]], data: torch.Tensor,
                     req_id: str = "") -> None:
        """Save blocks of request `req_id`; `data` [num_layers, 2, n, block_size, kv_heads, head_dim] on the
        cache's device, gathered by the step's stream."""
        raise NotImplementedError


class SharedStorageWorker(PrefixBlockWorker):
    """Writes computed blocks to the directory, one file each (module docstring)."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str, device: torch.device) -> None:
        super().__init__(config, shape, model_id, device)
        self.root = storage_path(config)
        self.num_saved_blocks = 0

    def stored(self, block_hash: str) -> bool:
        return block_file(self.root, block_hash).exists()

    def store_blocks(self, hashes: list[str], tokens: list[list[int | str]], data: torch.Tensor,
                     req_id: str = "") -> None:
        data = data.cpu()  # waits for the step
        for j, block_hash in enumerate(hashes):
            raw = encode_block(self.shape, self.model_id, block_hash, tokens[j], data[:, :, j])
            path = block_file(self.root, block_hash)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(raw)
            os.replace(tmp, path)
            self.num_saved_blocks += 1


__all__ = ["PrefixBlockScheduler", "PrefixBlockWorker", "SharedStorageMetadata", "SharedStorageScheduler",
           "SharedStorageWorker", "block_file", "decode_block", "encode_block", "storage_path"]
