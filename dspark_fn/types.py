"""The records every layer above the model math passes around: the pair's static
description and parameters, a round's proposal and result, the driver's events.

Shape letters (used in docstrings across the package): B batch rows, L tokens
in a forward, C cache capacity (slots), W verify width (anchor + drafts), G
draft block size, V vocabulary, V' draft vocabulary, d hidden size, F tapped
features (taps x d), H / H_kv query / key-value heads, D head dim, K top-K.
"""

from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx

from .interfaces import DraftArch, TargetAdapter


@dataclass(frozen=True)
class PairSpec:
    """Static description of a target/draft pair: everything that is not an array."""

    target_adapter: TargetAdapter
    target: Any
    draft_arch: DraftArch
    draft: Any

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    @property
    def taps(self) -> tuple:
        return self.draft.target_layer_ids


class Params(NamedTuple):
    """Parameter pytrees of the pair plus their static spec."""

    spec: PairSpec
    target: dict
    draft: dict


class Proposal(NamedTuple):
    tokens: mx.array  # [B, G] drafted tokens
    logits: mx.array  # [B, G, V'] Markov-corrected logits over the draft vocabulary (V' = V when full)
    confidence_logits: mx.array  # [B, G]
    base_logits: mx.array  # [B, G, V']
    hidden: mx.array  # [B, G, d] input of the confidence head
    log_probs: mx.array  # [B, G, V] distribution each draft was drawn from (= logits when greedy)


class Copies(NamedTuple):
    """Copied continuations that rows verify in place of the draft's proposal."""

    tokens: mx.array  # [B, W - 1] each copying row's copied tokens (any values in the other rows)
    rows: mx.array  # [B] bool: the rows whose block is their copy


class Round(NamedTuple):
    emitted: mx.array  # [B, W] accepted drafts then the target's token, -1 padded
    count: mx.array  # [B] number of emitted tokens (accepted + 1; 0 for an idle row)
    next_tokens: mx.array  # [B] the next anchor
    accepted: mx.array  # [B]
    drafted: mx.array  # [B, W - 1] the drafts that were verified
    confidences: mx.array  # [B, W - 1]
    log_probs: mx.array  # [B, W] each emitted token's log-probability under the target ([B, 0] when not asked)
    top_ids: mx.array  # [B, W, K] the target's K most likely tokens at each emitted position
    top_log_probs: mx.array  # [B, W, K]


class TokenLogProbs(NamedTuple):
    """Log-probabilities of chosen tokens under the target, with its K most likely tokens."""

    log_probs: mx.array  # [B, ...]
    top_ids: mx.array  # [B, ..., K]
    top_log_probs: mx.array  # [B, ..., K]


class Event(NamedTuple):
    """What one step of ``generate`` produced for one row (``kind`` is "prefill" or "round")."""

    kind: str
    emitted: list
    accepted: int
    drafted: list  # the proposal this row verified (its first ``limit`` drafts)
    confidences: list
    row: int = 0
    width: int = 0  # verify width of the round (shared by the batch)
    source: str = ""  # what the row verified: "draft", "copy", or "" (nothing: a plain target step)


class Step(NamedTuple):
    """What one round of a ``Decoder`` produced, host-side, for its active rows."""

    rows: list  # the rows that took part
    emitted: list  # per row: accepted drafts then the target's token
    accepted: list
    drafted: list  # per row: the drafts it verified
    confidences: list
    width: int
    sources: list  # per row: "draft", "copy" or "" (see ``Event.source``)
    log_probs: list | None = None  # per row: a TokenScore per emitted token, or None (not asked)


class TokenScore(NamedTuple):
    """One emitted token's log-probability under the target, and the target's most likely tokens there."""

    log_prob: float
    top: list  # [(token id, log-probability)], most likely first

