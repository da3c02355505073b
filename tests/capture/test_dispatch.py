"""capture.modes / descriptor / dispatch: mode resolution, descriptors, the dispatch table.

No torch here: the capture modules must import without it (checked in a subprocess,
because conftest already imports torch into this process). Dispatch results are
checked against a brute-force reference that scans every captured descriptor.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture import (
    DEFAULT_MODE,
    MODE_RULES,
    AttentionCGSupport,
    BatchExecutionDescriptor,
    CUDAGraphMode,
    DispatchTable,
    Resolution,
    default_capture_sizes,
    resolve_mode,
    supported_modes,
    validate_capture_sizes,
)

M, S = CUDAGraphMode, AttentionCGSupport
Desc = BatchExecutionDescriptor
LOGGER = "graphrunner.capture"
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# import rule


def test_capture_imports_without_torch_or_graphrunner():
    code = (
        "import sys\n"
        "import capture, capture.modes, capture.descriptor, capture.dispatch\n"
        "bad = [m for m in ('torch', 'graphrunner', 'numpy', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "capture.DispatchTable('full_and_piecewise', max_num_reqs=4, max_num_batched_tokens=64).dispatch(2, 2, 1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------
# modes


ROUTINES = {  # mode -> (decode routine, mixed routine), written out independently of modes.py
    M.NONE: (M.NONE, M.NONE),
    M.PIECEWISE: (M.PIECEWISE, M.PIECEWISE),
    M.FULL: (M.FULL, M.FULL),
    M.FULL_DECODE_ONLY: (M.FULL, M.NONE),
    M.FULL_AND_PIECEWISE: (M.FULL, M.PIECEWISE),
}


@pytest.mark.parametrize("mode", list(M))
def test_mode_routines(mode):
    decode, mixed = ROUTINES[mode]
    assert (mode.decode_mode, mode.mixed_mode) == (decode, mixed)
    assert mode.separate_routine == (decode is not mixed)
    assert mode.is_runtime_mode == (mode in (M.NONE, M.PIECEWISE, M.FULL))
    assert mode.has_full_graphs == (M.FULL in (decode, mixed))
    assert mode.has_piecewise_graphs == (M.PIECEWISE in (decode, mixed))


@pytest.mark.parametrize(
    "text, mode",
    [
        ("full_and_piecewise", M.FULL_AND_PIECEWISE),
        ("FULL_AND_PIECEWISE", M.FULL_AND_PIECEWISE),
        ("full-decode-only", M.FULL_DECODE_ONLY),
        ("FULL", M.FULL),
        (" piecewise ", M.PIECEWISE),
        ("none", M.NONE),
        ("eager", M.NONE),
        (M.FULL, M.FULL),
    ],
)
def test_mode_parse(text, mode):
    assert M.parse(text) is mode


@pytest.mark.parametrize("bad", ["fulll", "", "full_and", 2, None, "decode"])
def test_mode_parse_error_names_value_and_allowed_set(bad):
    with pytest.raises(ValueError) as err:
        M.parse(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    for mode in M:
        assert mode.name.lower() in msg


def test_support_parse_and_order():
    assert S.parse("uniform_decode") is S.UNIFORM_DECODE
    assert S.parse("ALWAYS") is S.ALWAYS
    assert min(S.ALWAYS, S.NEVER, S.UNIFORM_DECODE) is S.NEVER
    with pytest.raises(ValueError, match="'sometimes'.*never.*uniform_decode.*always"):
        S.parse("sometimes")


# --------------------------------------------------------------------------------------------
# mode resolution

ERROR = "error"
# (explicit mode, support) -> resolved mode, or ERROR. Written out, not derived from MODE_RULES.
EXPECTED_RESOLUTION = {
    (M.NONE, S.NEVER): M.NONE,
    (M.NONE, S.UNIFORM_DECODE): M.NONE,
    (M.NONE, S.ALWAYS): M.NONE,
    (M.PIECEWISE, S.NEVER): M.PIECEWISE,
    (M.PIECEWISE, S.UNIFORM_DECODE): M.PIECEWISE,
    (M.PIECEWISE, S.ALWAYS): M.PIECEWISE,
    (M.FULL, S.NEVER): ERROR,
    (M.FULL, S.UNIFORM_DECODE): M.FULL_AND_PIECEWISE,
    (M.FULL, S.ALWAYS): M.FULL,
    (M.FULL_DECODE_ONLY, S.NEVER): ERROR,
    (M.FULL_DECODE_ONLY, S.UNIFORM_DECODE): M.FULL_DECODE_ONLY,
    (M.FULL_DECODE_ONLY, S.ALWAYS): M.FULL_DECODE_ONLY,
    (M.FULL_AND_PIECEWISE, S.NEVER): M.PIECEWISE,
    (M.FULL_AND_PIECEWISE, S.UNIFORM_DECODE): M.FULL_AND_PIECEWISE,
    (M.FULL_AND_PIECEWISE, S.ALWAYS): M.FULL_AND_PIECEWISE,
}
EXPECTED_DEFAULT = {S.NEVER: M.PIECEWISE, S.UNIFORM_DECODE: M.FULL_AND_PIECEWISE, S.ALWAYS: M.FULL_AND_PIECEWISE}


@pytest.mark.parametrize("as_text", [False, True])
@pytest.mark.parametrize("mode, support", list(EXPECTED_RESOLUTION))
def test_resolution_table(mode, support, as_text, caplog):
    requested = mode.name.lower() if as_text else mode
    expected = EXPECTED_RESOLUTION[(mode, support)]
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    if expected == ERROR:
        with pytest.raises(ValueError) as err:
            resolve_mode(requested, support.name if as_text else support, backend="backend 'toy'")
        msg = str(err.value)
        assert f"cudagraph_mode={mode.name}" in msg and "backend 'toy'" in msg and support.name in msg
        allowed = [m.name for m in M if EXPECTED_RESOLUTION[(m, support)] is m]
        assert f"allowed with this backend: {allowed}" in msg
        return
    res = resolve_mode(requested, support.name if as_text else support)
    assert isinstance(res, Resolution) and res.mode is expected
    records = [r for r in caplog.records if r.name == LOGGER]
    if expected is mode:
        assert res.downgraded_from is None and res.reason == "requested"
        assert not records, "an honoured choice must not log a downgrade"
    else:
        assert res.downgraded_from is mode and res.reason
        assert len(records) == 1 and records[0].levelno == logging.WARNING
        text = records[0].getMessage()
        assert mode.name in text and expected.name in text and res.reason in text and support.name in text
        assert f"downgraded from {mode.name}" in str(res)


@pytest.mark.parametrize("support", list(S))
def test_resolution_default(support, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    res = resolve_mode(None, support)
    assert res.mode is EXPECTED_DEFAULT[support]
    records = [r for r in caplog.records if r.name == LOGGER]
    if res.mode is DEFAULT_MODE:
        assert res.downgraded_from is None and res.reason == "default" and not records
    else:  # a default that cannot be kept is downgraded (never an error), and says why
        assert res.downgraded_from is DEFAULT_MODE
        assert len(records) == 1 and records[0].levelno == logging.INFO
        assert res.reason in records[0].getMessage()


@pytest.mark.parametrize("requested", [None, *M])
@pytest.mark.parametrize("support", list(S))
def test_enforce_eager_wins(requested, support, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    res = resolve_mode(requested, support, enforce_eager=True)
    assert res.mode is M.NONE and "enforce_eager" in res.reason
    records = [r for r in caplog.records if r.name == LOGGER]
    if requested in (None, M.NONE):
        assert res.downgraded_from is None and not records
    else:  # overriding an explicit graph mode is never silent
        assert res.downgraded_from is requested
        assert len(records) == 1 and requested.name in records[0].getMessage()


def test_resolution_rejects_bad_strings():
    with pytest.raises(ValueError, match="'fast'"):
        resolve_mode("fast", S.ALWAYS)
    with pytest.raises(ValueError, match="'maybe'"):
        resolve_mode(None, "maybe")
    with pytest.raises(ValueError, match="'fast'"):  # even when enforce_eager hides the mode
        resolve_mode("fast", S.ALWAYS, enforce_eager=True)


def test_mode_rules_are_well_formed():
    for (mode, support), rule in MODE_RULES.items():
        assert rule.reason, (mode, support)
        if rule.to is not None:  # a downgrade lands on a mode the backend honours: no chains
            assert rule.to in supported_modes(support)
            assert rule.to is not mode
    for support in S:  # the default is always resolvable, and NONE / PIECEWISE always honoured
        assert MODE_RULES.get((DEFAULT_MODE, support), None) is None or MODE_RULES[(DEFAULT_MODE, support)].to
        assert {M.NONE, M.PIECEWISE} <= set(supported_modes(support))
    assert set(supported_modes(S.ALWAYS)) == set(M)


# --------------------------------------------------------------------------------------------
# descriptor


def test_descriptor_is_a_hashable_key_with_short_str():
    a = Desc(M.FULL, 64, 64, 1)
    assert a == Desc(M.FULL, 64, 64, 1) and hash(a) == hash(Desc(M.FULL, 64, 64, 1))
    graphs = {a: "g1", Desc(M.FULL, 64, 64): "g2", Desc(M.PIECEWISE, 64): "g3"}
    assert len(graphs) == 3 and graphs[Desc(M.FULL, 64, 64, 1)] == "g1"
    assert str(a) == "FULL(t=64,r=64,q=1)"
    assert str(Desc(M.FULL, 64, 32)) == "FULL(t=64,r=32)"
    assert str(Desc(M.PIECEWISE, 48)) == "PIECEWISE(t=48)"
    assert str(Desc(M.NONE, 37, 5)) == "NONE(t=37,r=5)"
    with pytest.raises(AttributeError):
        a.num_tokens = 3  # type: ignore[misc]


def test_a_microbatched_twin_is_its_own_key_and_only_for_uniform_decode():
    twin = Desc(M.FULL, 64, 64, 1, microbatched=True)
    assert twin != Desc(M.FULL, 64, 64, 1) and str(twin) == "FULL(t=64,r=64,q=1,ubatch)"
    for args in ((M.FULL, 64, 32), (M.FULL, 1, 1, 1), (M.PIECEWISE, 64)):
        with pytest.raises(ValueError, match="microbatched needs a uniform-decode FULL descriptor"):
            Desc(*args, microbatched=True)
    with pytest.raises(ValueError, match="microbatched=1 must be a bool"):
        Desc(M.FULL, 4, 4, 1, microbatched=1)  # type: ignore[arg-type]


def test_descriptor_predicates_and_padding():
    full = Desc(M.FULL, 18, 6, 3)
    assert full.is_full and full.is_uniform_decode and not full.is_piecewise and not full.is_eager
    assert full.padded_tokens(12) == 6 and full.padded_reqs(4) == 2
    pw = Desc(M.PIECEWISE, 16)
    assert pw.is_piecewise and not pw.is_uniform_decode and pw.padded_reqs(9) == 0 and pw.padded_tokens(16) == 0
    assert Desc(M.NONE, 5, 2).is_eager
    with pytest.raises(ValueError, match="real_tokens=19"):
        full.padded_tokens(19)
    with pytest.raises(ValueError, match="real_reqs=7"):
        full.padded_reqs(7)


@pytest.mark.parametrize(
    "args, match",
    [
        ((M.FULL_AND_PIECEWISE, 8, 8), "FULL_AND_PIECEWISE.*not a runtime mode"),
        (("full", 8, 8), "not a runtime mode"),
        ((M.FULL, 0, None), "num_tokens=0"),
        ((M.FULL, 8, None), "FULL descriptor needs num_reqs"),
        ((M.FULL, 8, 9), "num_reqs=9"),
        ((M.PIECEWISE, 8, 4), "num_reqs=4 on a PIECEWISE"),
        ((M.FULL, 8, 4, 3), "8 != 4 \\* 3"),
        ((M.FULL, 8, 4, 0), "uniform_token_count=0"),
        ((M.PIECEWISE, 8, None, 1), "only meaningful for FULL"),
        ((M.NONE, 2.0, None), "num_tokens=2.0"),
    ],
)
def test_descriptor_validation(args, match):
    with pytest.raises(ValueError, match=match):
        Desc(*args)


# --------------------------------------------------------------------------------------------
# capture sizes


def formula_sizes(max_num_reqs: int, max_tokens: int, q: int) -> list[int]:
    """docs/architecture.md §5 restated as membership rules: 1, 2, 4; multiples of 8 below 256; of 16 from 256."""
    top = min(2 * max_num_reqs * q, 512, max_tokens)
    return [
        s
        for s in range(1, top + 1)
        if s in (1, 2, 4) or (s < 256 and s % 8 == 0) or (s >= 256 and s % 16 == 0)
    ]


@given(max_num_reqs=st.integers(1, 300), max_tokens=st.integers(1, 9000), q=st.integers(1, 5))
def test_default_sizes_match_formula(max_num_reqs, max_tokens, q):
    sizes = default_capture_sizes(max_num_reqs, max_tokens, q)
    assert list(sizes) == formula_sizes(max_num_reqs, max_tokens, q)
    table = DispatchTable(M.PIECEWISE, max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens,
                          uniform_decode_query_len=q)
    assert table.capture_sizes == sizes


def test_default_sizes_known_values():
    assert len(default_capture_sizes(256, 8192)) == 3 + 31 + 17  # 1,2,4 | 8..248 | 256..512
    assert default_capture_sizes(256, 8192)[-1] == 512
    assert default_capture_sizes(4, 8192) == (1, 2, 4, 8)
    assert default_capture_sizes(4, 8192, 3) == (1, 2, 4, 8, 16, 24)
    assert default_capture_sizes(256, 6) == (1, 2, 4)


def test_user_sizes_sorted_deduplicated_and_filtered(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    assert validate_capture_sizes([16, 4, 4, 1], 64) == (1, 4, 16)
    assert not caplog.records
    assert validate_capture_sizes([1000, 8, 65, 2, 8], 64) == (2, 8)
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING and "65" in record.getMessage() and "1000" in record.getMessage()
    assert "max_num_batched_tokens=64" in record.getMessage()
    table = DispatchTable(M.FULL, (24, 8, 8), max_num_reqs=4, max_num_batched_tokens=64)
    assert table.capture_sizes == (8, 24)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ([8, 0], "capture size 0"),
        ([-4], "capture size -4"),
        ([1.5], "capture size 1.5"),
        (["8"], "capture size '8'"),
        ([True, 8], "capture size True"),
        ("8", "not a string"),
        ([], "leaves no size <= max_num_batched_tokens=64"),
        ([65, 128], "leaves no size <= max_num_batched_tokens=64"),
    ],
)
def test_user_size_errors(sizes, match):
    with pytest.raises(ValueError, match=match):
        DispatchTable(M.PIECEWISE, sizes, max_num_reqs=4, max_num_batched_tokens=64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_reqs=0, max_num_batched_tokens=64), "max_num_reqs=0"),
        (dict(max_num_reqs=4, max_num_batched_tokens=-1), "max_num_batched_tokens=-1"),
        (dict(max_num_reqs=4, max_num_batched_tokens=64, uniform_decode_query_len=0), "uniform_decode_query_len=0"),
    ],
)
def test_table_limit_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DispatchTable(M.FULL, **kwargs)


# --------------------------------------------------------------------------------------------
# dispatch: strategies and a brute-force reference


@st.composite
def tables(draw) -> DispatchTable:
    mode = draw(st.sampled_from(list(M)))
    max_num_reqs = draw(st.integers(1, 48))
    max_tokens = draw(st.integers(1, 600))
    q = draw(st.integers(1, 4))
    if draw(st.booleans()):
        sizes = None
    else:  # user sizes, some above the token limit (dropped with a warning)
        sizes = draw(st.lists(st.integers(1, max_tokens), min_size=1, max_size=12))
        sizes += draw(st.lists(st.integers(max_tokens + 1, max_tokens + 50), max_size=2))
    return DispatchTable(mode, sizes, max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens,
                         uniform_decode_query_len=q)


def reference_dispatch(table: DispatchTable, num_reqs: int, num_tokens: int, q: int | None) -> Desc:
    """Scan every captured descriptor: a compatible uniform-decode FULL graph wins over a mixed
    one, then the fewest tokens; nothing compatible -> eager with the real sizes."""
    compatible = [
        d
        for d in table.descriptors
        if d.num_tokens >= num_tokens
        and (d.num_reqs is None or d.num_reqs >= num_reqs)
        and (d.uniform_token_count is None or d.uniform_token_count == q)
    ]
    if not compatible:
        return Desc(M.NONE, num_tokens, num_reqs)
    return min(compatible, key=lambda d: (d.uniform_token_count is None, d.num_tokens))


def batches(table: DispatchTable, rng_seed: int) -> list[tuple[int, int, int | None]]:
    """Every token count (with 1, a middle and the most requests) plus every uniform batch."""
    rng = random.Random(rng_seed)
    top = min(table.max_num_batched_tokens, table.max_graph_tokens + 2)
    out = []
    for t in range(1, top + 1):
        most = min(t, table.max_num_reqs)
        for r in {1, most, rng.randint(1, most)}:
            out.append((r, t, None))
    q = table.uniform_decode_query_len
    for u in {q, q + 1, 1}:
        for r in range(1, min(table.max_num_reqs, table.max_num_batched_tokens // u) + 1):
            out.append((r, r * u, u))
    return out


@settings(deadline=None)
@given(table=tables(), seed=st.integers(0, 2**16))
def test_dispatch_properties(table, seed):
    listed = set(table.descriptors)
    q = table.uniform_decode_query_len
    for num_reqs, num_tokens, u in batches(table, seed):
        desc = table.dispatch(num_reqs, num_tokens, u)
        assert desc == reference_dispatch(table, num_reqs, num_tokens, u), (num_reqs, num_tokens, u)
        assert desc == table.dispatch(num_reqs, num_tokens, u)  # deterministic
        assert desc.num_tokens >= num_tokens
        if desc.is_eager:  # eager runs unpadded, and only when nothing compatible exists
            assert (desc.num_tokens, desc.num_reqs, desc.uniform_token_count) == (num_tokens, num_reqs, None)
            assert not any(d.fits(num_reqs, num_tokens, u) for d in table.descriptors)
            continue
        assert desc in listed and desc.fits(num_reqs, num_tokens, u)
        if desc.is_full:
            assert desc.num_reqs >= num_reqs
        else:
            assert desc.num_reqs is None
        if desc.is_uniform_decode:
            assert u == desc.uniform_token_count == q and desc.num_tokens == desc.num_reqs * q
        # minimal: nothing of the same kind (uniform-decode FULL vs mixed) fits with fewer tokens
        same_kind = [d for d in table.descriptors if d.is_uniform_decode == desc.is_uniform_decode]
        assert not any(d.fits(num_reqs, num_tokens, u) and d.num_tokens < desc.num_tokens for d in same_kind)
        if not desc.is_uniform_decode:  # and a mixed pick means no uniform graph fits at all
            assert not any(d.fits(num_reqs, num_tokens, u) for d in listed if d.is_uniform_decode)


@settings(deadline=None)
@given(table=tables())
def test_mixed_batch_never_gets_uniform_graph(table):
    for t in range(1, table.max_num_batched_tokens + 1, max(1, table.max_num_batched_tokens // 64)):
        for r in {1, min(t, table.max_num_reqs)}:
            assert not table.dispatch(r, t).is_uniform_decode
    q = table.uniform_decode_query_len  # uniform batches with another q are mixed for the table
    for r in range(1, min(table.max_num_reqs, table.max_num_batched_tokens // (q + 1)) + 1):
        assert not table.dispatch(r, r * (q + 1), q + 1).is_uniform_decode


@settings(deadline=None)
@given(table=tables())
def test_descriptors_built_by_the_rules(table):
    descs = table.descriptors
    mode, q = table.mode, table.uniform_decode_query_len
    sizes, max_reqs, max_tokens = table.capture_sizes, table.max_num_reqs, table.max_num_batched_tokens
    assert len(set(descs)) == len(descs)
    # capture order: every PIECEWISE before every FULL, each group largest first
    kinds = [d.is_piecewise for d in descs]
    assert kinds == sorted(kinds, reverse=True)
    for group in ([d for d in descs if d.is_piecewise], [d for d in descs if d.is_full]):
        assert [d.num_tokens for d in group] == sorted((d.num_tokens for d in group), reverse=True)
    uniform = {d for d in descs if d.is_uniform_decode}
    mixed = [d for d in descs if not d.is_uniform_decode]
    if mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE):
        expected_uniform = set()
        for s in sizes:
            t = (s + q - 1) // q * q
            if t // q <= max_reqs and t <= max_tokens:
                expected_uniform.add(Desc(M.FULL, t, t // q, q))
        assert uniform == expected_uniform
    else:
        assert not uniform
    expected_mixed = {
        M.PIECEWISE: [Desc(M.PIECEWISE, s) for s in sizes],
        M.FULL_AND_PIECEWISE: [Desc(M.PIECEWISE, s) for s in sizes],
        M.FULL: [Desc(M.FULL, s, min(s, max_reqs)) for s in sizes],
    }.get(mode, [])
    assert sorted(mixed, key=lambda d: d.num_tokens) == expected_mixed
    # no dead graphs: a batch of exactly a descriptor's shape dispatches to it
    for d in descs:
        if d.is_uniform_decode:
            assert table.dispatch(d.num_reqs, d.num_tokens, q) == d
        else:
            assert table.dispatch(1, d.num_tokens) == d


@settings(deadline=None)
@given(table=tables(), seed=st.integers(0, 2**16))
def test_explain_agrees_with_dispatch(table, seed):
    for num_reqs, num_tokens, u in batches(table, seed)[::7]:
        exp = table.explain(num_reqs, num_tokens, u)
        desc = table.dispatch(num_reqs, num_tokens, u)
        assert exp.chosen == desc
        assert [v.descriptor for v in exp.verdicts] == list(table.candidates(num_tokens))
        accepted = [v for v in exp.verdicts if v.accepted]
        assert [v.descriptor for v in accepted] == ([] if desc.is_eager else [desc])
        for v in exp.verdicts:
            assert v.reason
            fits = v.descriptor.fits(num_reqs, num_tokens, u)
            if v.reached:
                assert v.accepted == fits and (v.descriptor.misfit(num_reqs, num_tokens, u) is None) == fits
        assert exp.padding_tokens == desc.num_tokens - num_tokens
        assert 0.0 <= exp.waste < 1.0
        text = str(exp)
        assert str(desc) in text and all(str(v.descriptor) in text for v in exp.verdicts)
        assert bool(exp.note) == desc.is_eager


# --------------------------------------------------------------------------------------------
# dispatch: worked examples


def test_uniform_decode_pads_up_to_full_graph():
    # q = 3 (two speculative tokens): decode graphs at multiples of 3, mixed at the sizes.
    table = DispatchTable("full_and_piecewise", [1, 2, 4, 8, 16, 24], max_num_reqs=8,
                          max_num_batched_tokens=64, uniform_decode_query_len=3)
    assert table.candidates(12) == (Desc(M.FULL, 18, 6, 3), Desc(M.PIECEWISE, 16))
    assert table.dispatch(4, 12, 3) == Desc(M.FULL, 18, 6, 3)  # FULL replay preferred over PIECEWISE 16
    assert table.dispatch(3, 9, 3) == Desc(M.FULL, 9, 3, 3)  # exact fit, not over-padded
    assert table.dispatch(1, 3) == Desc(M.PIECEWISE, 4)  # mixed batch at a decode-only token count
    assert table.dispatch(2, 12) == Desc(M.PIECEWISE, 16)
    assert table.dispatch(6, 12, 2) == Desc(M.PIECEWISE, 16)  # uniform, but not with the table's q
    assert table.dispatch(8, 24, 3) == Desc(M.FULL, 24, 8, 3)
    assert table.dispatch(8, 32) == Desc(M.NONE, 32, 8)  # beyond the ladder: eager, unpadded
    assert table.candidates(25) == ()
    assert "FULL_AND_PIECEWISE" in repr(table) and table.resolution.mode is M.FULL_AND_PIECEWISE


def test_mode_specific_dispatch():
    kw = dict(max_num_reqs=4, max_num_batched_tokens=64)
    assert DispatchTable("full_decode_only", **kw).dispatch(3, 3, 1) == Desc(M.FULL, 4, 4, 1)
    assert DispatchTable("full_decode_only", **kw).dispatch(2, 3) == Desc(M.NONE, 3, 2)
    assert DispatchTable("full", **kw).dispatch(2, 3) == Desc(M.FULL, 4, 4)
    assert DispatchTable("full", **kw).dispatch(3, 7) == Desc(M.FULL, 8, 4)
    assert DispatchTable("piecewise", **kw).dispatch(3, 3, 1) == Desc(M.PIECEWISE, 4)
    none = DispatchTable("none", **kw)
    assert none.descriptors == () and none.dispatch(3, 3, 1) == Desc(M.NONE, 3, 3)
    assert "captures no graphs" in str(none.explain(3, 3, 1))
    assert "mixed batches eager" in DispatchTable("full_decode_only", **kw).explain(2, 3).note


def test_table_keeps_resolution():
    res = resolve_mode("full", S.UNIFORM_DECODE)
    table = DispatchTable(res, max_num_reqs=4, max_num_batched_tokens=64)
    assert table.resolution is res and table.mode is M.FULL_AND_PIECEWISE
    assert DispatchTable(M.FULL, max_num_reqs=4, max_num_batched_tokens=64).resolution.mode is M.FULL


@pytest.mark.parametrize(
    "args, match",
    [
        ((1, 65), "num_tokens=65.*max_num_batched_tokens=64"),
        ((1, 0), "num_tokens=0"),
        ((5, 8), "num_reqs=5.*max_num_reqs=4"),
        ((0, 8), "num_reqs=0"),
        ((3, 2), "num_reqs=3 exceeds num_tokens=2"),
        ((2, 5, 2), "uniform_token_count=2.*num_tokens=5, num_reqs=2"),
        ((2, 4, 0), "uniform_token_count=0"),
    ],
)
def test_dispatch_input_errors(args, match):
    table = DispatchTable(M.FULL_AND_PIECEWISE, max_num_reqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=match):
        table.dispatch(*args)
    with pytest.raises(ValueError, match=match):
        table.explain(*args)
