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
    """What a verify reads of a draft pass (and the driver plans the width from)."""

    tokens: mx.array  # [B, G] drafted tokens
    confidence_logits: mx.array  # [B, G] the confidence head's logits
    log_probs: mx.array  # [B, G, V] distribution each draft was drawn from (unread by greedy rows)


class DraftBlock(NamedTuple):
    """Everything one draft pass computes (``draft_block``), for inspection and
    parity checks; the compiled round keeps only its ``Proposal``."""

    tokens: mx.array  # [B, G]
    logits: mx.array  # [B, G, V'] Markov-corrected logits over the draft vocabulary (V' = V when full)
    confidence_logits: mx.array  # [B, G]
    base_logits: mx.array  # [B, G, V'] before the Markov correction
    hidden: mx.array  # [B, G, d] input of the confidence head
    log_probs: mx.array  # [B, G, V] distribution each draft was drawn from (= logits when greedy)

    def proposal(self) -> Proposal:
        return Proposal(tokens=self.tokens, confidence_logits=self.confidence_logits, log_probs=self.log_probs)


class Copies(NamedTuple):
    """Copied continuations that rows verify in place of the draft's proposal."""

    tokens: mx.array  # [B, W - 1] each copying row's copied tokens (any values in the other rows)
    rows: mx.array  # [B] bool: the rows whose block is their copy


class TokenLogProbs(NamedTuple):
    """Log-probabilities of chosen tokens under the target, with its K most likely tokens."""

    log_probs: mx.array  # [B, ...]
    top_ids: mx.array  # [B, ..., K]
    top_log_probs: mx.array  # [B, ..., K]


class Round(NamedTuple):
    emitted: mx.array  # [B, W] accepted drafts then the target's token, -1 padded
    count: mx.array  # [B] number of emitted tokens (accepted + 1; 0 for an idle row)
    next_tokens: mx.array  # [B] the next anchor
    accepted: mx.array  # [B]
    drafted: mx.array  # [B, W - 1] the proposals that were verified
    scores: TokenLogProbs | None = None  # [B, W] at each emitted position, when asked (``top_log_probs``)


class Event(NamedTuple):
    """What one row got from one step of a ``Decoder`` (``kind`` "prefill" or "round")."""

    kind: str
    emitted: list  # its new tokens, cut at its stop token (kept) and its budget
    accepted: int
    drafted: list  # the proposals it verified
    row: int = 0
    width: int = 0  # verify width of the round (shared by the batch; 0 for a prefill)
    source: str = ""  # what the row verified: "draft", "copy", or "" (nothing: a plain target step)
    finish: str | None = None  # "stop" (its stop token) or "length" (its budget) when the row ended here
    log_probs: list | None = None  # a TokenScore per emitted token, when the row asked


class Step(NamedTuple):
    """What one step of a ``Decoder`` (a round, or the prefill of new rows)
    produced, host-side, for the rows that took part (one entry each)."""

    kind: str  # "round" or "prefill"
    rows: list
    emitted: list  # per row: its new tokens, cut at its stop token (kept) and its budget
    accepted: list
    drafted: list  # per row: the proposals it verified
    width: int
    sources: list  # per row: "draft", "copy" or "" (see ``Event.source``)
    finished: list  # per row: "stop", "length" or None (it goes on)
    log_probs: list | None = None  # per row: a TokenScore per emitted token, or None (not asked)

    def events(self) -> list[Event]:
        """The step row by row."""
        scores = self.log_probs or [None] * len(self.rows)
        return [
            Event(kind=self.kind, emitted=emitted, accepted=accepted, drafted=drafted, row=row, width=self.width,
                  source=source, finish=finish, log_probs=score)
            for row, emitted, accepted, drafted, source, finish, score in zip(
                self.rows, self.emitted, self.accepted, self.drafted, self.sources, self.finished, scores)
        ]


class TokenScore(NamedTuple):
    """One emitted token's log-probability under the target, and the target's most likely tokens there."""

    log_prob: float
    top: list  # [(token id, log-probability)], most likely first

