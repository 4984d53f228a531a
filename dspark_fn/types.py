"""The records every layer above the model math passes around: the pair's static
description and parameters, a round's proposal and result, the driver's steps,
events and ended sequences.

Shape letters (used in docstrings across the package): B batch rows, L tokens
in a forward, C cache capacity (slots), W verify width (anchor + drafts), G
draft block size, V vocabulary, V' draft vocabulary, d hidden size, F tapped
features (taps x d), H / H_kv query / key-value heads, D head dim, K top-K.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Hashable, NamedTuple

import mlx.core as mx
import numpy as np

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
    """Parameter pytrees of the pair plus their static spec; ``vision`` is a
    release's image side (``vision.Vision``: mlx-vlm's towers and processor,
    read when the first image is), None for a target that takes no images."""

    spec: PairSpec
    target: dict
    draft: dict
    vision: Any = None


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a prompt: its content hash, how many tokens stand for it,
    and its features (``encode() -> [count, d]``: the vision tower runs when
    called, so an image inside a cached prefix is never encoded)."""

    digest: str
    count: int
    encode: Callable


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """A prompt with images as the release's processor lays it out
    (``vision.image_prompt``); the prefill, ``generate`` and the decoder take
    it wherever they take a token list.

    tokens:      the whole prompt's ids, each image as its run(s) of ``image_token``
    images:      its images in the order their tokens come (image i takes the next ``count`` image tokens)
    positions:   ``[3, L]`` multimodal RoPE positions of the whole prompt (None: positions are the slots)
    spans:       ``[L]`` image span of each token, -1 for text, for families whose image tokens
                 attend to one another both ways in the prefill (None otherwise)
    first:       where the part still to prefill starts (a cached prefix holds the tokens before)
    """

    tokens: tuple
    image_token: int
    images: tuple
    positions: np.ndarray | None = None
    spans: np.ndarray | None = None
    first: int = 0

    def __len__(self) -> int:
        """The whole prompt's tokens."""
        return len(self.tokens)

    @property
    def rest(self) -> list:
        """The token ids still to prefill."""
        return list(self.tokens[self.first :])

    def image_slots(self) -> np.ndarray:
        """``[N]`` the prompt positions of the image tokens, in order."""
        return np.flatnonzero(np.array(self.tokens) == self.image_token)

    def image_ranges(self) -> list[tuple[int, int]]:
        """``(first, last)`` prompt positions of each image's tokens."""
        slots, ranges, begin = self.image_slots(), [], 0
        for image in self.images:
            ranges.append((int(slots[begin]), int(slots[begin + image.count - 1])))
            begin += image.count
        return ranges

    def resumable(self, length: int) -> int:
        """The longest prefix of at most ``length`` tokens that ends between
        images: a cached prefix can resume the prompt there."""
        return min([first for first, last in self.image_ranges() if first < length <= last], default=length)

    def after(self, start: int) -> "ImagePrompt":
        """The prompt with its first ``start`` tokens held by a cached prefix;
        an image cut by ``start`` cannot be resumed, so it is refused."""
        if self.resumable(start) != start:
            raise ValueError(f"a cached prefix of {start} tokens ends inside an image: resume at "
                             f"{self.resumable(start)}, before it")
        return replace(self, first=start)

    def shift(self, end: int | None = None) -> int:
        """How far multimodal positions run ahead of the slots after the first
        ``end`` tokens (default all): the last position + 1 - ``end``."""
        end = len(self.tokens) if end is None else end
        if self.positions is None or end == 0:
            return 0
        return int(self.positions[:, :end].max()) + 1 - end

    def key(self) -> list:
        """The prompt as a prompt cache compares it: its ids, each image token
        paired with its image's content hash."""
        digests = iter([image.digest for image in self.images for _ in range(image.count)])
        return [(t, next(digests)) if t == self.image_token else t for t in self.tokens]


def prompt_ids(prompt) -> list:
    """The token ids of a whole prompt (a token list or an ``ImagePrompt``)."""
    return list(prompt.tokens) if isinstance(prompt, ImagePrompt) else list(prompt)


def prompt_key(prompt) -> list:
    """A prompt as prompt caches compare it: its ids, an image prompt's image
    tokens paired with their image's content hash (the same picture matches)."""
    return prompt.key() if isinstance(prompt, ImagePrompt) else list(prompt)


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
    """Point-mass proposals (a point source's offers: copies, forced tokens, a
    store's continuations) that rows verify in place of the draft's proposal."""

    tokens: mx.array  # [B, W - 1] each such row's proposed tokens (any values in the other rows)
    rows: mx.array  # [B] bool: the rows whose block is their point-mass proposal


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
    limits: np.ndarray | None = None  # [B] the proposals each row could keep (``speculate``'s plan)
    sources: tuple = ()  # per row: what it verified, "draft", a point source's name or "" (``speculate``)


class Event(NamedTuple):
    """What one sequence got from one step of a ``Decoder`` (``kind`` "prefill" or "round")."""

    kind: str
    emitted: list  # its new tokens, cut at its stop token (kept) and its budget
    accepted: int
    drafted: list  # the proposals it verified
    tag: Hashable = None  # the sequence's tag (given to ``Decoder.insert``; ``generate``: the prompt's index)
    width: int = 0  # verify width of the round (shared by the batch; 0 for a prefill)
    source: str = ""  # what it verified: "draft", a point source's name ("copy", "forced", "store", ...) or ""
    finish: str | None = None  # "stop" (its stop token), "length" (its budget) or "dead_end" (its grammar
    #                            admits no token) when the sequence ended here
    log_probs: list | None = None  # a TokenScore per emitted token, when the sequence asked


class Ended(NamedTuple):
    """A sequence that ended, as the ``Decoder`` gives it back before freeing its row."""

    tag: Hashable
    prompt: list  # its ids (an image prompt's image tokens paired with their image's hash: ``prompt_key``)
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
    sources: list  # per sequence: "draft", a point source's name or "" (see ``Event.source``)
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

