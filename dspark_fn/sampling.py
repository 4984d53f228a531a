"""Sampling settings and the distribution they define over the vocabulary.

The same transform (a constraint's mask, then temperature, then top-k, then
top-p) is applied to the target's logits and to the draft's Markov-corrected
logits, so rejection sampling compares the two distributions the tokens were
really drawn from. A constraint enters as bits (``allowed_tokens``): the
grammar's allowed tokens at each position, all ones where a row has none.
Each row of a batch has its own settings (``RowSampling``, arrays); a kernel
is compiled per ``Mode`` only (which kinds of rows and filters a batch has).
"""

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from .rng import gumbel_argmax

GREEDY_BELOW = 1e-5  # temperatures under this mean argmax (DeepSpec's cut)


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


GREEDY = Sampling()


class RowSampling(NamedTuple):
    """Each row's settings as ``[B]`` arrays (temperature 0: greedy; top_k 0
    and top_p 1: off), so rows with different settings share one kernel."""

    temperature: mx.array
    top_k: mx.array
    top_p: mx.array


@dataclass(frozen=True)
class Mode:
    """What a batch's settings ask a kernel to compute: its compile key."""

    greedy: bool = True  # some row takes the argmax
    sampled: bool = False  # some row draws
    top_k: bool = False  # some drawing row filters by top-k
    top_p: bool = False  # some drawing row filters by top-p


class BatchSampling(NamedTuple):
    """A batch's settings ready for the kernels: the per-row arrays and the mode they compile for."""

    rows: RowSampling
    mode: Mode


def batch_sampling(sampling: "Sampling | Sequence[Sampling] | BatchSampling", rows: int) -> BatchSampling:
    """One ``Sampling`` for every row, or one per row -> arrays and mode (a
    ``BatchSampling`` already made is returned as it is)."""
    if isinstance(sampling, BatchSampling):
        if sampling.rows.temperature.shape[0] != rows:
            raise ValueError(f"sampling settings for {sampling.rows.temperature.shape[0]} rows, not {rows}")
        return sampling
    settings = [sampling] * rows if isinstance(sampling, Sampling) else list(sampling)
    if len(settings) != rows:
        raise ValueError(f"{len(settings)} sampling settings for {rows} rows")
    drawing = [s for s in settings if not s.greedy]
    mode = Mode(
        greedy=len(drawing) < rows,
        sampled=bool(drawing),
        top_k=any(0 < s.top_k for s in drawing),
        top_p=any(s.top_p < 1 for s in drawing),
    )
    arrays = RowSampling(
        temperature=mx.array([0.0 if s.greedy else s.temperature for s in settings], mx.float32),
        top_k=mx.array([s.top_k for s in settings], mx.int32),
        top_p=mx.array([s.top_p for s in settings], mx.float32),
    )
    return BatchSampling(arrays, mode)


def _per_row(values: mx.array, like: mx.array) -> mx.array:
    """``[B]`` -> broadcastable against ``like [B, ..., V]``."""
    return values.reshape(values.shape[0], *([1] * (like.ndim - 1)))


def keep_top_k(scores: mx.array, k: mx.array) -> mx.array:
    """Mask all but each row's ``k`` largest scores (ties with the k-th are
    kept; ``k`` 0 keeps everything)."""
    ranked = -mx.sort(-scores, axis=-1)
    k = _per_row(k, scores)
    kth = mx.take_along_axis(ranked, mx.broadcast_to(mx.clip(k - 1, 0, scores.shape[-1] - 1), (*scores.shape[:-1], 1)), -1)
    return mx.where((k == 0) | (scores >= kth), scores, -mx.inf)


def keep_top_p(scores: mx.array, p: mx.array) -> mx.array:
    """Keep each row's most likely tokens until their mass reaches ``p`` (the
    nucleus): a token is kept when the mass ranked above it is below ``p``;
    the most likely token is always kept."""
    ranked = -mx.sort(-scores, axis=-1)
    probs = mx.softmax(ranked, axis=-1)
    mass_above = mx.cumsum(probs, axis=-1) - probs
    kept = (mass_above < _per_row(p, scores)).sum(axis=-1, keepdims=True)
    cutoff = mx.take_along_axis(ranked, kept - 1, axis=-1)
    return mx.where((scores >= cutoff) | (_per_row(p, scores) >= 1), scores, -mx.inf)


MASK_BITS = 32  # tokens per word of a mask


def mask_words(vocab_size: int) -> int:
    """Words of a mask over ``vocab_size`` tokens: ``ceil(V / 32)``."""
    return -(-vocab_size // MASK_BITS)


def every_token(shape: tuple, vocab_size: int) -> mx.array:
    """Bits ``[*shape, ceil(V / 32)]`` (uint32) allowing every token: the
    mask of a row or position without a constraint."""
    return mx.full((*shape, mask_words(vocab_size)), 0xFFFFFFFF, mx.uint32)


def mask_bits(masks, shape: tuple, vocab_size: int) -> mx.array:
    """Constraint bits ``[*shape, ceil(V / 32)]`` as the kernels read them:
    uint32 (int32 bits, as grammar engines write them, are taken as they
    are); ``None``: every token."""
    if masks is None:
        return every_token(shape, vocab_size)
    if isinstance(masks, np.ndarray) and masks.dtype == np.int32:
        masks = masks.view(np.uint32)
    masks = mx.array(masks)
    expected = (*shape, mask_words(vocab_size))
    if tuple(masks.shape) != expected or masks.dtype not in (mx.uint32, mx.int32):
        raise ValueError(f"constraint masks of shape {tuple(masks.shape)} ({masks.dtype}): these rows and "
                         f"positions need bits of shape {expected}, uint32 (token v is bit v % 32 of word v // 32)")
    return masks.view(mx.uint32) if masks.dtype == mx.int32 else masks


def allowed_tokens(masks: mx.array, vocab_size: int) -> mx.array:
    """``[..., V]`` bool from bits ``[..., ceil(V / 32)]`` (uint32): token
    ``v`` is bit ``v % 32`` of word ``v // 32``. A position whose bits allow
    nothing allows everything: the host never sends one (a grammar at a
    dead end still allows its end of sequence), and a finite distribution
    keeps the kernel's arithmetic finite."""
    bits = (masks[..., None] >> mx.arange(MASK_BITS, dtype=mx.uint32)) & 1
    allowed = bits.reshape(*masks.shape[:-1], -1)[..., :vocab_size].astype(mx.bool_)
    return allowed | (masks == 0).all(axis=-1, keepdims=True)


def constrained(logits: mx.array, allowed: mx.array | None) -> mx.array:
    """``logits`` with the tokens ``allowed [..., V]`` excludes at -inf."""
    return logits if allowed is None else mx.where(allowed, logits, -mx.inf)


def log_probs(logits: mx.array, rows: RowSampling, mode: Mode, allowed: mx.array | None = None) -> mx.array:
    """Log-probabilities ``[B, ..., V]`` of the distribution each drawing row
    samples from (the constraint's mask ``allowed [B, ..., V]``, then
    temperature, then top-k, then top-p); greedy rows get the softmax of
    their constrained logits, which no rule reads."""
    temperature = _per_row(rows.temperature, logits)
    scores = constrained(logits.astype(mx.float32), allowed) / mx.where(temperature > 0, temperature, 1.0)
    if mode.top_k:
        scores = keep_top_k(scores, rows.top_k)
    if mode.top_p:
        scores = keep_top_p(scores, rows.top_p)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def token_log_probs(logits: mx.array, tokens: mx.array, rows: RowSampling, mode: Mode, top: int,
                    allowed: mx.array | None = None):
    """``(log_probs [B, ...], top_ids [B, ..., top], top_log_probs [B, ..., top])``:
    each token's log-probability under the distribution its row chooses from
    (``log_probs``: a drawing row's constrained, tempered, filtered one; a
    greedy row's softmax of the constrained logits), and that distribution's
    ``top`` most likely tokens, most likely first. ``tokens`` of -1 (no
    token) get 0."""
    scores = log_probs(logits, rows, mode, allowed)
    chosen = mx.take_along_axis(scores, mx.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    ids = mx.argpartition(-scores, kth=top - 1, axis=-1)[..., :top]
    values = mx.take_along_axis(scores, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    return mx.where(tokens >= 0, chosen, 0.0), ids.astype(mx.int32), values


def choose(logits: mx.array, rows: RowSampling, mode: Mode, uniforms: mx.array | None,
           allowed: mx.array | None = None) -> mx.array:
    """One token per row of ``logits [B, ..., V]`` among those ``allowed``
    (default all): the argmax for greedy rows, a draw (Gumbel-max over
    ``uniforms`` of the same shape) for the others."""
    best = mx.argmax(constrained(logits, allowed), axis=-1).astype(mx.int32)
    if not mode.sampled:
        return best
    drawn = gumbel_argmax(log_probs(logits, rows, mode, allowed), uniforms)
    if not mode.greedy:
        return drawn
    return mx.where(_per_row(rows.temperature, best) > 0, drawn, best)
