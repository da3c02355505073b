"""The connector named by a `KVTransferConfig`: its scheduler side and its runner side."""

from __future__ import annotations

import torch

from graphrunner.config import KVTransferConfig
from graphrunner.kv_shape import KVCacheShape
from graphrunner.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from graphrunner.kv_transfer.cpu_offload import CpuOffloadScheduler, CpuOffloadWorker
from graphrunner.kv_transfer.p2p import NcclScheduler, NcclWorker
from graphrunner.kv_transfer.shared_storage import SharedStorageScheduler, SharedStorageWorker

# KVTransferConfig.kv_connector -> (scheduler side, runner side); config.KV_CONNECTORS names the same set.
CONNECTORS: dict[str, tuple[type[KVConnectorScheduler], type[KVConnectorWorker]]] = {
    "SharedStorageConnector": (SharedStorageScheduler, SharedStorageWorker),
    "CpuOffloadConnector": (CpuOffloadScheduler, CpuOffloadWorker),
    "NcclConnector": (NcclScheduler, NcclWorker),
}


def make_scheduler_connector(config: KVTransferConfig, shape: KVCacheShape, model_id: str,
                             device: torch.device | str = "cpu") -> KVConnectorScheduler:
    """The scheduler's side of `config.kv_connector`; `device`: the runner's (the NCCL connector's
    link shares it with the runner's side)."""
    cls = CONNECTORS[config.kv_connector][0]
    if cls is NcclScheduler:
        return NcclScheduler(config, shape, model_id, device)
    return cls(config, shape, model_id)


def make_worker_connector(config: KVTransferConfig, shape: KVCacheShape, model_id: str,
                          device: torch.device) -> KVConnectorWorker:
    """The runner's side of `config.kv_connector`."""
    return CONNECTORS[config.kv_connector][1](config, shape, model_id, device)


__all__ = ["CONNECTORS", "make_scheduler_connector", "make_worker_connector"]
