"""docs/rejected_inputs.md is generated from the bad-input cases of the tests.

Every case of tests/engine/test_bad_input.py (SamplingParams, vocabulary-dependent params,
prompts) and of tests/step/test_runner.py (SchedulerOutput steps) is run here again and its
actual error message written into one table, so users see exactly what is checked. The
test fails when the file is stale; regenerate it with

    GRAPHRUNNER_UPDATE_DOCS=1 python -m pytest tests/project/test_rejected_inputs_doc.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from graphrunner.protocol import NewRequestData, SamplingParams, SchedulerOutput
from tests.engine import test_bad_input as bad
from tests.runner_driver import make_runner
from tests.step import test_runner as steps

DOC = Path(__file__).resolve().parents[2] / "docs" / "rejected_inputs.md"

HEADER = """# Rejected inputs

Every input below is refused with a `ValueError` before any state changes; the runner (and
the reference engine) keeps serving the other requests. The table is generated from the
test cases that check it (`tests/project/test_rejected_inputs_doc.py`; regenerate with
`GRAPHRUNNER_UPDATE_DOCS=1 python -m pytest tests/project/test_rejected_inputs_doc.py`), on the
built-in `tiny-llama` (vocabulary 2048) with the tests' limits (max_model_len 64 for the
engine cases, 128 for the runner cases, max_num_batched_tokens 64).

Coercions (accepted, documented): numpy integers and floats are accepted wherever Python
ints and floats are; tuples wherever lists are; `sample_tokens()` without a pending step
returns an empty output. Field types are checked on every step, a repeated decode batch (the
steady-decode plan) included. A KV block a request writes is its own: only full blocks of a
new request's computed prefix (`num_computed_tokens`, prefix caching) may be held by other
live requests. A temperature below 1e-5 (`GREEDY_TEMPERATURE`, vLLM's rule; denormals
included) is greedy. A step that raises hands its finished request ids back to the
scheduler: the next step carries them again. `LLM.generate`'s `prompts` is a prompt or an
ordered iterable of prompts (a generator too), each prompt's token ids an ordered sequence
(list, tuple, range, numpy array): None, sets, bytes and bytearrays are `TypeError`s naming
the type, as is an `abort_request` id that is not a str; calls after `shutdown()` raise
`RuntimeError`.
"""


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("the case was accepted")


def _sampling_rows() -> list[str]:
    return [f"| `SamplingParams({_kwargs(kw)})` | {_cell(_error(lambda kw=kw: SamplingParams(**kw)))} |"
            for kw, _ in bad.BAD_PARAMS]


def _kwargs(kw: dict) -> str:
    return _cell(", ".join(f"{k}={v!r}" for k, v in kw.items()))


def _engine_rows() -> list[str]:
    llm = bad.make_llm()
    rows = [f"| `generate(..., SamplingParams({_kwargs(kw)}))` | "
            f"{_cell(_error(lambda kw=kw: llm.generate(bad.PROMPTS, SamplingParams(**kw))))} |"
            for kw, _ in bad.VOCAB_PARAMS]
    for prompt, _ in bad.BAD_PROMPTS:
        shown = repr(prompt) if len(prompt) < 10 else f"list(range({len(prompt)}))"
        error = _error(lambda prompt=prompt: llm.generate([bad.PROMPTS[0], prompt], bad.GREEDY))
        rows.append(f"| prompt `{_cell(shown)}` | {_cell(error)} |")
    rows.append(f"| `NewRequestData(prompt_token_ids=[1, 2.5])` | "
                f"{_cell(_error(lambda: NewRequestData('r', [1, 2.5], bad.GREEDY, [0])))} |")
    return rows


def _nan_temperature() -> SamplingParams:
    params = SamplingParams(temperature=0.0)
    object.__setattr__(params, "temperature", float("nan"))  # changed behind the frozen dataclass
    return params


# Cases of tests/test_step_invariants.py, against the same live request (blocks 40..55).
STEP_CASES = {
    "block of another live request": dict(new=[steps._new("bad", [1, 2], blocks=[41])], sched={"bad": 2}),
    "block twice in one request": dict(new=[steps._new("bad", [1, 2], blocks=[3, 3])], sched={"bad": 2}),
    "block id past int64": dict(new=[steps._new("bad", [1, 2], blocks=[2**63])], sched={"bad": 2}),
    "SamplingParams changed after construction": dict(
        new=[NewRequestData("bad", [1, 2], _nan_temperature(), [3])], sched={"bad": 2}),
}


def _runner_rows() -> list[str]:
    runner = make_runner()
    live = [NewRequestData("live", [3, 1, 4, 1], SamplingParams(temperature=0.0), list(range(40, 56)))]
    steps._step(runner, new=live, sched={"live": 4})
    rows = []
    for case, (kwargs, _) in sorted(steps.BAD_STEPS.items()):
        if kwargs is None:
            so = SchedulerOutput(num_scheduled_tokens={"live": 1}, total_num_scheduled_tokens=7)
            error = _error(lambda so=so: runner.execute_model(so))
        else:
            error = _error(lambda kwargs=kwargs: steps._step(runner, **kwargs))
        rows.append(f"| {case} | {_cell(error)} |")
    for case, kwargs in sorted(STEP_CASES.items()):
        rows.append(f"| {case} | {_cell(_error(lambda kwargs=kwargs: steps._step(runner, **kwargs)))} |")
    hostile = SchedulerOutput(num_scheduled_tokens={"live": 1}, total_num_scheduled_tokens=1, finished_req_ids=None)
    rows.append(f"| finished ids None | {_cell(_error(lambda: runner.execute_model(hostile)))} |")
    return rows


def render() -> str:
    parts = [HEADER,
             "## SamplingParams (at construction)\n", "| input | error |", "|---|---|", *_sampling_rows(),
             "\n## The reference engine (`LLM.generate`), before anything is queued\n", "| input | error |",
             "|---|---|", *_engine_rows(),
             "\n## SchedulerOutput (`ModelRunner.execute_model`), before any state changes\n", "| case | error |",
             "|---|---|", *_runner_rows()]
    return "\n".join(parts) + "\n"


def test_rejected_inputs_doc_is_current():
    text = render()
    if os.environ.get("GRAPHRUNNER_UPDATE_DOCS") == "1":
        DOC.write_text(text)
    if not DOC.exists() or DOC.read_text() != text:
        pytest.fail(f"{DOC} is stale: regenerate it with GRAPHRUNNER_UPDATE_DOCS=1 python -m pytest {__file__}")
