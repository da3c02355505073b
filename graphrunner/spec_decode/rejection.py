"""Rejection sampling for speculative decoding: graph-safe, over static padded shapes.

Each request row `r` brings `num_draft[r]` (0..k) draft tokens and the target model's
logits at k + 1 verified positions: position j scores draft j, and position
`num_draft[r]` gives the bonus token. The row emits its accepted drafts, then one more
token: the correction drawn at the first rejected position, or the bonus token when every
draft was accepted. So a row emits `num_accepted + 1` tokens, between 1 and
`num_draft + 1`.

- Greedy rows (temperature 0): draft j is accepted while it equals the target's argmax at
  j; the next token is the target's argmax there. Exactly what plain greedy decoding gives.
- Random rows with one-hot drafts (`draft_probs` None, e.g. n-gram): verification coupled
  to the plain sampler's noise (`_coupled_one_hot`): the standard rule in distribution, and
  every emitted token is exactly the token plain sampling gives at its position.
- Random rows with a draft distribution: standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023).
  With p_j = softmax(target_logits[r, j] / T) and q_j the drafter's distribution (or a
  one-hot at the draft token when `draft_probs` is None, e.g. n-gram drafts), draft d_j
  is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the
  token is drawn from the normalised residual max(0, p_j - q_j); if all drafts are
  accepted the bonus token is drawn from p_{num_draft}. Every emitted token then has the
  target's distribution, whatever the drafter.

Scope: temperature only. The caller passes the target's fully processed logits (bias,
penalties, allowed ids, min_tokens), with -inf at the tokens that top-k / top-p / min-p
drop. For the same tokens as `Sampler`, that mask must be the sampler's: computed on the
temperature-scaled logits (`x / T`); then `x / T` here equals the sampler's filtered,
scaled logits bit for bit.

Noise (graphrunner.sample.rng, stateless): `key(r, j) = rng.row_keys(seed_r,
positions_r + j)`, the key the plain sampler uses for the token at that position.
- bonus token at j: `argmax(x_j / T + rng.gumbel(key, V))`: the plain sampler's draw, so a
  row with num_draft = 0 gets exactly `Sampler`'s token (torch path; its Triton path
  gives the same tokens).
- acceptance test at j: `u = rng.uniform(hash32(key ^ ACCEPT_SALT), 1)`, accept when
  `u * q_j(d_j) < p_j(d_j)`.
- correction at j: `argmax(log(residual_j) + rng.gumbel(hash32(key ^ RESIDUAL_SALT), V))`.
The two salted streams are independent of each other and of the plain keys, which a
drafter may itself use for its draws at the drafted positions.

Outputs: `out_tokens [R, k + 1]` int32: the accepted drafts, the correction / bonus token,
then `PAD_TOKEN_ID` (-1, an int32 value) in every later slot; `out_num_accepted [R]` int32.
Every element of both is written. Draft ids outside [0, V) (at any slot) are never
accepted; slots at or past `num_draft` are ignored (their ids may be any value), and
`num_draft` is clamped to [0, k]. Greedy rows ignore `draft_probs`.

Graph-safe: fixed shapes, no host sync, no value-dependent control flow; the only
branches are on the static shapes, `draft_probs is None` and `all_greedy`. Memory: one
[R, k, V] float32 temporary (the scaled logits of the drafted positions) plus a few [R, V].
"""

from __future__ import annotations

import torch

from graphrunner.sample import rng
from graphrunner.sample.rng_keys import row_keys

__all__ = ["ACCEPT_SALT", "PAD_TOKEN_ID", "RESIDUAL_SALT", "rejection_sample"]

PAD_TOKEN_ID = -1  # written (as int32) into the slots of out_tokens after the emitted tokens
# Arbitrary distinct odd 32-bit constants (murmur2's multiplier, xxhash's PRIME32_3):
# XORed into the plain key before one more hash32 to give independent noise streams.
ACCEPT_SALT = 0x5BD1E995
RESIDUAL_SALT = 0xC2B2AE3D
SYNTHETIC_SALT = 0x27D4EB2F  # xxhash's PRIME32_2: the synthetic acceptance test's stream

_INT = (torch.int32, torch.int64)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
            device: torch.device) -> None:
    """Raises a ValueError naming `name` when t's shape, dtype or device is not the expected one."""
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name} has shape {list(t.shape)} and dtype {str(t.dtype).removeprefix('torch.')}, "
            f"expected shape {list(shape)} and dtype {want}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of target_logits)")


def _check_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out_tokens: torch.Tensor,
    out_num_accepted: torch.Tensor,
) -> tuple[int, int, int]:
    """Validates every shape and dtype against target_logits [R, k + 1, V]; returns (R, k, V)."""
    if target_logits.dim() != 3 or target_logits.dtype != torch.float32 or 0 in target_logits.shape[1:]:
        raise ValueError(
            f"target_logits has shape {list(target_logits.shape)} and dtype "
            f"{str(target_logits.dtype).removeprefix('torch.')}, expected shape [R, k + 1, V] with k + 1 >= 1, "
            "V >= 1 and dtype float32"
        )
    num_rows, k1, vocab = target_logits.shape
    k = k1 - 1
    dev = target_logits.device
    _expect("draft_token_ids", draft_token_ids, (num_rows, k), _INT, dev)
    _expect("num_draft", num_draft, (num_rows,), (torch.int32,), dev)
    if draft_probs is not None:
        _expect("draft_probs", draft_probs, (num_rows, k, vocab), (torch.float32,), dev)
    _expect("temperature", temperature, (num_rows,), (torch.float32,), dev)
    _expect("seeds", seeds, (num_rows,), (torch.int64,), dev)
    _expect("positions", positions, (num_rows,), (torch.int64,), dev)
    _expect("out_tokens", out_tokens, (num_rows, k1), (torch.int32,), dev)
    _expect("out_num_accepted", out_num_accepted, (num_rows,), (torch.int32,), dev)
    return num_rows, k, vocab


def _random_accept(
    target_logits: torch.Tensor,  # [R, k + 1, V] float32
    drafts: torch.Tensor,  # [R, k] int64, clamped into [0, V)
    draft_probs: torch.Tensor | None,  # [R, k, V] float32, or None = one-hot q
    temp: torch.Tensor,  # [R] float32, T (1 for greedy rows)
    keys: torch.Tensor,  # [R, k + 1] int64, the plain keys per verified position
) -> torch.Tensor:  # [R, k] bool
    """The acceptance test u * q_j(d_j) < p_j(d_j) of every drafted position (random rows)."""
    num_rows, k = drafts.shape
    scaled = target_logits[:, :k] / temp[:, None, None]  # [R, k, V]
    lse = torch.logsumexp(scaled, dim=-1)  # [R, k]
    p_d = torch.exp(scaled.gather(-1, drafts[..., None])[..., 0] - lse)  # [R, k]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)  # [R, k]
    else:
        q_d = draft_probs.gather(-1, drafts[..., None])[..., 0]  # [R, k]
    accept_keys = rng.hash32(keys[:, :k].reshape(-1) ^ ACCEPT_SALT)  # [R * k]
    u = rng.uniform(accept_keys, 1).view(num_rows, k)  # [R, k] in (0, 1)
    return u * q_d < p_d


def _random_next(
    target_logits: torch.Tensor,  # [R, k + 1, V] float32
    drafts: torch.Tensor,  # [R, k] int64, clamped into [0, V)
    draft_probs: torch.Tensor | None,  # [R, k, V] float32, or None = one-hot q
    temp: torch.Tensor,  # [R] float32, T (1 for greedy rows)
    keys: torch.Tensor,  # [R, k + 1] int64
    at: torch.Tensor,  # [R] int64: the position after the accepted run (= num_accepted)
    rejected: torch.Tensor,  # [R] bool: a draft was rejected at `at` (at < num_draft)
) -> torch.Tensor:  # [R] int64
    """The token after the accepted run of a random row: correction or bonus draw."""
    num_rows, k1, vocab = target_logits.shape
    k = k1 - 1
    index = at[:, None, None].expand(num_rows, 1, vocab)  # [R, 1, V]
    scaled = target_logits.gather(1, index)[:, 0] / temp[:, None]  # [R, V]: the sampler's x / T, bit for bit
    key = keys.gather(1, at[:, None])[:, 0]  # [R]
    bonus = (scaled + rng.gumbel(key, vocab)).argmax(dim=-1)  # [R]: the plain sampler's draw
    if k == 0:
        return bonus
    p = torch.softmax(scaled, dim=-1)  # [R, V]
    slot = at.clamp(max=k - 1)  # [R]: a valid draft slot (unused when not rejected)
    if draft_probs is None:
        residual = p.scatter(-1, drafts.gather(1, slot[:, None]), 0.0)  # [R, V]: max(0, p - onehot)
    else:
        q = draft_probs.gather(1, slot[:, None, None].expand(num_rows, 1, vocab))[:, 0]  # [R, V]
        residual = (p - q).clamp(min=0.0)  # [R, V]
    # A rejection implies mass in the residual unless p and q differ only by rounding: then
    # fall back to p itself (never reached with normalised p and q).
    has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [R, 1]
    log_residual = torch.where(has_mass, residual.log(), scaled)  # [R, V]
    residual_keys = rng.hash32(key ^ RESIDUAL_SALT)  # [R]
    correction = (log_residual + rng.gumbel(residual_keys, vocab)).argmax(dim=-1)  # [R]
    return torch.where(rejected, correction, bonus)


def _coupled_one_hot(
    target_logits: torch.Tensor,  # [R, k + 1, V] float32
    drafts: torch.Tensor,  # [R, k] int64, clamped into [0, V)
    valid: torch.Tensor,  # [R, k] bool
    is_greedy: torch.Tensor,  # [R] bool
    temperature: torch.Tensor,  # [R] float32
    seeds: torch.Tensor,  # [R] int64
    positions: torch.Tensor,  # [R] int64
    target_argmax: torch.Tensor,  # [R, k + 1]
    out_tokens: torch.Tensor,  # [R, k + 1] int32
    out_num_accepted: torch.Tensor,  # [R] int32
) -> None:
    """One-hot drafts (no draft distribution): verification coupled to the plain sampler.

    Slot j's token is the plain sampler's draw at its position, `argmax(x_j / T +
    gumbel(key_j))` (argmax x_j for greedy rows), and draft j is accepted iff it equals that
    token. For a one-hot q this is the standard rule in distribution — draft d is accepted
    with probability p(d) = min(1, p(d) / q(d)), and a rejected slot's token is a draw from
    p conditioned on not being d, the normalised residual max(0, p - q) — with the noise
    shared with plain decoding, so every emitted token is the one plain decoding gives at
    that position: a seeded request's tokens do not depend on its drafts, batch, graph mode
    or preemptions, and match non-speculative decoding.
    """
    num_rows, k1, vocab = target_logits.shape
    k = k1 - 1
    slots = torch.arange(k1, device=target_logits.device)
    temp = torch.where(is_greedy, 1.0, temperature)  # [R]
    keys = rng.row_keys(seeds[:, None].expand(num_rows, k1).reshape(-1),
                        (positions[:, None] + slots[None, :]).reshape(-1))  # [R * (k + 1)]
    scaled = target_logits / temp[:, None, None]  # [R, k + 1, V]: the sampler's x / T, bit for bit
    drawn = (scaled + rng.gumbel(keys, vocab).view(num_rows, k1, vocab)).argmax(dim=-1)  # [R, k + 1]
    sample = torch.where(is_greedy[:, None], target_argmax, drawn)  # [R, k + 1]
    accept = (sample[:, :k] == drafts) & valid  # [R, k]
    num_accepted = accept.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [R]
    out_tokens.copy_(sample.masked_fill(slots[None, :] > num_accepted[:, None], PAD_TOKEN_ID))
    out_num_accepted.copy_(num_accepted)


def rejection_sample(
    target_logits: torch.Tensor,  # [R, k + 1, V] float32, processed (and filtered) target logits
    draft_token_ids: torch.Tensor,  # [R, k] int32 / int64
    num_draft: torch.Tensor,  # [R] int32 in 0..k (0: padded row or plain decode)
    draft_probs: torch.Tensor | None,  # [R, k, V] float32, or None: one-hot at the draft token
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    seeds: torch.Tensor,  # [R] int64
    positions: torch.Tensor,  # [R] int64: position of the first token sampled (verified slot 0)
    out_tokens: torch.Tensor,  # [R, k + 1] int32, written in place (PAD_TOKEN_ID after the emitted)
    out_num_accepted: torch.Tensor,  # [R] int32, written in place
    *,
    all_greedy: bool,  # static: every row has temperature 0 (skips the random path entirely)
    synthetic_acceptance_rate: float | None = None,  # static: the benchmarking aid (below)
) -> None:
    """Verifies the drafts of every row and writes the emitted tokens; see the module docstring.

    `synthetic_acceptance_rate` (vLLM's "synthetic" method, a benchmarking aid, never the
    target's distribution): each valid draft is accepted with that probability whatever the
    models say, and the token after the run is the target's own draw there. Raises
    ValueError when a tensor's shape, dtype or device does not match target_logits.
    """
    num_rows, k, vocab = _check_inputs(target_logits, draft_token_ids, num_draft, draft_probs, temperature,
                                       seeds, positions, out_tokens, out_num_accepted)
    dev = target_logits.device
    slots = torch.arange(k + 1, device=dev)  # [k + 1]
    raw = draft_token_ids.long()  # [R, k]
    valid = (slots[None, :k] < num_draft.long().clamp(0, k)[:, None]) & (raw >= 0) & (raw < vocab)  # [R, k]
    drafts = raw.clamp(0, vocab - 1)  # [R, k]: safe to gather with
    target_argmax = target_logits.argmax(dim=-1)  # [R, k + 1]
    accept = target_argmax[:, :k] == drafts  # [R, k]: the greedy test
    is_greedy = temperature == 0.0  # [R]
    synthetic = synthetic_acceptance_rate is not None
    if draft_probs is None and not synthetic and not all_greedy:
        _coupled_one_hot(target_logits, drafts, valid, is_greedy, temperature, seeds, positions, target_argmax,
                         out_tokens, out_num_accepted)
        return
    if not all_greedy or synthetic:
        temp = torch.where(is_greedy, 1.0, temperature)  # [R]
        keys = row_keys(seeds[:, None].expand(num_rows, k + 1).reshape(-1),
                        (positions[:, None] + slots[None, :]).reshape(-1)).view(num_rows, k + 1)  # one kernel on CUDA
    if synthetic_acceptance_rate is not None:
        u = rng.uniform(rng.hash32(keys[:, :k].reshape(-1) ^ SYNTHETIC_SALT), 1).view(num_rows, k)  # [R, k]
        accept = u < synthetic_acceptance_rate
    elif not all_greedy:
        random_accept = _random_accept(target_logits, drafts, draft_probs, temp, keys)
        accept = torch.where(is_greedy[:, None], accept, random_accept)
    accept = accept & valid
    num_accepted = accept.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [R] int64: leading accepted run
    at = num_accepted.long()  # [R]
    next_token = target_argmax.gather(1, at[:, None])[:, 0]  # [R]: the greedy rows' token
    if not all_greedy:
        # Synthetic: the target's own draw after the run (no residual: nothing was rejected by it).
        rejected = torch.zeros_like(is_greedy) if synthetic else at < num_draft.long().clamp(0, k)  # [R]
        sampled = _random_next(target_logits, drafts, draft_probs, temp, keys, at, rejected)
        next_token = torch.where(is_greedy, next_token, sampled)
    drafts_ext = torch.cat([drafts, drafts.new_zeros(num_rows, 1)], dim=1)  # [R, k + 1]
    emitted = torch.where(slots[None, :] == at[:, None], next_token[:, None], drafts_ext)  # [R, k + 1]
    out_tokens.copy_(emitted.masked_fill(slots[None, :] > at[:, None], PAD_TOKEN_ID))
    out_num_accepted.copy_(num_accepted)
