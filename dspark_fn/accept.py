"""Accept rules: which drafted tokens the target keeps, and what it emits after them.

``block = [anchor, x_1 .. x_{W-1}]``; row ``j`` of the target's output
predicts the token after ``block[:, j]``. ``limit [B]`` caps how many drafts a
row may accept (its proposal length this round); drafts past it are verified
for free but never kept, so every rule stays exact under a shorter proposal.
``allowed [B, W, V]`` (default all) is each position's constraint: every rule
reads the target's constrained distribution (``sampling.log_probs``), so a
proposal the grammar refuses has probability 0 and is never kept.
"""

from typing import NamedTuple

import mlx.core as mx

from .rng import gumbel_argmax
from .sampling import Mode, RowSampling, constrained, log_probs

RESIDUAL_FLOOR = 1e-8  # below this residual mass, fall back to the target distribution


class Verdict(NamedTuple):
    accepted: mx.array  # [B] leading drafted tokens kept
    next_tokens: mx.array  # [B] the target's own token after them (next anchor)
    emitted: mx.array  # [B, W] kept drafts then next token, padded with -1


def leading_run(matches: mx.array) -> mx.array:
    """Length of the leading run of ``True`` along the last axis."""
    return mx.cumprod(matches.astype(mx.int32), axis=-1).sum(axis=-1)


def emitted_tokens(block: mx.array, accepted: mx.array, next_tokens: mx.array) -> mx.array:
    """``[x_1 .. x_A, next, -1, ...]`` per row, width of the verified block."""
    batch, width = block.shape
    drafted = mx.concatenate([block[:, 1:], mx.zeros((batch, 1), block.dtype)], axis=1)
    slot = mx.arange(width)[None, :]
    count = accepted[:, None]
    out = mx.where(slot < count, drafted, next_tokens[:, None].astype(block.dtype))
    return mx.where(slot <= count, out, -1)


def _full_limit(block: mx.array, limit) -> mx.array:
    return mx.full((block.shape[0],), block.shape[1] - 1, mx.int32) if limit is None else limit


def _accepted(block, accepted, next_tokens) -> Verdict:
    next_tokens = next_tokens.astype(block.dtype)
    return Verdict(accepted=accepted, next_tokens=next_tokens, emitted=emitted_tokens(block, accepted, next_tokens))


def accept_greedy(block: mx.array, target_logits: mx.array, limit=None, allowed=None) -> Verdict:
    """Keep drafts while they equal the target's (constrained) argmax; then emit the argmax.

    Output equals greedy decoding of the target alone.
    """
    choice = mx.argmax(constrained(target_logits, allowed), axis=-1).astype(block.dtype)
    run = leading_run(block[:, 1:] == choice[:, :-1])
    accepted = mx.minimum(run, _full_limit(block, limit))
    next_tokens = mx.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]
    return _accepted(block, accepted, next_tokens)


def acceptance_run(p_draft: mx.array, q_draft: mx.array, uniforms: mx.array) -> mx.array:
    """Leading drafts kept: ``x_k`` survives with probability ``min(1, p/q)``
    (log-probabilities of the drafted tokens, one uniform per slot)."""
    return leading_run(mx.log(uniforms) < p_draft - q_draft)


def correction(p: mx.array, q: mx.array, rejected: mx.array) -> mx.array:
    """Unnormalised distribution of the target's own token: after a rejection
    the residual ``max(p - q, 0)``, after a full accept ``p`` itself (the bonus
    token); ``p`` again where the residual has no mass left."""
    residual = mx.where(rejected, mx.maximum(p - q, 0), p)
    return mx.where(residual.sum(axis=-1, keepdims=True) > RESIDUAL_FLOOR, residual, p)


def accept_sampled(
    block: mx.array,
    target_logits: mx.array,
    draft_log_probs: mx.array,
    rows: RowSampling,
    mode: Mode,
    accept_uniforms: mx.array,
    correction_uniforms: mx.array,
    limit=None,
    allowed=None,
) -> Verdict:
    """Rejection sampling (Leviathan et al. / Chen et al.): the emitted tokens
    are distributed exactly as sampling the target alone under each row's settings.

    Draft ``x_k`` (drawn from ``q_k = exp(draft_log_probs[:, k-1])``) is kept
    with probability ``min(1, p_k(x_k) / q_k(x_k))`` (``accept_uniforms [B, W-1]``);
    at the first rejection the next token is drawn from ``normalize(max(p - q, 0))``
    at that slot, after a full accept from ``p`` at the slot after the last kept
    draft (Gumbel-max over ``correction_uniforms [B, V]``).
    """
    width = block.shape[1]
    limit = _full_limit(block, limit)
    target = log_probs(target_logits, rows, mode, allowed)  # [B, W, V]
    drafts = block[:, 1:, None]
    p_draft = mx.take_along_axis(target[:, :-1], drafts, axis=-1)[..., 0]
    q_draft = mx.take_along_axis(draft_log_probs[:, : width - 1], drafts, axis=-1)[..., 0]
    run = acceptance_run(p_draft, q_draft, accept_uniforms)
    accepted = mx.minimum(run, limit)
    rejected = (run < limit)[:, None]

    slot = accepted[:, None, None]
    p = mx.exp(mx.take_along_axis(target, slot, axis=1)[:, 0])
    q = mx.zeros_like(p)
    if width > 1:  # a rejected slot is always a draft slot, < width - 1
        q = mx.exp(mx.take_along_axis(draft_log_probs, mx.minimum(slot, width - 2), axis=1)[:, 0])
    next_tokens = gumbel_argmax(mx.log(correction(p, q, rejected)), correction_uniforms)
    return _accepted(block, accepted, next_tokens)


def accept(block, target_logits, draft_log_probs, rows: RowSampling, mode: Mode, uniforms, limit=None,
           allowed=None) -> Verdict:
    """Each row's rule: greedy rows keep matching drafts, drawing rows reject
    by sampling. ``uniforms()`` -> ``(accept [B, W-1], correction [B, V])``,
    called only when some row draws."""
    if not mode.sampled:
        return accept_greedy(block, target_logits, limit, allowed)
    sampled = accept_sampled(block, target_logits, draft_log_probs, rows, mode, *uniforms(), limit, allowed)
    if not mode.greedy:
        return sampled
    greedy = accept_greedy(block, target_logits, limit, allowed)
    drawing = rows.temperature > 0
    return Verdict(*(mx.where(drawing.reshape(-1, *[1] * (g.ndim - 1)), s, g) for g, s in zip(greedy, sampled)))
