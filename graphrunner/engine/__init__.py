"""Reference engine: block allocator, continuous-batching scheduler, offline `LLM` API.

It drives `graphrunner.ModelRunner` only through the runner's public API, as an outside
engine would; it doubles as the runner's end-to-end test harness and example.
"""

from graphrunner.engine.block_allocator import BlockAllocator
from graphrunner.engine.llm import LLM
from graphrunner.engine.request import Request, RequestOutput, RequestStatus
from graphrunner.engine.scheduler import Scheduler

__all__ = ["LLM", "BlockAllocator", "Request", "RequestOutput", "RequestStatus", "Scheduler"]
