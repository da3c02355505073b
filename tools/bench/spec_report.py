"""`bench spec`'s report: what each figure is, the targets, the Markdown tables.

The rows come from `spec_bench` (one `SpecRow` per model, batch size and runner, their
ratios over the plain runner already set by `spec_bench.add_ratios`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: spec_bench imports this module
    from graphrunner_tools.bench.spec_bench import SpecBenchResult, SpecRow

# The targets (what makes speculation worth turning on) are on this model at batch 1, k = 4, synthetic
# acceptance 0.8.
TARGET_MODEL = "builtin:llama-3.1-8b"
TARGET_DRAFT_MODEL = "builtin:llama-3.2-1b"
_TARGET_K, _TARGET_ACCEPTANCE = 4, 0.8

NOTES = (
    "step ms: median host wall time of one synchronous decode step, execute_model + sample_tokens (which ends "
    "with the D2H copy of the step's tokens), perf_counter, after the warm-up steps.",
    "GPU step ms: median device time of one decode step: CUDA events recorded on the compute stream just before "
    "and after execute_model, the stream held busy by a spin kernel while the host launches the step, so the span "
    "is the step's device work (state commit and upload copies, the FULL graph replay with verification and the "
    "drafter inside it), not host time and not the output copy. None on a CPU.",
    "tok/req/step: tokens emitted per request per timed decode step, from the ModelRunnerOutputs (accepted "
    "drafts + 1); expected (synthetic and draft rows): sum of a^i for i = 0..k.",
    "tok/s: tokens emitted over the timed steps / the sum of their step times (host wall).",
    "x plain: the same figure of the plain (k = 0) runner at the same model and batch size.",
    "drafter ms: SpeculativeStep.propose alone (the n-gram lookup; for a draft model its catch-up pass over the "
    "step's tokens and its k one-token passes), run eagerly on the last decode batch, timed like the GPU step "
    "(CUDA events, the spin kernel sized to outlast the drafter's own launches), median over the repeats; host "
    "wall time on a CPU. Inside the step it runs in the FULL graph, so it is part of the GPU step time too.",
    "drafts/step, accepted/step: draft slots verified and drafts accepted per request per verifying step "
    "(strict: the drafter's proposals, at most k; synthetic and draft rows: every slot); acceptance = accepted / "
    "verified. proposed/step: drafts the drafter proposed per request per timed step (a draft model proposes k "
    "whenever the request holds KV blocks for k tokens past its new one).",
    "draft rows: the draft-model drafter (dummy weights of its own) with synthetic acceptance, like the synthetic "
    "n-gram rows: what the draft model's passes cost at a given acceptance, not what it would propose.",
    "strict n-gram rows: real rejection sampling on dummy (random) weights over prompts made of a repeated random "
    "pattern: the acceptance reflects what the dummy model emits, not a trained model's.",
)


@dataclass
class Target:
    """A target on TARGET_MODEL at batch 1."""

    name: str
    bound: str
    measured: float | None
    met: bool | None
    note: str = ""


def _target_row(rows: list[SpecRow], method: str, draft: str | None = None) -> SpecRow | None:
    return next((r for r in rows if r.model == TARGET_MODEL and r.batch_size == 1 and r.method == method
                 and r.k == _TARGET_K and r.acceptance == _TARGET_ACCEPTANCE and r.draft_model == draft), None)


def _check(name: str, bound: str, row: SpecRow | None, figure: Callable[[SpecRow], float | None],
           ok: Callable[[float], bool], missing: str, note: str = "") -> Target:
    value = figure(row) if row is not None else None
    if value is None:
        return Target(name, bound, None, None, missing)
    return Target(name, bound, value, ok(value), note)


def targets(rows: list[SpecRow]) -> list[Target]:
    """The targets, on TARGET_MODEL at batch 1, k = 4, synthetic acceptance 0.8."""
    ngram, draft = _target_row(rows, "synthetic"), _target_row(rows, "draft", TARGET_DRAFT_MODEL)
    where = f"{TARGET_MODEL}, batch 1, k = {_TARGET_K}, acceptance {_TARGET_ACCEPTANCE}"
    missing = f"not measured: needs {where} and the plain runner"
    gpu = ngram.gpu_step_vs_plain if ngram is not None else None
    draft_note = "" if draft is None or draft.step_vs_plain is None else (
        f"step {draft.step_vs_plain:.2f}x plain" + ("" if draft.gpu_step_vs_plain is None
                                                    else f", GPU step {draft.gpu_step_vs_plain:.2f}x"))
    return [
        _check("verifying step (k = 4) / plain decode step", "<= 1.25x", ngram, lambda r: r.step_vs_plain,
               lambda v: v <= 1.25, missing, "" if gpu is None else f"GPU step ratio {gpu:.2f}x"),
        _check("n-gram, synthetic 0.8, k = 4: tokens/s / plain", ">= 2.5x", ngram, lambda r: r.tokens_per_s_vs_plain,
               lambda v: v >= 2.5, missing),
        _check(f"draft model {TARGET_DRAFT_MODEL}, synthetic 0.8, k = 4: tokens/s / plain", ">= 1.5x", draft,
               lambda r: r.tokens_per_s_vs_plain, lambda v: v >= 1.5,
               f"not measured: needs {where}, draft model {TARGET_DRAFT_MODEL} and the plain runner", draft_note),
    ]


# ---- Markdown ----------------------------------------------------------------------------
_COLUMNS = ("bs", "run", "graph", "step ms", "GPU step ms", "step x plain", "GPU x plain", "tok/req/step",
            "expected", "tok/s", "tok/s x plain", "drafter ms", "drafts/step", "accepted/step", "acceptance",
            "proposed/step")


def _f(x: float | None, fmt: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def _cells(r: SpecRow) -> list[str]:
    return [str(r.batch_size), r.run, r.descriptor, _f(r.step_ms), _f(r.gpu_step_ms), _f(r.step_vs_plain, ".2f", "x"),
            _f(r.gpu_step_vs_plain, ".2f", "x"), _f(r.tokens_per_step, ".2f"), _f(r.expected_tokens_per_step, ".2f"),
            _f(r.tokens_per_s, ".1f"), _f(r.tokens_per_s_vs_plain, ".2f", "x"), _f(r.drafter_ms),
            _f(r.drafts_per_step, ".2f"), _f(r.accepted_per_step, ".2f"), _f(r.acceptance_rate, ".1%"),
            _f(r.proposed_per_step, ".2f")]


def row_line(r: SpecRow) -> str:
    """One measured row, for the progress log."""
    return (f"  bs={r.batch_size:<4} {r.run:<34} {r.step['median']:8.3f} ms/step  {r.tokens_per_step:5.2f} "
            f"tok/req/step  {r.tokens_per_s:10.1f} tok/s  [{r.descriptor}]")


def _target_lines(result: SpecBenchResult) -> list[str]:
    lines = ["", f"Targets, {TARGET_MODEL} at batch 1:", "",
             "| target | bound | measured | met | note |", "|---|---|---:|---|---|"]
    return lines + [f"| {t.name} | {t.bound} | {_f(t.measured, '.2f', 'x')} | "
                    f"{'-' if t.met is None else 'yes' if t.met else 'NO'} | {t.note} |" for t in result.targets]


def spec_markdown(result: SpecBenchResult) -> str:
    spec, env = result.spec, result.env
    lines = [f"# bench spec on {env.get('device_name')} ({env.get('device')}), {env.get('dtype')}", "",
             f"{spec.mode} graphs; prompts of {spec.prompt_len} tokens; {spec.warmup} warm-up + {spec.steps} timed "
             f"decode steps, {spec.gpu_steps} GPU-timed steps, {spec.drafter_repeats} drafter repeats; dummy "
             f"weights; torch {env.get('torch')}, seed {spec.seed}", ""]
    rule = "|---:|---|---|" + "---:|" * (len(_COLUMNS) - 3)
    for model in spec.models:
        lines += [f"## {model}", ""]
        choice = result.drafts.get(model)
        if choice is not None:
            lines += [f"Draft model: {choice.note}", ""]
        lines += ["| " + " | ".join(_COLUMNS) + " |", rule]
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in result.rows if r.model == model]
        lines += [f"- {model} {r.run}: FAILED: {r.error}" for r in result.runners if r.model == model and r.error]
        if model == TARGET_MODEL:
            lines += _target_lines(result)
        lines.append("")
    if TARGET_MODEL not in spec.models:
        lines += [f"Targets are on {TARGET_MODEL} at batch 1: not measured in this run.", ""]
    lines += ["Figures:"] + [f"- {n}" for n in NOTES]
    return "\n".join(lines) + "\n"


__all__ = ["NOTES", "TARGET_DRAFT_MODEL", "TARGET_MODEL", "Target", "row_line", "spec_markdown", "targets"]
