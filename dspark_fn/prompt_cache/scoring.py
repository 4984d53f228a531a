"""Prompts scored together, each shared prefix prefilled once.

An evaluation harness scores many prompts that share long beginnings (the
few-shot context of a question, and each of its choices after it). Scoring
a prompt needs every position's logits, so a prefix can be reused for it
only with the scores its own positions gave: a ``ScoredPrefix`` is a
one-row cache holding a prompt's first ``n`` tokens with the scores of its
tokens 1..n (the last of them predicted from position ``n - 1``, which the
cache holds). Position ``n`` then runs again with the rest of the prompt,
so that the first token past the prefix is scored from its own logits.

``score_prompts`` takes prefixes from two places: ``known`` (a lookup into
kept scored prompts, such as the server's prompt cache) and the prompts
themselves, where several share a beginning longer than what is known:
that beginning is scored first, once, as a prompt of its own (and so on
down: the shared prefixes may share theirs). Scores through a prefix equal
those of scoring the whole prompt within float rounding (the prefix's
positions were computed over the same tokens, in other chunks).

A target with recurrent layers keeps its state after all of a prompt's
tokens only, so no prefix of it can be resumed: its prompts are scored whole.
"""

from typing import Callable, NamedTuple, Sequence

import mlx.core as mx

from ..buffers import capacity_for, grow_cache, holds_recurrent_states, init_cache, row_cache
from ..cache import Cache, map_arrays
from ..prefilling import PREFILL_CHUNK, score_prompt
from ..rng import row_seeds
from ..sampling import GREEDY
from ..types import ImagePrompt, Params, TokenLogProbs

MIN_SHARED = PREFILL_CHUNK  # tokens a shared beginning must save a prompt to be scored on its own first


class ScoredPrefix(NamedTuple):
    """A prompt's first ``n = cache.length`` tokens in a one-row cache, with
    ``scores [1, n]``: the scores of its tokens 1..n (token ``n`` is the
    first one not in the cache)."""

    cache: Cache
    scores: TokenLogProbs


class ScoredRow(NamedTuple):
    """One prompt scored: ``cache`` (one row holding all of it, in buffers of
    its own), ``first`` (the token its last logits give), ``first_scored``
    (that token's score, ``[1]`` arrays) and ``scores`` (``[1, len - 1]``:
    each prompt token's after the first)."""

    cache: Cache
    first: int
    first_scored: TokenLogProbs
    scores: TokenLogProbs


def cut_scores(scores: TokenLogProbs, count: int) -> TokenLogProbs:
    return TokenLogProbs(*(a[:, :count] for a in scores))


def scored_prefix(cache: Cache, scores: TokenLogProbs, shared: int) -> ScoredPrefix:
    """The reusable part of a scored prompt (``cache`` and its ``scores``)
    whose first ``shared`` tokens begin another prompt: all but the last
    shared position, whose logits must run again to score what follows it."""
    return ScoredPrefix(cache._replace(length=mx.array([shared - 1], mx.int32)), cut_scores(scores, shared - 1))


def common_length(a: tuple, b: tuple) -> int:
    """How many leading tokens ``a`` and ``b`` (tuples both) share."""
    span = min(len(a), len(b))
    if a[:span] == b[:span]:  # the usual case for prompts that share a beginning, compared in one C call
        return span
    return next(i for i in range(span) if a[i] != b[i])


def shared_beginnings(prompts: Sequence[tuple]) -> list[int]:
    """For each prompt, the longest beginning it shares with another prompt
    that does not hold all of it (a prompt that begins another is not cut
    for it: the other is the longer one). Every pair is compared: a pass
    holds a few prompts."""
    return [max([shared for j, other in enumerate(prompts)
                 if j != i and (shared := common_length(prompt, other)) < len(prompt)] + [0])
            for i, prompt in enumerate(prompts)]


def batch_of(params: Params, prefixes: list, seeds: Sequence[int]) -> Cache:
    """One cache whose row b continues ``prefixes[b]`` (a ``ScoredPrefix``,
    or None for an empty row), drawing with seed ``seeds[b]``."""
    capacity = max([capacity_for(1)] + [p.cache.capacity for p in prefixes if p is not None])
    rows = [grow_cache(params, p.cache if p is not None else init_cache(params, 1, capacity), capacity)
            for p in prefixes]
    joined = map_arrays(lambda *parts: mx.concatenate(parts), *rows)
    return joined._replace(seeds=mx.concatenate([row_seeds(seed, 1) for seed in seeds]))


def score_prompts(params: Params, prompts: list, *, top: int, sampling=GREEDY, seeds: Sequence[int] = (),
                  known: Callable | None = None, keep: Callable | None = None) -> list[ScoredRow]:
    """Score each prompt (a token list, or an ``ImagePrompt``: never cut) as
    ``score_prompt`` scores it alone, with ``top`` alternatives a position,
    its first token drawn under ``sampling`` (one for all, or one a prompt)
    with seed ``seeds[i]`` (default 0). ``known(tokens)`` gives a
    ``ScoredPrefix`` of a kept prompt sharing a beginning with ``tokens``
    (or None); ``keep(tokens, cache, scores)`` is told each prompt scored,
    the shared beginnings scored on their way included."""
    seeds = list(seeds) or [0] * len(prompts)
    recurrent = holds_recurrent_states(params)
    cuttable = [not recurrent and not isinstance(p, ImagePrompt) for p in prompts]
    prefixes = [known(p) if known is not None and ok else None for p, ok in zip(prompts, cuttable)]
    beginnings = shared_beginnings([tuple(p) if ok else () for p, ok in zip(prompts, cuttable)])
    worth = {i: tuple(prompts[i][:shared]) for i, shared in enumerate(beginnings)
             if cuttable[i] and shared - (prefixes[i].cache.length.item() if prefixes[i] else 0) >= MIN_SHARED}
    if worth:
        beginnings_first = list(dict.fromkeys(worth.values()))
        for beginning, row in zip(beginnings_first, score_prompts(params, [list(b) for b in beginnings_first],
                                                                  top=top, known=known, keep=keep)):
            for i in (i for i, b in worth.items() if b == beginning):
                prefixes[i] = scored_prefix(row.cache, row.scores, len(beginning))
    cache = batch_of(params, prefixes, seeds)
    rests = [p if prefix is None else p[prefix.cache.length.item():] for p, prefix in zip(prompts, prefixes)]
    cache, first, first_scored, scored = score_prompt(params, cache, rests, top=top, sampling=sampling, grow=True)
    rows = []
    for b, (prompt, prefix, rest) in enumerate(zip(prompts, prefixes, rests)):
        tail = TokenLogProbs(*(a[b : b + 1, : len(rest) - 1] for a in scored))
        scores = tail if prefix is None else TokenLogProbs(
            *(mx.concatenate([before, after], axis=1) for before, after in zip(prefix.scores, tail)))
        row = ScoredRow(row_cache(cache, b, len(prompt)), int(first[b]),
                        TokenLogProbs(*(a[b : b + 1] for a in first_scored)), scores)
        if keep is not None:
            keep(prompt, row.cache, row.scores)
        rows.append(row)
    return rows
