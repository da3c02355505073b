"""PIECEWISE: attention as an opaque op, torch.compile split at it, pieces graphed per size.

Reference: the same model (same dummy weights) run eagerly with the direct backend call,
on the *unpadded* batch. The piecewise model runs in op mode on the batch padded to a
larger token count (padded tokens: garbage ids, position 0, slot -1; requests not
padded), so every comparison also checks that padding is neutral: the real rows of the
hidden states and every KV-cache slot equal the reference, and no slot that no real
token owns is written.

CPU: compile backends "eager" / "aot_eager" (fast) and one "inductor" test. Graph replay
does not exist on CPU (capture records the size, calls run the pieces). GPU (`gpu`
mark): inductor + CUDA graphs per size, Triton attention, bf16.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.piecewise import AddressMismatchError, PiecewiseCompiled
from graphrunner.attention import AttentionMetadata, get_attention_backend
from graphrunner.attention.op import current_forward_context, forward_context, unified_attention
from graphrunner.attention.torch_ref import TorchReferenceBackend
from graphrunner.config import LoadConfig
from graphrunner.models import BUILTIN_MODELS, load_model

ATTN_OP = torch.ops.graphrunner.unified_attention
BLOCK_SIZE = 4
NUM_BLOCKS = 40
MAX_TOKENS = 80
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- workloads


@dataclass
class Step:
    """One batch: requests (context_len, query_len) over a shared paged cache, padded."""

    ids: torch.Tensor  # [T_pad] int32; padded tail holds garbage token ids
    positions: torch.Tensor  # [T_pad] int64; padded tail 0
    slots: torch.Tensor  # [T_pad] int64; padded tail -1
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    num_real: int
    num_padded: int

    def metadata(self, num_tokens: int, device) -> AttentionMetadata:
        qlens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        return AttentionMetadata(
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_table=self.block_table.to(device),
            slot_mapping=self.slots[:num_tokens].to(device),
            num_reqs=len(self.seq_lens),
            num_tokens=num_tokens,
            max_query_len=int(qlens.max()),
            max_seq_len=int(self.seq_lens.max()),
        )


def make_step(reqs: list[tuple[int, int]], pad: int, *, vocab: int, seed: int) -> Step:
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_blocks = max(-(-(c + q) // BLOCK_SIZE) for c, q in reqs) + 1
    block_table = torch.randint(0, NUM_BLOCKS, (len(reqs), max_blocks), generator=gen, dtype=torch.int32)
    positions, slots, qsl = [], [], [0]
    for r, (ctx, q) in enumerate(reqs):
        n = -(-(ctx + q) // BLOCK_SIZE)
        block_table[r, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        for pos in range(ctx, ctx + q):
            positions.append(pos)
            slots.append(int(block_table[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + q)
    num_real = qsl[-1]
    return Step(
        ids=torch.randint(0, vocab, (num_real + pad,), generator=gen, dtype=torch.int32),
        positions=torch.tensor(positions + [0] * pad, dtype=torch.int64),
        slots=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in reqs], dtype=torch.int32),
        block_table=block_table,
        num_real=num_real,
        num_padded=num_real + pad,
    )


def make_caches(config, dtype, device, seed: int) -> list[torch.Tensor]:
    """Random KV caches: context entries are whatever the cache holds (same for both paths)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [torch.randn(shape, generator=gen).to(dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]


@dataclass
class Harness:
    """A reference model, an op-mode model with the same weights, and persistent inputs."""

    ref: torch.nn.Module
    op: torch.nn.Module
    backend: object
    ids_buf: torch.Tensor  # [MAX_TOKENS] persistent
    pos_buf: torch.Tensor  # [MAX_TOKENS] persistent
    dtype: torch.dtype
    device: torch.device

    @property
    def config(self):
        return self.ref.config

    def reference(self, step: Step, caches: list[torch.Tensor]) -> torch.Tensor:
        """Eager, direct backend call, unpadded: hidden [num_real, hidden]."""
        n = step.num_real
        ids, pos = step.ids[:n].to(self.device), step.positions[:n].to(self.device)
        return self.ref(ids, pos, caches, step.metadata(n, self.device))

    def load(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write the padded step into the persistent buffers; views + per-step metadata."""
        n = step.num_padded
        self.ids_buf[:n].copy_(step.ids)
        self.pos_buf[:n].copy_(step.positions)
        return self.ids_buf[:n], self.pos_buf[:n], step.metadata(n, self.device)

    def run(self, compiled: PiecewiseCompiled, step: Step, caches, *, capture: bool = False, **kw) -> torch.Tensor:
        ids, pos, md = self.load(step)
        with forward_context(md, caches, self.backend):
            call = compiled.capture if capture else compiled
            return call(ids, pos, caches, md, **kw)


def make_harness(num_layers: int, dtype: torch.dtype, device, backend) -> Harness:
    config = dataclasses.replace(BUILTIN_MODELS["builtin:tiny-llama"], num_hidden_layers=num_layers)
    ref = load_model(config, LoadConfig(seed=3), attn_backend=backend, dtype=dtype, device=device)
    op = load_model(config, LoadConfig(seed=3), attn_backend=backend, dtype=dtype, device=device)
    op.use_attention_op(True)
    gen = torch.Generator().manual_seed(99)
    return Harness(
        ref,
        op,
        backend,
        torch.randint(0, config.vocab_size, (MAX_TOKENS,), generator=gen, dtype=torch.int32).to(device),
        torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device),
        dtype,
        torch.device(device),
    )


def piecewise(h: Harness, compile_backend: str, **kw) -> PiecewiseCompiled:
    return PiecewiseCompiled(h.op, [ATTN_OP], token_args=(0, 1), compile_backend=compile_backend, **kw)


def owned_slots(step: Step) -> torch.Tensor:
    return step.slots[: step.num_real]


def assert_step_matches(h: Harness, step: Step, out, caches, ref_out, ref_caches, *, tol) -> None:
    """Real rows equal; every cache slot equal; slots no real token owns untouched."""
    assert out.shape == (step.num_padded, h.config.hidden_size)
    torch.testing.assert_close(out[: step.num_real], ref_out, **tol)
    owned = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    owned[owned_slots(step)] = True
    for layer, (got, want) in enumerate(zip(caches, ref_caches, strict=True)):
        got_flat, want_flat = got.flatten(1, 2).cpu(), want.flatten(1, 2).cpu()  # [2, slots, Hkv, D]
        assert torch.equal(got_flat[:, ~owned], want_flat[:, ~owned]), f"layer {layer}: a slot no token owns changed"
        torch.testing.assert_close(got_flat[:, owned], want_flat[:, owned], **tol, msg=f"layer {layer} KV")


requests_st = st.lists(st.tuples(st.integers(0, 13), st.integers(1, 7)), min_size=1, max_size=3)


# --------------------------------------------------------------------------- the op


@pytest.fixture(scope="module")
def cpu_harness() -> Harness:
    return make_harness(4, torch.float32, "cpu", TorchReferenceBackend())


def test_op_needs_a_context_and_refuses_nesting(cpu_harness):
    h = cpu_harness
    step = make_step([(3, 2)], 0, vocab=h.config.vocab_size, seed=0)
    ids, pos, md = h.load(step)
    with pytest.raises(RuntimeError, match="outside forward_context"):
        h.op(ids, pos, [], md)
    with forward_context(md, [], h.backend):
        with pytest.raises(RuntimeError, match="nested forward_context"):
            with forward_context(md, [], h.backend):
                pass
        assert current_forward_context().metadata is md
        with pytest.raises(IndexError, match="layer_index=0 is out of range for 0 kv caches"):
            h.op(ids, pos, [], md)
    with pytest.raises(RuntimeError, match="outside forward_context"):
        current_forward_context()  # cleared on exit, also after an exception inside


def test_op_mode_eager_equals_direct_call(cpu_harness):
    """Op mode changes the route, not the math: bitwise equal to the direct call."""
    h = cpu_harness
    step = make_step([(5, 3), (0, 4)], 0, vocab=h.config.vocab_size, seed=1)
    ref_caches, caches = make_caches(h.config, h.dtype, "cpu", 0), make_caches(h.config, h.dtype, "cpu", 0)
    with torch.inference_mode():
        ref = h.reference(step, ref_caches)
        ids, pos, md = h.load(step)
        with forward_context(md, caches, h.backend):
            out = h.op(ids, pos, ["ignored in op mode"], None)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


def test_opcheck(cpu_harness):
    """The op's schema, fake kernel (strides included) and mutation declaration are sound."""
    h = cpu_harness
    step = make_step([(2, 3)], 1, vocab=h.config.vocab_size, seed=2)
    md = step.metadata(step.num_padded, "cpu")
    caches = make_caches(h.config, torch.float32, "cpu", 1)
    T, H, Hkv, D = step.num_padded, h.config.num_attention_heads, h.config.num_key_value_heads, h.config.head_dim
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    positions, cos_sin = torch.arange(T, dtype=torch.int64), torch.randn(64, D)
    with forward_context(md, caches, h.backend):
        torch.library.opcheck(
            unified_attention, (q, k, v, positions, cos_sin, torch.empty(T, H, D), 1, 0.125),
            test_utils=("test_schema", "test_faketensor"),
        )


# --------------------------------------------------------------------------- compiled on CPU


@pytest.fixture(scope="module")
def cpu_compiled(cpu_harness) -> PiecewiseCompiled:
    return piecewise(cpu_harness, "eager")


@settings(deadline=None)
@given(reqs=requests_st, pad=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_piecewise_matches_eager(cpu_harness, cpu_compiled, reqs, pad, seed):
    h = cpu_harness
    step = make_step(reqs, pad, vocab=h.config.vocab_size, seed=seed)
    ref_caches, caches = make_caches(h.config, h.dtype, "cpu", seed), make_caches(h.config, h.dtype, "cpu", seed)
    with torch.inference_mode():
        ref = h.reference(step, ref_caches)
        out = h.run(cpu_compiled, step, caches)
    assert_step_matches(h, step, out, caches, ref, ref_caches, tol=FP32_TOL)


def test_one_graph_for_every_size_and_piece_count(cpu_harness, cpu_compiled):
    """T = 1 included: one dynamo graph, split into 2 * num_layers + 1 pieces."""
    h = cpu_harness
    unique_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first_call = cpu_compiled.num_graphs_compiled == 0
    batches = [([(0, 1)], 0), ([(4, 1)], 7), ([(9, 6), (0, 1)], 0), ([(0, 2)], 40), ([(2, 1)], 0)]
    for i, (reqs, pad) in enumerate(batches):
        step = make_step(reqs, pad, vocab=h.config.vocab_size, seed=i)
        with torch.inference_mode():
            h.run(cpu_compiled, step, make_caches(h.config, h.dtype, "cpu", i))
    assert cpu_compiled.num_graphs_compiled == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - unique_before == int(first_call)
    pieces = cpu_compiled.pieces
    num_layers = h.config.num_hidden_layers
    assert len(pieces) == 2 * num_layers + 1
    assert [is_split for _, is_split in pieces] == [False, True] * num_layers + [False]


def test_aot_eager_backend(cpu_harness):
    h = cpu_harness
    compiled = piecewise(h, "aot_eager")
    for i, (reqs, pad) in enumerate([([(3, 4), (6, 1)], 3), ([(0, 1)], 0)]):
        step = make_step(reqs, pad, vocab=h.config.vocab_size, seed=10 + i)
        ref_caches, caches = make_caches(h.config, h.dtype, "cpu", i), make_caches(h.config, h.dtype, "cpu", i)
        with torch.inference_mode():
            ref = h.reference(step, ref_caches)
            out = h.run(compiled, step, caches)
        assert_step_matches(h, step, out, caches, ref, ref_caches, tol=FP32_TOL)
    assert compiled.num_graphs_compiled == 1


def test_pieces_of_one_structure_share_one_compile(monkeypatch):
    """Three layers cut at attention: the two pieces between attention calls are the same nodes over
    inputs of the same shapes (the weights are inputs), so they are compiled once and share it; the
    step still equals the uncompiled model."""
    import capture.split as split

    compiles = []
    real = split.compile_piece
    monkeypatch.setattr(split, "compile_piece", lambda *a: compiles.append(1) or real(*a))
    h = make_harness(3, torch.float32, "cpu", TorchReferenceBackend())
    compiled = piecewise(h, "aot_eager")
    step = make_step([(3, 4), (6, 1)], 3, vocab=h.config.vocab_size, seed=31)
    ref_caches, caches = make_caches(h.config, h.dtype, "cpu", 0), make_caches(h.config, h.dtype, "cpu", 0)
    with torch.inference_mode():
        ref = h.reference(step, ref_caches)
        out = h.run(compiled, step, caches)
    assert_step_matches(h, step, out, caches, ref, ref_caches, tol=FP32_TOL)
    assert len(compiled.pieces) == 7 and len(compiles) == 3  # first, the two alike (one compile), last


@pytest.mark.slow
def test_inductor_backend():
    """The one inductor test (a cold compile costs ~25 s on 2 cores): 2 layers, T = 1, 8, 16."""
    h = make_harness(2, torch.float32, "cpu", TorchReferenceBackend())
    compiled = piecewise(h, "inductor")
    for i, (reqs, pad) in enumerate([([(2, 1)], 0), ([(5, 2), (0, 3)], 3), ([(1, 9), (7, 1)], 6)]):
        step = make_step(reqs, pad, vocab=h.config.vocab_size, seed=20 + i)
        ref_caches, caches = make_caches(h.config, h.dtype, "cpu", i), make_caches(h.config, h.dtype, "cpu", i)
        with torch.inference_mode():
            ref = h.reference(step, ref_caches)
            out = h.run(compiled, step, caches)
        assert_step_matches(h, step, out, caches, ref, ref_caches, tol=dict(atol=1e-4, rtol=1e-4))
    assert compiled.num_graphs_compiled == 1
    assert len(compiled.pieces) == 5


def test_cpu_capture_records_sizes_and_checks_addresses(cpu_harness):
    h = cpu_harness
    compiled = piecewise(h, "eager")
    caches = make_caches(h.config, h.dtype, "cpu", 0)
    steps = {n: make_step([(0, 1)], n - 1, vocab=h.config.vocab_size, seed=n) for n in (1, 16, 8)}
    # Made outside inference mode, like the persistent buffers: an inference tensor would
    # differ in dispatch keys and recompile, which is not what this test is about.
    foreign_ids = h.ids_buf.clone()
    with torch.inference_mode():
        for n, step in steps.items():  # any order is tolerated
            out = h.run(compiled, step, caches, capture=True)
            assert out.shape[0] == n
        assert compiled.captured_sizes == [16, 8, 1]
        h.run(compiled, steps[8], caches)  # same persistent buffers: fine
        ids, pos, md = h.load(steps[8])
        with forward_context(md, caches, h.backend):
            with pytest.raises(AddressMismatchError, match="argument 0 at num_tokens=8"):
                compiled(foreign_ids[:8], pos, caches, md)
        compiled.release()
        assert compiled.captured_sizes == []
        with forward_context(md, caches, h.backend):
            compiled(foreign_ids[:8], pos, caches, md)  # nothing captured: any tensor will do
    assert compiled.num_graphs_compiled == 1


# --------------------------------------------------------------------------- model-agnostic wrapper


@torch.library.custom_op("graphrunner_test::shift_into", mutates_args=("out",))
def _shift_into(x: torch.Tensor, out: torch.Tensor, shift: float) -> None:
    """Test split op: out = x + shift (eagerly, in place)."""
    out.copy_(x + shift)


@_shift_into.register_fake
def _(x, out, shift) -> None:
    return None


SHIFT_OP = torch.ops.graphrunner_test.shift_into


class Toy(torch.nn.Module):
    """Two split ops between matmuls: pieces = 5, outputs written into piece-allocated buffers."""

    def __init__(self, width: int = 16, device=None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(width, width, generator=gen).to(device), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.randn(width, width, generator=gen).to(device), requires_grad=False)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x: [T, W], scale: [T]
        h = x @ self.w1
        out = torch.empty_like(h)
        torch.ops.graphrunner_test.shift_into(h, out, 1.0)
        h = torch.relu(out) @ self.w2 * scale[:, None]
        out2 = torch.empty_like(h)
        torch.ops.graphrunner_test.shift_into.default(h, out2, -2.0)  # the overload, not the packet
        return torch.tanh(out2).sum(-1)


def test_toy_split_and_no_recompiles_across_many_instances():
    """Each instance has its own dynamo cache: more instances than dynamo's recompile limit (8)."""
    toy = Toy()
    for _ in range(10):
        compiled = PiecewiseCompiled(toy, [SHIFT_OP], token_args=(0, 1), compile_backend="eager")
        for n in (3, 1, 7):
            x, s = torch.randn(n, 16), torch.rand(n)
            torch.testing.assert_close(compiled(x, s), toy(x, s), **FP32_TOL)
        assert compiled.num_graphs_compiled == 1
        assert [split for _, split in compiled.pieces] == [False, True, False, True, False]


def test_instances_are_collected():
    toy = Toy()
    compiled = PiecewiseCompiled(toy, [torch.ops.graphrunner_test.shift_into.default], compile_backend="eager",
                                 token_args=(0, 1))
    compiled(torch.randn(4, 16), torch.rand(4))
    ref = weakref.ref(compiled)
    del compiled
    gc.collect()
    assert ref() is None


def test_argument_errors():
    toy = Toy()
    with pytest.raises(ValueError, match="compile_backend='cudagraphs'"):
        PiecewiseCompiled(toy, [torch.ops.graphrunner_test.shift_into], compile_backend="cudagraphs")
    with pytest.raises(TypeError, match="not a torch.ops operator"):
        PiecewiseCompiled(toy, [_shift_into], compile_backend="eager")
    compiled = PiecewiseCompiled(toy, [SHIFT_OP], token_args=(0, 1), compile_backend="eager")
    with pytest.raises(ValueError, match=r"argument 1 has shape \(5,\); expected dim 0 = 4 tokens"):
        compiled(torch.randn(4, 16), torch.rand(5))
    with pytest.raises(ValueError, match="token_args=\\(0, 1\\) but the call has 1 arguments"):
        compiled(torch.randn(4, 16))
    with pytest.raises(ValueError, match="num_tokens=0 must be >= 1"):
        compiled(torch.randn(0, 16), torch.rand(0))


# --------------------------------------------------------------------------- GPU: real graphs


@pytest.mark.gpu
def test_gpu_toy_graphs_pool_and_address_checks():
    """Graph mechanics with cheap pieces: replay equals eager after input rewrites, sizes
    share one pool, a moved input is caught, release() frees the pool."""
    device = torch.device("cuda")
    toy = Toy(device=device)
    compiled = PiecewiseCompiled(toy, [torch.ops.graphrunner_test.shift_into], token_args=(0, 1),
                                 compile_backend="eager", check_addresses=True)
    x_buf, s_buf = torch.randn(64, 16, device=device), torch.rand(64, device=device)
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    # Warm up in inference mode, like every later call (grad mode is part of dynamo's
    # guards), and on both streams, so that their cuBLAS workspaces exist before memory
    # is measured.
    with torch.inference_mode():
        toy(x_buf[:5], s_buf[:5])
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(x_buf[:5], s_buf[:5])
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()
    with torch.inference_mode():
        for n in (64, 8, 1):
            out = compiled.capture(x_buf[:n], s_buf[:n], pool=pool, stream=stream)
            torch.testing.assert_close(out, toy(x_buf[:n], s_buf[:n]))  # capture returns real results
        del out
        assert compiled.captured_sizes == [64, 8, 1]
        for n in (1, 64, 8, 8):
            x_buf.normal_()
            s_buf.uniform_()
            torch.testing.assert_close(compiled(x_buf[:n], s_buf[:n]), toy(x_buf[:n], s_buf[:n]))
        assert all(e.replayed for p in compiled._backend.pieces for e in p.entries.values())
        # Not captured: compiled code, no graph.
        torch.testing.assert_close(compiled(x_buf[:5], s_buf[:5]), toy(x_buf[:5], s_buf[:5]))
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        reserved_captured = torch.cuda.memory_reserved()

    w2 = toy.w2.data
    toy.w2.data = w2.clone()  # a piece input moves (outside inference mode, as the weights were made)
    with torch.inference_mode():
        with pytest.raises(AddressMismatchError, match=r"piece 'submod_2' at num_tokens=8: input \d+ \(\w*w2\w*\)"):
            compiled(x_buf[:8], s_buf[:8])
    assert compiled.num_graphs_compiled == 1  # the check fired, not a recompile
    toy.w2.data = w2
    compiled.release()
    gc.collect()
    torch.cuda.empty_cache()
    reserved_released = torch.cuda.memory_reserved()
    assert compiled.captured_sizes == [] and all(not p.entries for p in compiled._backend.pieces)
    assert reserved_captured > reserved_before, (reserved_before, reserved_captured)
    assert reserved_released < reserved_captured, (reserved_before, reserved_captured, reserved_released)
    assert reserved_released <= reserved_before, (reserved_before, reserved_captured, reserved_released)
    with torch.inference_mode():  # still usable after release
        torch.testing.assert_close(compiled(x_buf[:8], s_buf[:8]), toy(x_buf[:8], s_buf[:8]))


def _bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """bf16, 4 layers, inductor fusions vs eager rounding: bounded relative to the scale."""
    scale = want.float().abs().max().item() + 1e-6
    err = (got.float() - want.float()).abs()
    assert err.max().item() <= 0.05 * scale and err.mean().item() <= 0.005 * scale, (
        f"{what}: max err {err.max().item():.4g}, mean err {err.mean().item():.4g}, scale {scale:.4g}"
    )


@pytest.mark.gpu
def test_gpu_inductor_graphs_match_eager():
    device = torch.device("cuda")
    h = make_harness(4, torch.bfloat16, device, get_attention_backend(device))
    compiled = piecewise(h, "inductor", check_addresses=True)
    vocab = h.config.vocab_size
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    # Per size: a capture workload, then replays whose real tokens fill or under-fill it.
    plan = {
        64: [[(0, 30), (9, 20), (3, 14)], [(0, 40), (12, 10)]],  # 64 real; 50 real + 14 pad
        8: [[(6, 1)] * 8, [(0, 5)], [(3, 1), (17, 1), (0, 3)]],  # 8 decodes; 5 + 3 pad; 5 + 3 pad
        1: [[(4, 1)], [(21, 1)]],
    }
    with torch.inference_mode():
        for n, workloads in plan.items():  # largest first
            for i, reqs in enumerate(workloads):
                step = make_step(reqs, n - sum(q for _, q in reqs), vocab=vocab, seed=100 * n + i)
                ref_caches = make_caches(h.config, h.dtype, device, i)
                caches = make_caches(h.config, h.dtype, device, i)
                ref = h.reference(step, ref_caches)
                if i == 0 and n not in compiled.captured_sizes:
                    # Compiled code, no graph, at this size: the yardstick for replay.
                    plain = h.run(compiled, step, make_caches(h.config, h.dtype, device, i)).clone()
                    out = h.run(compiled, step, caches, capture=True, pool=pool, stream=stream).clone()
                    torch.testing.assert_close(out, plain, atol=1e-2, rtol=1e-2)
                else:
                    out = h.run(compiled, step, caches).clone()  # replay
                _bf16_close(out[: step.num_real], ref, f"hidden, size {n}, workload {i}")
                owned = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
                owned[owned_slots(step)] = True
                for layer, (got, want) in enumerate(zip(caches, ref_caches, strict=True)):
                    got_flat, want_flat = got.flatten(1, 2).cpu(), want.flatten(1, 2).cpu()
                    assert torch.equal(got_flat[:, ~owned], want_flat[:, ~owned]), f"layer {layer}: stray KV write"
                    _bf16_close(got_flat[:, owned], want_flat[:, owned], f"KV layer {layer}, size {n}")
        assert compiled.captured_sizes == [64, 8, 1]
        assert compiled.num_graphs_compiled == 1
        assert all(set(p.entries) == {64, 8, 1} and all(e.replayed for e in p.entries.values())
                   for p in compiled._backend.pieces)
    compiled.release()
    assert compiled.captured_sizes == [] and all(not p.entries for p in compiled._backend.pieces)
