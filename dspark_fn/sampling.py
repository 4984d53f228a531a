"""Sampling settings and the distribution they define over the vocabulary.

The same transform (temperature, then top-k, then top-p) is applied to the
target's logits and to the draft's Markov-corrected logits, so rejection
sampling compares the two distributions the tokens were really drawn from.
Settings are static: each distinct ``Sampling`` is its own compiled kernel.
"""

from dataclasses import dataclass

import mlx.core as mx

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


def keep_top_k(scores: mx.array, k: int) -> mx.array:
    """Mask all but the ``k`` largest scores (ties with the k-th are kept)."""
    if not 0 < k < scores.shape[-1]:
        return scores
    kth = mx.topk(scores, k, axis=-1).min(axis=-1, keepdims=True)
    return mx.where(scores >= kth, scores, -mx.inf)


def keep_top_p(scores: mx.array, p: float) -> mx.array:
    """Keep the most likely tokens until their mass reaches ``p`` (the nucleus).

    A token is kept when the mass of the tokens ranked above it is below
    ``p``; the most likely token is always kept.
    """
    if p >= 1:
        return scores
    ranked = -mx.sort(-scores, axis=-1)
    probs = mx.softmax(ranked, axis=-1)
    mass_above = mx.cumsum(probs, axis=-1) - probs
    kept = (mass_above < p).sum(axis=-1, keepdims=True)
    cutoff = mx.take_along_axis(ranked, kept - 1, axis=-1)
    return mx.where(scores >= cutoff, scores, -mx.inf)


def log_probs(logits: mx.array, sampling: Sampling) -> mx.array:
    """Log-probabilities ``[..., V]`` of the distribution ``sampling`` draws from
    (not for greedy, whose distribution is the argmax)."""
    scores = logits.astype(mx.float32) / sampling.temperature
    scores = keep_top_p(keep_top_k(scores, sampling.top_k), sampling.top_p)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def choose(logits: mx.array, sampling: Sampling, key: mx.array) -> mx.array:
    """One token per row of ``logits [..., V]``: argmax when greedy, else a draw."""
    if sampling.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.random.categorical(log_probs(logits, sampling), key=key).astype(mx.int32)
