"""`graphrunner bench throughput --runner pooling`: pooled prompts/s beside the generative prefill rate.

Both runs take the same prompts on the same model shape and graph mode: `LLM.embed` on a pooling
runner (prefill-only steps, no sampler), and `LLM.generate` with max_tokens=1 on a generative one
(prefill plus one sampled token), so the two prompt-token rates compare the step without and with
the sampler.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PoolingThroughputSpec:
    model: str = "builtin:qwen3-0.6b"
    num_prompts: int = 1024
    input_len: int = 256
    mode: str = "FULL_AND_PIECEWISE"
    dtype: str = "auto"
    device: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_kv_blocks: int | None = None
    compile_backend: str | None = None
    seed: int = 0


@dataclass
class PoolingThroughputResult:
    spec: PoolingThroughputSpec
    prompt_tokens: int
    pooling_seconds: float
    prefill_seconds: float

    @property
    def pooling_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.pooling_seconds

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds

    def to_dict(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec), "prompt_tokens": self.prompt_tokens,
                "pooling_seconds": self.pooling_seconds, "prefill_seconds": self.prefill_seconds,
                "pooling_prompts_per_s": self.spec.num_prompts / self.pooling_seconds,
                "pooling_tokens_per_s": self.pooling_tokens_per_s, "prefill_tokens_per_s": self.prefill_tokens_per_s}

    def text(self) -> str:
        s = self.spec
        return (f"{s.model} {s.mode}: {s.num_prompts} prompts x {s.input_len} tokens\n"
                f"pooling (embed):      {self.pooling_tokens_per_s:12.1f} prompt tokens/s "
                f"({s.num_prompts / self.pooling_seconds:.1f} prompts/s)\n"
                f"generative prefill:   {self.prefill_tokens_per_s:12.1f} prompt tokens/s (max_tokens=1)")


def run_pooling_throughput(spec: PoolingThroughputSpec) -> PoolingThroughputResult:
    from graphrunner import LLM, SamplingParams

    rng = np.random.default_rng(spec.seed)
    kw: dict[str, Any] = dict(dtype=spec.dtype, device=spec.device, max_num_seqs=spec.max_num_seqs,
                              max_num_batched_tokens=spec.max_num_batched_tokens, num_kv_blocks=spec.num_kv_blocks,
                              max_model_len=spec.input_len + 1, seed=spec.seed, enforce_eager=spec.mode == "NONE")
    if spec.mode != "NONE":
        kw["cudagraph_mode"] = spec.mode
        if spec.compile_backend is not None:
            kw["compile_backend"] = spec.compile_backend
    seconds = []
    for runner in ("pooling", "generate"):
        llm = LLM(spec.model, runner=runner, **kw)
        vocab = llm.vocab_size
        prompts = [rng.integers(0, vocab, spec.input_len).tolist() for _ in range(spec.num_prompts)]
        start = time.perf_counter()
        if runner == "pooling":
            outs: list = llm.embed(prompts)
        else:
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        if len(outs) != spec.num_prompts:
            raise RuntimeError(f"{runner}: {len(outs)} outputs for {spec.num_prompts} prompts")
        llm.shutdown()
    return PoolingThroughputResult(spec, spec.num_prompts * spec.input_len, seconds[0], seconds[1])
