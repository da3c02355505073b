"""`LLM.beam_search`: vLLM's offline beam search over the reference engine.

Each step extends every live beam of every prompt by one token: one `generate` call over all
beams (greedy, one token, the top 2 x beam_width logprobs). Every candidate (a beam plus one of
its top tokens) is scored by its length-penalised cumulative logprob; a candidate ending in EOS
is complete, the best `beam_width` others live on. The prefix cache keeps the beams' shared
prefixes, so a step prefills little more than each beam's last block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphrunner.engine.prompts import split_prompts
from graphrunner.protocol import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search settings: `beam_width` beams, up to `max_tokens` new tokens each.

    `length_penalty` divides a beam's cumulative logprob by its length (prompt included) to
    this power; `temperature` scales the logits the logprobs come from (0: unscaled)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (prompt and output), per output token its logprobs, the cumulative
    logprob of the output, and `text`, the decode of every token (None without a tokenizer)."""

    tokens: list[int]
    logprobs: list[dict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's beam score: cumulative logprob over length ** length_penalty (a final EOS not counted)."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


def run_beam_search(llm: Any, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """`LLM.beam_search` (module docstring)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    _, token_prompts = split_prompts(prompts, llm.tokenizer)
    eos = frozenset(llm.runner.eos_token_ids)
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * width, ignore_eos=True)
    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(map(int, p)))] for p in token_prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in token_prompts]

    def key(beam: BeamSearchSequence) -> float:
        return beam_score(beam, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        beams = [beam for group in live for beam in group]
        if not beams:
            break
        results = iter(llm.generate([{"prompt_token_ids": b.tokens} for b in beams], step_params, use_tqdm=use_tqdm))
        for i, group in enumerate(live):
            candidates = []
            for beam in group:
                top = next(results).outputs[0].logprobs
                if not top:
                    continue  # max_model_len reached: the beam cannot grow
                for token, lp in top[0].items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top[0]],
                                             beam.cum_logprob + lp.logprob)
                    if token in eos and not params.ignore_eos:
                        new.finish_reason = "stop"
                        done[i].append(new)
                    else:
                        candidates.append(new)
            live[i] = sorted(candidates, key=key, reverse=True)[:width]
    outputs = []
    for i, group in enumerate(live):
        for beam in group:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(done[i] + group, key=key, reverse=True)[:width]
        for beam in best:
            beam.text = None if llm.tokenizer is None else llm.tokenizer.decode(beam.tokens)
        outputs.append(BeamSearchOutput(best))
    return outputs


__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_score", "run_beam_search"]
