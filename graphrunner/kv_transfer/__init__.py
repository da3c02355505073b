"""KV connectors: KV computed by one instance saved and loaded by another, or offloaded to host memory.

`LLM(kv_transfer_config={"kv_connector": NAME, "kv_role": ..., "kv_connector_extra_config": {...}})`
turns one on (`graphrunner.config.KVTransferConfig`); `base` describes the interface and where the
runner calls it. Connectors: `SharedStorageConnector` (shared_storage.py), `CpuOffloadConnector`
(cpu_offload.py). See docs/kv_transfer.md.
"""

from graphrunner.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, model_identity, prefix_hashes
from graphrunner.kv_transfer.factory import make_scheduler_connector, make_worker_connector

__all__ = ["KVConnectorScheduler", "KVConnectorWorker", "make_scheduler_connector", "make_worker_connector",
           "model_identity", "prefix_hashes"]
