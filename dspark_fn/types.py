"""The records every layer above the model math passes around: the pair's static
description and parameters, a round's proposal and result, the driver's steps,
events and ended sequences.

Shape letters (used in docstrings across the package): B batch rows, L tokens
in a forward, C cache capacity (slots), W verify width (anchor + drafts), G
draft block size, V vocabulary, V' draft vocabulary, d hidden size, F tapped
features (taps x d), H / H_kv query / key-value heads, D head dim, K top-K.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, NamedTuple

import mlx.core as mx

from .interfaces import DraftArch, TargetAdapter

if TYPE_CHECKING:  # for annotations only: importing the records loads nothing more
    from .cache import Cache
    from .stats import Tally


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
    """What one sequence got from one step of a ``Decoder`` (``kind`` "prefill" or "round")."""

    kind: str
    emitted: list  # its new tokens, cut at its stop token (kept) and its budget
    accepted: int
    drafted: list  # the proposals it verified
    tag: Hashable = None  # the sequence's tag (given to ``Decoder.insert``; ``generate``: the prompt's index)
    width: int = 0  # verify width of the round (shared by the batch; 0 for a prefill)
    source: str = ""  # what it verified: "draft", "copy", "forced" or "" (nothing: a plain target step)
    finish: str | None = None  # "stop" (its stop token), "length" (its budget) or "dead_end" (its grammar
    #                            admits no token) when the sequence ended here
    log_probs: list | None = None  # a TokenScore per emitted token, when the sequence asked


class Ended(NamedTuple):
    """A sequence that ended, as the ``Decoder`` gives it back before freeing its row."""

    tag: Hashable
    prompt: list
    tokens: list  # every token it emitted (cut at its stop token and budget)
    finish: str  # "stop", "length", "dead_end" (its grammar admits no token) or "cancelled" (``Decoder.release``)
    tally: "Tally"  # its rounds' acceptance
    cache: "Cache | None"  # one row holding the first ``cache.length`` tokens of ``context`` (asked with
    #                      ``keep_cache``; a recurrent state holds exactly those), else None

    @property
    def context(self) -> list:
        """The prompt and the emitted tokens."""
        return self.prompt + self.tokens


class Step(NamedTuple):
    """What one step of a ``Decoder`` (a round, or the prefill of new
    sequences) produced, host-side, for the sequences that took part (one
    entry each), and the records of those that ended in it."""

    kind: str  # "round" or "prefill"
    tags: list
    emitted: list  # per sequence: its new tokens, cut at its stop token (kept) and its budget
    accepted: list
    drafted: list  # per sequence: the proposals it verified
    width: int
    sources: list  # per sequence: "draft", "copy", "forced" or "" (see ``Event.source``)
    finished: list  # per sequence: "stop", "length", "dead_end" or None (it goes on)
    log_probs: list | None = None  # per sequence: a TokenScore per emitted token, or None (not asked)
    ended: list = []  # an ``Ended`` per sequence that ended in this step (its row is free again)

    def events(self) -> list[Event]:
        """The step sequence by sequence."""
        scores = self.log_probs or [None] * len(self.tags)
        return [
            Event(kind=self.kind, emitted=emitted, accepted=accepted, drafted=drafted, tag=tag, width=self.width,
                  source=source, finish=finish, log_probs=score)
            for tag, emitted, accepted, drafted, source, finish, score in zip(
                self.tags, self.emitted, self.accepted, self.drafted, self.sources, self.finished, scores)
        ]


class TokenScore(NamedTuple):
    """One emitted token's log-probability under the target, and the target's most likely tokens there."""

    log_prob: float
    top: list  # [(token id, log-probability)], most likely first

