"""Sampling settings and the distribution they define over the vocabulary.

The same transform (temperature, then top-k, then top-p) is applied to the
target's logits and to the draft's Markov-corrected logits, so rejection
sampling compares the two distributions the tokens were really drawn from.
Each row of a batch has its own settings (``RowSampling``, arrays); a kernel
is compiled per ``Mode`` only (which kinds of rows and filters a batch has).
"""

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import mlx.core as mx

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


def log_probs(logits: mx.array, rows: RowSampling, mode: Mode) -> mx.array:
    """Log-probabilities ``[B, ..., V]`` of the distribution each drawing row
    samples from (temperature, then top-k, then top-p); greedy rows get their
    untempered softmax, which no rule reads."""
    temperature = _per_row(rows.temperature, logits)
    scores = logits.astype(mx.float32) / mx.where(temperature > 0, temperature, 1.0)
    if mode.top_k:
        scores = keep_top_k(scores, rows.top_k)
    if mode.top_p:
        scores = keep_top_p(scores, rows.top_p)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def token_log_probs(logits: mx.array, tokens: mx.array, rows: RowSampling, mode: Mode, top: int):
    """``(log_probs [B, ...], top_ids [B, ..., top], top_log_probs [B, ..., top])``:
    each token's log-probability under the distribution its row chooses from
    (``log_probs``: a drawing row's tempered, filtered one; a greedy row's
    softmax of the logits), and that distribution's ``top`` most likely
    tokens, most likely first. ``tokens`` of -1 (no token) get 0."""
    scores = log_probs(logits, rows, mode)
    chosen = mx.take_along_axis(scores, mx.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    ids = mx.argpartition(-scores, kth=top - 1, axis=-1)[..., :top]
    values = mx.take_along_axis(scores, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    return mx.where(tokens >= 0, chosen, 0.0), ids.astype(mx.int32), values


def choose(logits: mx.array, rows: RowSampling, mode: Mode, uniforms: mx.array | None) -> mx.array:
    """One token per row of ``logits [B, ..., V]``: the argmax for greedy rows,
    a draw (Gumbel-max over ``uniforms`` of the same shape) for the others."""
    best = mx.argmax(logits, axis=-1).astype(mx.int32)
    if not mode.sampled:
        return best
    drawn = gumbel_argmax(log_probs(logits, rows, mode), uniforms)
    if not mode.greedy:
        return drawn
    return mx.where(_per_row(rows.temperature, best) > 0, drawn, best)
