"""The training objective (spec §2.4): one anchor block per sampled position,
the inference forward with the context cut at the anchor, and the DeepSpec loss.

With a fixed anchor ``a`` the training logits equal the inference path with
the context cut to positions ``< a``, so training reuses the draft's own
``extend_context`` (whole sequence, once) and ``block_forward`` (one block
per anchor, ``length = a``).
"""

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..drafts.heads import DRAFT_VOCAB_KEY, slot_heads
from ..drafts.vocab import restrict_vocabulary
from .corpus import Corpus

LOSS_DECAY = 4.0  # DeepSpec ``loss_decay_gamma``: slot k weighs exp(-k / 4)
LOSS_WEIGHTS = (0.5, 0.5, 1.0)  # CE, L1, confidence BCE: DeepSpec's 0.1 / 0.9 / 1.0 ranked lower on held-out prompts


class Batch(NamedTuple):
    tokens: mx.array  # [B, S]
    loss_mask: mx.array  # [B, S]
    features: mx.array  # [B, S, F]
    top_ids: mx.array  # [B, S, K]
    top_probs: mx.array  # [B, S, K]
    anchors: mx.array  # [B, N] anchor positions
    anchor_valid: mx.array  # [B, N] bool (False for padding anchors)


def training_forward(arch, spec, params: dict, features, tokens, anchors):
    """Draft logits for every anchor block of every sequence.

    ``features [B, S, F]``, ``tokens [B, S]``, ``anchors [B, N]``. The context
    is projected once per sequence and every anchor's block sits beside the
    others in its sequence's row, attending to the context slots ``< a``
    (``length = a``) and to its own block, as at inference.
    Returns Markov-corrected logits ``[B, N, G, V]`` and confidence logits
    ``[B, N, G]`` with teacher-forced previous tokens ``tok_{a+k}``.
    """
    batch, length = tokens.shape
    count = anchors.shape[1]
    block = spec.block_size
    state = arch.init_context(spec, batch, length)
    state = arch.extend_context(spec, params, state, features, mx.zeros((batch,), mx.int32))
    anchor_tokens = mx.take_along_axis(tokens, anchors, axis=1).astype(mx.int32)
    masks = mx.full((batch, count, block - 1), spec.mask_token_id, mx.int32)
    block_ids = mx.concatenate([anchor_tokens[..., None], masks], axis=2).reshape(batch, count * block)
    base, hidden = arch.block_forward(spec, params, state, anchors, block_ids)
    flat = (batch * count, block)
    prev = _block_tokens(tokens, anchors, block, 0).reshape(flat)
    logits, confidence = slot_heads(spec, params, base.reshape(*flat, -1), hidden.reshape(*flat, -1), prev)
    shape = (batch, count, block)
    return logits.reshape(*shape, -1), confidence.reshape(shape)


def _block_tokens(values, anchors, block, offset):
    """``values[b, a + offset + k]`` for k < block, clipped to the sequence: ``[B, N, G, ...]``."""
    length = values.shape[1]
    index = mx.clip(anchors[..., None] + offset + mx.arange(block), 0, length - 1)
    flat = index.reshape(index.shape[0], -1)
    if values.ndim == 2:
        return mx.take_along_axis(values, flat, axis=1).reshape(index.shape)
    gathered = mx.take_along_axis(values, flat[..., None], axis=1)
    return gathered.reshape(*index.shape, values.shape[-1])


def slot_weights(batch: Batch, block: int) -> mx.array:
    """``exp(-k/4)`` on each block's contiguous prefix of valid labels, else 0."""
    length = batch.tokens.shape[1]
    label_index = batch.anchors[..., None] + 1 + mx.arange(block)
    in_sequence = label_index < length
    in_response = _block_tokens(batch.loss_mask, batch.anchors, block, 1) & in_sequence
    valid = mx.cumprod(in_response.astype(mx.float32), axis=-1) * batch.anchor_valid[..., None]
    return valid * mx.exp(-mx.arange(block) / LOSS_DECAY)


class Vocabulary(NamedTuple):
    """The tokens the draft's softmax runs over during training, and each
    target token's place among them (``present`` False: outside, no mass)."""

    ids: mx.array  # [V'] sorted token ids
    index: mx.array  # [V] place of each token in ``ids`` (0 where absent)
    present: mx.array  # [V] bool


def vocabulary_of(ids: np.ndarray, vocab_size: int) -> Vocabulary:
    index = np.zeros(vocab_size, np.int32)
    index[ids] = np.arange(len(ids))
    present = np.zeros(vocab_size, bool)
    present[ids] = True
    return Vocabulary(mx.array(np.asarray(ids, np.int32)), mx.array(index), mx.array(present))


def corpus_vocabulary(corpus: Corpus, vocab_size: int) -> Vocabulary:
    """Response tokens and the target's top-K candidates after them: the
    only tokens with target mass to match. Scoring a full-vocabulary draft's
    softmax over them makes each step several times cheaper; the rest carried
    no target mass anyway."""
    mask = np.array(corpus.loss_mask)
    used = np.union1d(np.array(corpus.tokens)[mask], np.array(corpus.top_ids)[mask])
    return vocabulary_of(used, vocab_size)


def dspark_loss(arch, spec, params: dict, batch: Batch, vocabulary: Vocabulary | None = None,
                weights: tuple = LOSS_WEIGHTS):
    """``0.1 CE + 0.9 L1 + 1.0 BCE`` (spec §2.4; ``weights`` gives another
    mix of the three, in that order). ``p_t`` is the target's
    top-K; the L1 distance counts the draft's mass outside it as error. The
    draft's softmax runs over ``vocabulary`` (its own reduced vocabulary, or
    a corpus vocabulary for a full-vocabulary draft): labels outside it get
    no CE term and their target mass counts as L1 error."""
    block = spec.block_size
    labels = _block_tokens(batch.tokens, batch.anchors, block, 1)
    top_ids = _block_tokens(batch.top_ids, batch.anchors, block, 0)
    label_in = mx.ones(labels.shape, mx.bool_)
    top_in = mx.ones(top_ids.shape, mx.bool_)
    if vocabulary is not None:
        if DRAFT_VOCAB_KEY not in params:
            params = restrict_vocabulary(params, vocabulary.ids)
        label_in, top_in = vocabulary.present[labels], vocabulary.present[top_ids]
        labels, top_ids = vocabulary.index[labels], vocabulary.index[top_ids]
    logits, confidence = training_forward(arch, spec, params, batch.features, batch.tokens, batch.anchors)
    positions = slot_weights(batch, block)
    top_probs = _block_tokens(batch.top_probs, batch.anchors, block, 0).astype(mx.float32)
    log_p = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -mx.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0] * label_in
    p_draft_top = mx.exp(mx.take_along_axis(log_p, top_ids, axis=-1)) * top_in
    outside = mx.maximum(1.0 - p_draft_top.sum(-1), 0.0) - mx.maximum(1.0 - top_probs.sum(-1), 0.0)
    l1 = mx.abs(p_draft_top - top_probs).sum(-1) + mx.abs(outside)
    soft_label = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    bce = mx.logaddexp(0.0, confidence) - confidence * soft_label
    total = mx.maximum(positions.sum(), 1e-6)
    parts = {name: (x * positions).sum() / total for name, x in (("ce", ce), ("l1", l1), ("confidence", bce))}
    loss = sum(weight * part for weight, part in zip(weights, parts.values()))
    return loss, parts


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions ``a`` with ``loss_mask[a] = loss_mask[a + 1] = 1``."""
    ok = np.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return ok


def sample_batch(corpus: Corpus, candidates: np.ndarray, rows: np.ndarray, count: int, rng) -> Batch:
    """Up to ``count`` anchors per row, uniformly without replacement, sorted."""
    anchors = np.zeros((len(rows), count), np.int32)
    valid = np.zeros((len(rows), count), bool)
    for i, row in enumerate(rows):
        positions = np.flatnonzero(candidates[row])
        chosen = np.sort(rng.choice(positions, size=min(count, len(positions)), replace=False))
        anchors[i, : len(chosen)], valid[i, : len(chosen)] = chosen, True
    index = mx.array(rows)
    return Batch(
        corpus.tokens[index],
        corpus.loss_mask[index],
        corpus.features[index],
        corpus.top_ids[index],
        corpus.top_probs[index],
        mx.array(anchors),
        mx.array(valid),
    )


