"""Pooling under tensor parallelism: `LLM(runner="pooling", tensor_parallel_size=2)` (two gloo ranks
started by the LLM) embeds and classifies as one process does, from a checkpoint and from dummy weights."""

from __future__ import annotations

import torch

from graphrunner import LLM

PROMPTS = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 1], [3] * 11]
ARGS = dict(runner="pooling", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
            max_model_len=64, num_kv_blocks=32)


def _pooled(model: str, task: str, tp: int, **kw) -> torch.Tensor:
    llm = LLM(model, tensor_parallel_size=tp, **ARGS, **kw)
    try:
        outs = getattr(llm, task)(PROMPTS)
        values = [o.outputs.embedding if task == "embed" else o.outputs.probs for o in outs]
        return torch.tensor(values)
    finally:
        llm.shutdown()


def test_tp2_embeddings_and_class_logits_equal_one_process(embedder, classifier):
    for (path, _), task in ((embedder, "embed"), (classifier, "classify")):
        one, two = _pooled(str(path), task, 1), _pooled(str(path), task, 2)
        torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


def test_tp2_dummy_weights_equal_one_process_with_a_classifier_head():
    """Dummy weights are drawn per rank as the single process draws them, the replicated `score` head
    (which the causal LM the draw walks has not) included."""
    from graphrunner.pool.config import PoolerConfig

    head = PoolerConfig(pooling_type="LAST", normalize=False, num_labels=3)
    for config, task in ((None, "embed"), (head, "classify")):
        one = _pooled("builtin:tiny-llama", task, 1, pooler_config=config)
        two = _pooled("builtin:tiny-llama", task, 2, pooler_config=config)
        torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)
