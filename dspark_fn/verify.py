"""Accept rules: which drafted tokens the target keeps, and what it emits after them."""

from typing import NamedTuple

import mlx.core as mx


class Accepted(NamedTuple):
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


def accept_greedy(block: mx.array, target_logits: mx.array) -> Accepted:
    """Keep drafts while they equal the target's argmax; then emit the argmax.

    ``block = [anchor, x_1 .. x_{W-1}]``; row ``j`` of ``target_logits``
    predicts the token after ``block[:, j]``. Output equals greedy decoding of
    the target alone.
    """
    choice = mx.argmax(target_logits, axis=-1).astype(block.dtype)
    accepted = leading_run(block[:, 1:] == choice[:, :-1])
    next_tokens = mx.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]
    return Accepted(accepted, next_tokens, emitted_tokens(block, accepted, next_tokens))
