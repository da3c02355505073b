"""Tensor, pipeline and data parallelism on torch.distributed (NCCL on GPUs, gloo on CPUs)."""
