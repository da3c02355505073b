"""Invariants of the runner's step validation under hostile SchedulerOutputs.

- A KV block a request writes is its own: a block held by another live request, given to
  two requests, or repeated within one is refused, naming the requests; only full blocks
  of a computed prefix (prefix caching) are shared.
- One set of rules on every path: a repeated decode batch (the steady-decode plan) accepts
  exactly what a general step accepts, field types included.
- Any value in any field is accepted or refused with ValueError (never TypeError,
  OverflowError or a numpy error), and a refused step changes nothing.
- Admission re-validates the SamplingParams it stores, however they were changed.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from graphrunner.state.rules import field_type_violation
from graphrunner.state.validation import _Invalid, _validate_vectorized, validate_reference
from tests.runner_driver import make_runner

GREEDY = SamplingParams(temperature=0.0)
BS = 4  # block_size of the runner below
LIVE = {"a": ([3, 1, 4, 1, 5, 9, 2, 6, 5], [0, 1, 2, 7]), "b": ([2, 7, 1, 8, 2, 8], [3, 4, 5, 6])}  # tokens, blocks


def _small_runner():
    return make_runner(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS, num_blocks=48)


def _admit_live(runner, blocks_of: dict[str, list[int]] | None = None) -> dict[str, int]:
    """Prefill LIVE (with `blocks_of` in place of its blocks); returns each request's num_computed_tokens."""
    so = SchedulerOutput()
    for rid, (tokens, blocks) in LIVE.items():
        so.scheduled_new_reqs.append(NewRequestData(rid, tokens, GREEDY, list((blocks_of or {}).get(rid, blocks))))
        so.num_scheduled_tokens[rid] = len(tokens)
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    runner.execute_model(so)
    runner.sample_tokens()
    return {rid: len(tokens) for rid, (tokens, _) in LIVE.items()}


@pytest.fixture(scope="module")
def live():
    runner = _small_runner()
    return runner, _admit_live(runner)


# ---- KV-block ownership ------------------------------------------------------------------


@st.composite
def block_steps(draw):
    """A step that finishes b or not, gives running requests new blocks and admits `n`,
    with block ids drawn from a small range so that they often collide."""
    ids = st.integers(0, 11)
    finish_b = draw(st.booleans())
    so = SchedulerOutput(finished_req_ids={"b"} if finish_b else set())
    for rid in ("a",) if finish_b else ("a", "b"):
        so.scheduled_cached_reqs.req_ids.append(rid)
        so.scheduled_cached_reqs.new_block_ids.append(draw(st.one_of(st.none(), st.lists(ids, max_size=2))))
        so.scheduled_cached_reqs.num_computed_tokens.append(len(LIVE[rid][0]))
        so.num_scheduled_tokens[rid] = 1
    if draw(st.booleans()):
        computed = draw(st.sampled_from([0, BS, 2 * BS]))  # a prefix-cache hit covers whole blocks
        blocks = draw(st.lists(ids, min_size=3, max_size=4))
        so.scheduled_new_reqs.append(NewRequestData("n", list(range(100, 112)), GREEDY, blocks, computed))
        so.num_scheduled_tokens["n"] = 12 - computed
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    return so


def _ownership_fault(so: SchedulerOutput) -> bool:
    """The rule, stated on the step: a block a request writes is held by no other request
    (after the step's removals, with the step's new blocks) and no request holds one twice."""
    held = {rid: list(blocks) for rid, (_, blocks) in LIVE.items() if rid not in so.finished_req_ids}
    written: dict[str, list[int]] = {rid: [] for rid in held}
    for rid, new in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.new_block_ids, strict=True):
        held[rid] += new or []
        written[rid] = list(new or [])  # appended after the last computed position: written
    for new_req in so.scheduled_new_reqs:
        held[new_req.req_id] = list(new_req.block_ids)
        written[new_req.req_id] = new_req.block_ids[new_req.num_computed_tokens // BS:]
    if any(len(set(blocks)) != len(blocks) for blocks in held.values()):
        return True
    return any(b in held[other] for rid, blocks in written.items() for b in blocks for other in held if other != rid)


def _accepts(check, *args) -> bool:
    try:
        check(*args)
    except (ValueError, _Invalid):
        return False
    return True


@settings(deadline=None)
@given(so=block_steps())
def test_a_block_a_request_writes_is_its_own(live, so):
    runner, _ = live
    fault = _ownership_fault(so)
    assert _accepts(validate_reference, runner.state, runner.limits, so) == (not fault)
    assert _accepts(_validate_vectorized, runner.state, runner.limits, so) == (not fault)
    if fault:
        with pytest.raises(ValueError, match=r"block id \d+ (belongs to live request|is also given to request"
                                             r"|appears twice|is one it already holds)"):
            validate_reference(runner.state, runner.limits, so)


def test_holders_follow_appends_and_removals(live):
    """BlockTables.holders counts, per block, the rows whose first num_blocks entries hold it."""
    runner, _ = live
    tables = runner.state.tables
    expected = np.zeros(tables.num_kv_blocks, dtype=np.int64)
    for row in range(tables.num_rows):
        np.add.at(expected, tables.table_np[row, : tables.num_blocks[row]], 1)
    assert tables.holders.tolist() == expected.tolist()
    assert expected.sum() == sum(len(blocks) for _, blocks in LIVE.values())


def _decode(computed: dict[str, int], new_block_ids=None) -> SchedulerOutput:
    rids = list(computed)
    return SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(rids, new_block_ids or [None] * len(rids), [computed[r] for r in rids]),
        num_scheduled_tokens=dict.fromkeys(rids, 1), total_num_scheduled_tokens=len(rids))


def _run(runner, so) -> dict[str, int]:
    runner.execute_model(so)
    out = runner.sample_tokens()
    return {rid: toks[0] for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True)}


# Room for every position up to max_model_len: hostile-value tests decode on for many steps.
ROOMY = {"a": list(range(0, 16)), "b": list(range(16, 32))}


def _steady_runner(runner=None, blocks_of=None):
    """A runner whose next decode of a and b reuses the steady-decode plan."""
    runner = runner or _small_runner()
    computed = _admit_live(runner, blocks_of)
    for _ in range(2):
        _run(runner, _decode(computed))
        computed = {rid: n + 1 for rid, n in computed.items()}
    assert runner.planner.plan is not None
    return runner, computed


def test_a_stolen_block_is_refused_on_the_steady_path_and_the_victim_decodes_on():
    runner, computed = _steady_runner()
    clean, clean_computed = _steady_runner()
    for steal in ([[4], None], [[8, 8], None], [[8], [8]]):  # b's block; twice in a; in a and in b
        with pytest.raises(ValueError, match=r"request '[ab]': block id \d+ (belongs to live request 'b'|"
                                             r"appears twice|is also given to request 'a')"):
            runner.execute_model(_decode(computed, steal))
    stolen = SchedulerOutput(scheduled_new_reqs=[NewRequestData("n", [1, 2, 3], GREEDY, [5])],
                             num_scheduled_tokens={"n": 3}, total_num_scheduled_tokens=3)
    with pytest.raises(ValueError, match="request 'n': block id 5 belongs to live request 'b'"):
        runner.execute_model(stolen)
    for _ in range(3):  # b's output is the one of a runner that never saw the bad steps
        assert _run(runner, _decode(computed)) == _run(clean, _decode(clean_computed))
        computed = clean_computed = {rid: n + 1 for rid, n in computed.items()}


def test_prefix_blocks_are_shared_and_freed_blocks_reused():
    """Prefix caching: a new request reads a's full, computed first blocks; blocks of a
    request finished in the same step go to a new one."""
    runner = _small_runner()
    _admit_live(runner)
    shared = LIVE["a"][1][:2]  # a's first two blocks: positions 0..7, computed
    so = SchedulerOutput(scheduled_new_reqs=[NewRequestData("n", LIVE["a"][0][:8] + [7, 7], GREEDY, shared + [9])],
                         num_scheduled_tokens={"n": 2}, total_num_scheduled_tokens=2)
    so.scheduled_new_reqs[0].num_computed_tokens = 2 * BS
    _run(runner, so)
    so = SchedulerOutput(finished_req_ids={"b"}, scheduled_new_reqs=[NewRequestData("m", [1, 2], GREEDY, [3])],
                         num_scheduled_tokens={"m": 2}, total_num_scheduled_tokens=2)
    _run(runner, so)
    assert runner.state.tables.holders[shared].tolist() == [2, 2]
    assert runner.state.tables.holders[[3, 4, 5, 6]].tolist() == [1, 0, 0, 0]


# ---- hostile values in every field: ValueError, the same on every path -------------------

HOSTILE = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 1.0, np.float64(1.0), np.array([1, 2]), (1,), [1.5], ["1"],
                     [2**63], [None], {1}, {"a": 1}, np.int64(1)]),
)
FIELDS = ["finished_req_ids", "preempted_req_ids", "num_scheduled_tokens", "total_num_scheduled_tokens",
          "scheduled_new_reqs", "scheduled_cached_reqs", "scheduled_spec_decode_tokens",
          "cached.req_ids", "cached.new_block_ids", "cached.num_computed_tokens", "cached.new_block_ids[0]",
          "cached.num_computed_tokens[0]", "num_scheduled_tokens[a]"]


def _hostile_step(computed: dict[str, int], field: str, value) -> SchedulerOutput:
    so = _decode(computed)
    if field.startswith("cached."):
        name, _, index = field[len("cached."):].partition("[")
        if index:
            getattr(so.scheduled_cached_reqs, name)[0] = value
        else:
            setattr(so.scheduled_cached_reqs, name, value)
    elif field == "num_scheduled_tokens[a]":
        so.num_scheduled_tokens["a"] = value
    else:
        setattr(so, field, value)
    return so


@pytest.fixture(scope="module")
def steady():
    return list(_steady_runner(blocks_of=ROOMY))


def _with_room(steady) -> tuple:
    """The steady runner, its requests restarted when they near max_model_len."""
    runner, computed = steady
    if max(computed.values()) > runner.max_model_len - 4:
        runner.execute_model(SchedulerOutput(finished_req_ids=set(computed)))
        runner.sample_tokens()
        steady[:] = _steady_runner(runner, ROOMY)
    return tuple(steady)


@settings(deadline=None)
@given(field=st.sampled_from(FIELDS), value=HOSTILE)
def test_any_value_in_any_field_is_accepted_or_a_value_error_alike_on_every_path(steady, field, value):
    """A decode step with one field replaced: the runner (which reuses its steady-decode plan
    for this batch) raises exactly the reference's ValueError, or accepts what it accepts; a
    refused step changes nothing."""
    runner, computed = _with_room(steady)
    so = _hostile_step(computed, field, value)
    try:
        validate_reference(runner.state, runner.limits, copy.copy(so))
        expected = None
    except ValueError as e:
        expected = str(e)
    except Exception as e:  # noqa: BLE001 - the failure this test exists to catch
        pytest.fail(f"the reference raised {type(e).__name__}: {e}")
    if expected is None:
        _run(runner, so)
        for rid in computed:
            computed[rid] += 1
    else:
        with pytest.raises(ValueError) as exc:
            runner.execute_model(so)
        assert str(exc.value) == expected
        assert runner.planner.plan is not None
    before = runner.state.requests.num_computed_np.copy()
    _run(runner, _decode(computed))  # the runner goes on (and a refused step advanced nothing)
    for rid in computed:
        computed[rid] += 1
    assert (runner.state.requests.num_computed_np >= before).all()


def test_field_types_are_checked_on_the_steady_path(steady):
    """What the general path refuses, the steady-decode plan refuses with the same words."""
    runner, computed = _with_room(steady)
    cases = {"num_scheduled_tokens[a]": 1.0, "total_num_scheduled_tokens": 2.0, "finished_req_ids": None,
             "scheduled_spec_decode_tokens": None, "cached.num_computed_tokens[0]": float(computed["a"]),
             "cached.new_block_ids[0]": [9.0], "scheduled_new_reqs": None}
    for field, value in cases.items():
        so = _hostile_step(computed, field, value)
        message = field_type_violation(so)
        assert message, field
        with pytest.raises(ValueError) as exc:
            runner.execute_model(so)
        assert str(exc.value) == message


def test_a_bool_equal_to_a_low_counter_is_refused_on_the_steady_path():
    """True == 1: a prompt prefilled one token a step has counter 1 on its second step, which
    reuses the first step's decode plan; there only the type tells the bool from the count."""
    runner = _small_runner()
    first = SchedulerOutput(scheduled_new_reqs=[NewRequestData("p", [5, 6, 7, 8], GREEDY, [0, 1])],
                            num_scheduled_tokens={"p": 1}, total_num_scheduled_tokens=1)
    runner.execute_model(first)
    runner.sample_tokens()
    assert runner.planner.plan is not None
    hostile = _decode({"p": True})
    message = field_type_violation(hostile)
    assert message
    with pytest.raises(ValueError) as exc:
        runner.execute_model(hostile)
    assert str(exc.value) == message
    runner.execute_model(_decode({"p": 1}))  # refused without a trace: the count still reads 1
    runner.sample_tokens()
    assert runner.state.requests.num_computed_np[runner.state.requests.req_id_to_index["p"]] == 2


@pytest.mark.parametrize("bad", [2**63, 2**64, -(2**63) - 1])
def test_integers_past_int64_are_value_errors(live, bad):
    runner, computed = live
    blocks = SchedulerOutput(scheduled_new_reqs=[NewRequestData("n", [1, 2], GREEDY, [bad])],
                             num_scheduled_tokens={"n": 2}, total_num_scheduled_tokens=2)
    count = SchedulerOutput(scheduled_new_reqs=[NewRequestData("n", [1, 2], GREEDY, [20])],
                            num_scheduled_tokens={"n": bad}, total_num_scheduled_tokens=bad)
    token = SchedulerOutput(scheduled_new_reqs=[NewRequestData("n", [1, bad], GREEDY, [20])],
                            num_scheduled_tokens={"n": 2}, total_num_scheduled_tokens=2)
    for so, match in ((blocks, r"block id .*\(outside the int64 range\)"), (count, r"num_scheduled_tokens(=| has )"),
                      (token, "token id .* outside the vocabulary")):
        with pytest.raises(ValueError, match=match):
            runner.execute_model(so)


# ---- SamplingParams changed behind the frozen dataclass ---------------------------------

SAMPLING_VALUES = {
    "temperature": st.one_of(st.floats(allow_nan=True), st.just(-1.0)),
    "top_k": st.one_of(st.integers(-10, 10), st.floats(-2, 2)),
    "top_p": st.floats(allow_nan=True),
    "min_p": st.floats(allow_nan=True),
    "repetition_penalty": st.floats(allow_nan=True),
    "presence_penalty": st.floats(-5, 5),
    "max_tokens": st.one_of(st.integers(-2, 4), st.just(2.5)),
    "min_tokens": st.integers(-2, 4),
    "seed": st.one_of(st.integers(-(2**64), 2**64), st.text(max_size=2)),
}


@settings(deadline=None)
@given(field=st.sampled_from(sorted(SAMPLING_VALUES)), data=st.data())
def test_admission_validates_the_sampling_params_it_stores(live, field, data):
    """Params mutated through object.__setattr__ are admitted iff constructing them is."""
    runner, _ = live
    value = data.draw(SAMPLING_VALUES[field], label="value")
    try:
        SamplingParams(**{"max_tokens": 4, field: value})
        valid = True
    except ValueError:
        valid = False
    params = SamplingParams(max_tokens=4)
    object.__setattr__(params, field, value)
    so = SchedulerOutput(scheduled_new_reqs=[NewRequestData("s", [1, 2], params, [20])],
                         num_scheduled_tokens={"s": 2}, total_num_scheduled_tokens=2)
    assert _accepts(validate_reference, runner.state, runner.limits, so) == valid
    if not valid:
        with pytest.raises(ValueError, match=f"request 's': {field}="):
            validate_reference(runner.state, runner.limits, so)


def test_nan_temperature_set_after_construction_is_refused_by_the_runner(live):
    runner, _ = live
    params = SamplingParams()
    object.__setattr__(params, "temperature", math.nan)
    so = SchedulerOutput(scheduled_new_reqs=[NewRequestData("s", [1, 2], params, [20])],
                         num_scheduled_tokens={"s": 2}, total_num_scheduled_tokens=2)
    with pytest.raises(ValueError, match="request 's': temperature=nan"):
        runner.execute_model(so)
