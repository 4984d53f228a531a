"""Prompts into the cache: ``prefill`` runs them through the target in fixed
chunks (and extends the draft's context), ``insert`` prefills new prompts
into free rows of a running batch.

Chunks hold ``LONG_PREFILL_CHUNK`` tokens while that many remain, then the
smallest chunk (``smallest_chunk``: smaller as more rows prefill together);
a prompt pads to a multiple of it. One
chunk kernel serves every prompt length (per capacity bucket), and each row
continues from its own committed length, so a cached conversation prefix
prefills only the rest.
"""

import math
from functools import lru_cache
from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from . import blas, rng
from .buffers import capacity_for, check_rows, check_writes, grow_cache, init_cache, place_rows
from .cache import Cache, device_state, map_arrays, write_tokens
from .interfaces import ImageInputs
from .kernel import compiled
from .rng import row_seeds, uniforms
from .sampling import GREEDY, Mode, RowSampling, allowed_tokens, batch_sampling, choose, mask_bits, token_log_probs
from .targets import activation_dtype
from .types import ImagePrompt, PairSpec, Params, TokenLogProbs, prompt_key

PREFILL_CHUNK = 64  # the smallest chunk where bigger matmuls cost less per token
LINEAR_PREFILL_CHUNK = 8  # the smallest chunk where a forward costs in proportion to its tokens
LONG_PREFILL_CHUNK = 256  # long stretches of a prompt go in these (bigger matmuls run faster)


def smallest_chunk(rows: int = 1) -> int:
    """The smallest chunk for ``rows`` prompts prefilled together. A chunk's
    matmuls take ``rows x chunk`` tokens, and up to ``PREFILL_CHUNK`` of them
    a bigger matmul costs less per token (OpenBLAS, Accelerate, GPUs), so a
    few padded tokens cost less than more forwards: one row takes chunks of
    ``PREFILL_CHUNK``, more rows a chunk as much smaller (down to
    ``LINEAR_PREFILL_CHUNK``: eight rows of short prompts, each padded to 64,
    took six times as long as in chunks of 8: BENCHMARK 0p). On the CPU over
    MLX's bundled reference BLAS every padded token costs what a real one
    does, so chunks are ``LINEAR_PREFILL_CHUNK`` for any rows (a 69-token
    prompt padded to 128 took 1.6x mlx-lm's prefill there, in 8-token chunks 0.86x: BENCHMARK 0n)."""
    if mx.default_device() == mx.cpu and blas.reference_blas():
        return LINEAR_PREFILL_CHUNK
    return max(LINEAR_PREFILL_CHUNK, PREFILL_CHUNK >> (max(rows, 1) - 1).bit_length())


@lru_cache(maxsize=None)
def _chunk_kernel(spec: PairSpec, top: int = 0, images: bool = False):
    """The prefill of one chunk. With ``top`` (K > 0) it also scores every
    position's next prompt token (``following``, -1 where there is none):
    its log-probability under the target's softmax and the K most likely
    tokens there, from the same logits (the head then runs at every position).
    With ``images`` it takes the chunk's ``ImageInputs`` (the family's forward
    puts the image features in and records taps at every position, images
    included, so the draft's context covers them)."""

    def chunk(target, draft, cache: Cache, tokens, start, first, last_row, last_logits, *extra):
        """One chunk of every row's prompt at positions ``start[b] + i``; keeps
        the target's logits at each row's last prompt token once a chunk holds it."""
        adapter = spec.target_adapter
        media = {"images": extra[0]} if images else {}
        if adapter.prompt_forward is None:
            hidden, features, target_kv = adapter.forward(spec.target, target, cache.target, tokens, start, spec.taps,
                                                           **media)
        else:
            hidden, features, target_kv = adapter.prompt_forward(
                spec.target, target, cache.target, tokens, start, spec.taps, first, last_row + 1, **media
            )
        draft_state = spec.draft_arch.extend_context(spec.draft, draft, cache.draft, features, start)
        row = last_row - start
        in_chunk = (row >= 0) & (row < tokens.shape[1])
        picked = mx.take_along_axis(hidden, mx.clip(row, 0, tokens.shape[1] - 1)[:, None, None], axis=1)
        logits = adapter.logits(spec.target, target, picked[:, 0])
        state = cache._replace(target=target_kv, draft=draft_state, history=write_tokens(cache.history, tokens, start))
        if not top:
            return state, mx.where(in_chunk[:, None], logits, last_logits)
        following = extra[-1]
        return state, mx.where(in_chunk[:, None], logits, last_logits), next_token_scores(
            adapter.logits(spec.target, target, hidden), following, top
        )

    return compiled(("score" if top else "prefill") + ("_images" if images else ""), chunk)


def next_token_scores(logits: mx.array, following: mx.array, top: int) -> TokenLogProbs:
    """``[B, L]``: each ``following`` token's log-probability under the softmax
    of ``logits [B, L, V]`` (0 where it is -1), and the ``top`` most likely
    tokens there, most likely first."""
    plain = RowSampling(*(mx.full(logits.shape[:1], value) for value in (0.0, 0, 1.0)))
    return TokenLogProbs(*token_log_probs(logits, following, plain, Mode(), top))


def as_rows(prompt) -> list:
    """One entry per row: a token list, or an ``ImagePrompt`` as it came."""
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    if isinstance(prompt, ImagePrompt):
        prompt = [prompt]
    rows = [list(prompt)] if prompt and isinstance(prompt[0], int) else [
        r if isinstance(r, ImagePrompt) else list(r) for r in prompt]
    if not rows or any(len(row_tokens(r)) == 0 for r in rows):
        raise ValueError("prompt is empty: give at least one token per row")
    return rows


def row_tokens(row) -> list[int]:
    """The token ids a row still prefills (an ``ImagePrompt``'s part after its cached prefix)."""
    return row.rest if isinstance(row, ImagePrompt) else row


def _distinct_rows(rows: list, starts: np.ndarray) -> tuple[list[int], list[int]]:
    """Rows that run: the first of each group of fresh rows (nothing committed)
    with equal prompts (their images' contents included), and every row with
    a committed prefix of its own; and for each row the index of the one that
    runs for it."""
    first_seen: dict = {}
    keys = [tuple(prompt_key(r)) if start == 0 else ("prefix", i)
            for i, (r, start) in enumerate(zip(rows, starts))]
    source = [first_seen.setdefault(key, len(first_seen)) for key in keys]
    return [source.index(i) for i in range(len(first_seen))], source


def chunk_spans(length: int, sizes: tuple, whole: tuple = ()) -> list[tuple[int, int]]:
    """``(begin, size)`` of each chunk covering ``length`` (a multiple of the
    smallest size): the largest size that still fits first, stretched (in
    steps of the smallest) where it would cut one of the ``whole`` spans
    ``(first, end)`` (images that attend to themselves both ways)."""
    spans, begin = [], 0
    while begin < length:
        end = begin + next(size for size in sizes if begin + size <= length)
        while cut := [stop for first, stop in whole if first < end < stop]:
            end = math.ceil(max(cut) / sizes[-1]) * sizes[-1]
        spans.append((begin, end - begin))
        begin = end
    return spans


def split_chunks() -> bool:
    """Whether each chunk must run before the next is built: over several
    ranks a chunk's forward meets the others in collectives, and chunks left
    lazy together may be scheduled in another order on each rank (a pipeline
    stage's graph holds other layers than the next stage's), pairing one
    chunk's sum with another's (a 130-token prompt in three chunks of 64 on
    two pipeline ranks gave another first token)."""
    return mx.distributed.init().size() > 1


def prefill_slots(prompt_length: int) -> int:
    """Slots a prefill writes at most: the prompt padded to whole chunks."""
    return math.ceil(prompt_length / PREFILL_CHUNK) * PREFILL_CHUNK


def prefill(params: Params, cache: Cache, prompt, *, sampling=GREEDY, chunk_size: int | None = None,
            grow: bool = False, top_log_probs: int | None = None, masks=None):
    """Run the prompt(s) through the target in fixed chunks and extend the draft context.

    ``prompt`` is a token list, a list of token lists (one per batch row, any
    lengths) or an int array; a row may be an ``ImagePrompt``
    (``vision.image_prompt``: a prompt with images), whose image features
    enter the target in place of its image tokens' embeddings (the draft's
    context records every position, images included; rounds never see
    pixels). Each row continues from its committed length
    (0 in a fresh cache; a cached conversation prefix otherwise). Returns
    ``(cache, tokens)``: the first generated token of each row (argmax, or a
    draw under the row's ``sampling``), the first anchor. Rows that start
    together with the same tokens (n samples of one prompt) are run once and
    their cache rows copied. ``chunk_size`` makes every chunk that size,
    never more than the capacity. With ``grow`` the cache grows in
    ``capacity_for`` buckets as the chunks advance, so each chunk attends
    over the bucket its own end needs, not the whole prompt's (a long
    prompt compiles one chunk kernel per bucket it passes); without, the
    prompt must fit the cache. With ``top_log_probs`` (K) it returns
    ``(cache, tokens, TokenLogProbs)``: the first tokens' log-probabilities
    and the target's K most likely first tokens. ``masks`` (bits ``[B,
    ceil(V/32)]``, default all ones) constrain each row's first token to
    what its grammar allows at the start (``constraints.next_masks``).
    """
    rows = as_rows(prompt)
    state, last_logits, _ = _run_prompts(params, cache, rows, chunk_size=chunk_size, grow=grow)
    return _first_tokens(params, cache, state, last_logits, rows, sampling, top_log_probs, masks)


def score_prompt(params: Params, cache: Cache, prompt, *, top: int = 1, sampling=GREEDY, grow: bool = False):
    """``prefill`` that also scores the prompt: the log-probability, under the
    target's softmax, of each given token after a row's first (predicted at
    the position before it, from the prefill's own logits), with the ``top``
    (K >= 1) most likely tokens there. Returns ``(cache, tokens,
    TokenLogProbs of the first tokens, TokenLogProbs [B, L - 1] of the
    prompt)``; row b's prompt scores are its first ``len(prompt[b]) - 1``
    entries. The cache is the one ``prefill`` leaves, so generation (or a
    prompt cache) continues from it; a row that continues a cached prefix is
    scored from its first given token on (the prefix's own positions are not
    computed again)."""
    if top < 1:
        raise ValueError(f"top must be at least 1 (the most likely tokens listed with each score), got {top}")
    rows = as_rows(prompt)
    state, last_logits, scored = _run_prompts(params, cache, rows, grow=grow, top=top)
    return (*_first_tokens(params, cache, state, last_logits, rows, sampling, top), scored)


def _run_prompts(params: Params, cache: Cache, rows: list, *, chunk_size: int | None = None, grow: bool = False,
                 top: int = 0):
    """The prompts through the target, chunk by chunk: ``(cache after them, the
    logits at each row's last token, the next-token scores [B, L - 1] or None)``."""
    if len(rows) != cache.batch_size:
        raise ValueError(f"{len(rows)} prompts for a cache of batch size {cache.batch_size}")
    vocab = params.spec.target.vocab_size
    tokens = [row_tokens(r) for r in rows]
    if any(not 0 <= t < vocab for r in tokens for t in r):
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    starts = np.array(cache.length)
    running, source = _distinct_rows(rows, starts)
    sizes = (chunk_size,) if chunk_size else (LONG_PREFILL_CHUNK, smallest_chunk(len(running)))
    sizes = tuple(min(size, cache.capacity) for size in sizes)
    padded_length = math.ceil(max(len(r) for r in tokens) / sizes[-1]) * sizes[-1]
    if not grow and (starts + padded_length).max() > cache.capacity:
        longest = int((starts + np.array([len(r) for r in tokens])).max())
        raise ValueError(
            f"prompt of {longest} tokens does not fit the cache capacity {cache.capacity} "
            f"(prefill pads to {int(starts.max()) + padded_length}); allocate a larger cache or shorten the prompt"
        )
    state = device_state(cache)  # the kernels' part; the policy comes back with the result
    if len(running) < len(rows):  # every cache array is batch-major
        state = map_arrays(lambda a: a[mx.array(running)], state)
    media = image_rows(params, [rows[i] for i in running], starts[running], padded_length)
    offsets = mx.array(starts[running], mx.int32)
    padded = mx.array([tokens[i] + [0] * (padded_length - len(tokens[i])) for i in running], mx.int32)
    following = mx.array([tokens[i][1:] + [-1] * (padded_length - len(tokens[i]) + 1) for i in running], mx.int32)
    last_rows = offsets + mx.array([len(tokens[i]) - 1 for i in running], mx.int32)
    kernel = _chunk_kernel(params.spec, top, media is not None)
    split = split_chunks()
    last_logits, scored = mx.zeros((len(running), vocab), mx.float32), []
    whole = media.whole if media is not None else ()
    for begin, size in chunk_spans(padded_length, sizes, whole):
        if grow:
            state = grow_cache(params, state, capacity_for(int(starts.max()) + begin + size))
        check_writes(starts[running] + begin, size, state.capacity, "prefill chunk", rows=running)
        extra = (media.chunk(begin, size),) if media is not None else ()
        extra += (following[:, begin : begin + size],) if top else ()
        state, last_logits, *chunk_scores = kernel(params.target, params.draft, state, padded[:, begin : begin + size],
                                                   offsets + begin, offsets, last_rows, last_logits, *extra)
        if split:  # one chunk's collectives at a time (``split_chunks``)
            mx.eval(state, last_logits, chunk_scores)
        scored += chunk_scores
    scores = [mx.concatenate(parts, axis=1)[:, : padded_length - 1] for parts in zip(*scored)]  # [] unless top
    if len(running) < len(rows):
        index = mx.array(source)
        state = map_arrays(lambda a: a[index], state)
        last_logits, scores = tree_map(lambda a: a[index], (last_logits, scores))
    lengths = mx.array(starts + np.array([len(r) for r in tokens]), mx.int32)
    return state._replace(length=lengths, policy=cache.policy), last_logits, TokenLogProbs(*scores) if top else None


class ImageRows:
    """The image side of a batch of prompts over their padded prefill
    (``[B, P, ...]``), cut into each chunk's ``ImageInputs``; ``whole`` lists
    the spans no chunk may cut (images that attend to themselves both ways)."""

    def __init__(self, features, mask, offsets, spans, shift, whole):
        self.features, self.mask, self.offsets, self.spans, self.shift = features, mask, offsets, spans, shift
        self.whole = whole

    def chunk(self, begin: int, size: int) -> ImageInputs:
        part = slice(begin, begin + size)
        return ImageInputs(features=self.features[:, part], mask=self.mask[:, part],
                           offsets=self.offsets[:, :, part], spans=self.spans[:, part], shift=self.shift)


def image_rows(params: Params, rows: list, starts: np.ndarray, length: int) -> ImageRows | None:
    """The image side of the rows that run (None when no row has an image
    prompt): each image still to prefill is encoded here (mlx-vlm's tower),
    those inside a cached prefix are not."""
    if not any(isinstance(row, ImagePrompt) for row in rows):
        return None
    batch, width = len(rows), params.spec.target.hidden_size
    dtype = activation_dtype(params.spec.target_adapter.layout, params.target)
    features = mx.zeros((batch, length, width), dtype)
    mask = np.zeros((batch, length), bool)
    offsets = np.zeros((batch, 3, length), np.int32)
    spans = np.full((batch, length), -1, np.int32)
    shift = np.zeros((batch,), np.int32)
    whole = set()
    for b, (row, start) in enumerate(zip(rows, starts)):
        if not isinstance(row, ImagePrompt):
            continue
        if row.first != start:
            raise ValueError(f"row {b}: its image prompt continues after {row.first} tokens but the cache row holds "
                             f"{int(start)}: give the prompt .after(the tokens the row holds)")
        size = len(row.rest)
        slots = row.image_slots()
        begin = 0
        for image in row.images:
            inside = slots[begin : begin + image.count] - row.first
            begin += image.count
            if inside[0] < 0:
                continue  # in the cached prefix: already in the cache, never encoded again
            features[b, mx.array(inside)] = image.encode().astype(dtype)
            mask[b, inside] = True
        if row.positions is not None:
            before = row.shift(row.first)
            index = np.arange(row.first, len(row.tokens))
            offsets[b, :, :size] = row.positions[:, row.first :] - index - before
            shift[b] = row.shift() - before
        if row.spans is not None:
            spans[b, :size] = row.spans[row.first :]
            for span in set(row.spans[row.first :].tolist()) - {-1}:
                where = np.flatnonzero(spans[b] == span)
                whole.add((int(where[0]), int(where[-1]) + 1))
    return ImageRows(features, mx.array(mask), mx.array(offsets), mx.array(spans), mx.array(shift),
                     tuple(sorted(whole)))


def _first_tokens(params: Params, cache: Cache, state: Cache, last_logits, rows: list, sampling, top: int | None,
                  masks=None):
    """Each row's first generated token from its last prompt logits, among
    those its ``masks`` allow (and their scores with ``top``)."""
    settings = batch_sampling(sampling, len(rows))
    vocab = params.spec.target.vocab_size
    draws = uniforms(cache.seeds, state.length, rng.PREFILL, (vocab,)) if settings.mode.sampled else None
    allowed = None if masks is None else allowed_tokens(mask_bits(masks, (len(rows),), vocab), vocab)
    state, tokens = state._replace(seeds=cache.seeds), choose(last_logits, *settings, draws, allowed)
    if top is None:
        return state, tokens
    return state, tokens, TokenLogProbs(*token_log_probs(last_logits, tokens, *settings, top, allowed))


def insert(params: Params, cache: Cache, rows: Sequence[int], prompts, *, sampling=GREEDY, seeds: Sequence[int] = (),
           prefix: Cache | None = None, grow: bool = False, top_log_probs: int | None = None, masks=None):
    """Prefill new prompts into rows ``rows`` of a running batch, together in
    one batch of their own; the other rows are untouched. Row ``rows[i]``
    draws with seed ``seeds[i]`` (default 0). ``prefix`` (a one-row cache
    holding the first ``prefix.length`` tokens of a single prompt, e.g. a
    cached conversation) is reused: only the rest runs. With ``grow`` the
    new rows prefill in a cache of their own size (see ``prefill``) and the
    batch grows if they need more room; without, they must fit the batch's
    capacity. Returns ``(cache, first tokens)`` (and their ``TokenLogProbs``
    with ``top_log_probs``, as ``prefill``); ``masks`` (bits ``[len(rows),
    ceil(V/32)]``) constrain the first tokens, as in ``prefill``."""
    prompts = [p if isinstance(p, ImagePrompt) else list(p) for p in prompts]
    check_rows(list(rows), len(prompts), cache.batch_size)
    seeds = list(seeds) or [0] * len(rows)
    part = prefix if prefix is not None else init_cache(params, len(rows), capacity_for(1) if grow else cache.capacity)
    if not grow:
        part = grow_cache(params, part, cache.capacity)
    part = part._replace(seeds=mx.concatenate([row_seeds(seed, 1) for seed in seeds]))
    starts = np.array(part.length)
    rest = [p.after(int(start)) if isinstance(p, ImagePrompt) else p[start:] for p, start in zip(prompts, starts)]
    part, tokens, *scored = prefill(params, part, rest, sampling=sampling, grow=grow, top_log_probs=top_log_probs,
                                    masks=masks)
    capacity = max(cache.capacity, part.capacity)
    return (place_rows(grow_cache(params, cache, capacity), rows, grow_cache(params, part, capacity)), tokens, *scored)
