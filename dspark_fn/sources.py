"""Where a round's proposals come from, behind one interface.

Two shapes of source:

- The draft: one pass of the draft model over the whole batch proposes a
  block of tokens with a distribution at each slot and a confidence for
  each. It costs a draft pass, and learns nothing on the host (the verify
  writes its context features).
- Point sources: for each sequence, a few tokens with certainty (point
  masses) at no pass's cost. Each is a ``PointSource``: ``follow`` a new
  sequence (its state), ``offer`` up to ``slots`` tokens with a ``kind``
  (the class its acceptance is measured under: a copy's matched ending
  length, a stored continuation's), ``commit`` the tokens the sequence
  committed, and ``finish`` it (its answer). The planner rates each offer
  by its source's measured acceptance per kind and slot and picks, per
  row and round, the best offer or the draft (``schedule.Planner``).

Rejection sampling stays exact for any point source whose offer is a
function of the committed tokens alone (never of the round's draws): a
point mass is verified as a draft whose distribution is certain of its
token. The bundled sources are ``ForcedTokens`` (what a row's grammar
forces next), ``ContextCopies`` (a copy of an earlier stretch of the row's
own context) and ``StoredAnswers`` (the continuation the target's past
answers most often took, ``store.Store``). ``default_sources`` lists them in
order of preference where two offers are rated equal.

``Proposers`` runs the sources for the decoder: it makes the draft when the
round's choice asks for it (or ahead, with the verify before, when the draft
is the only source), gathers the point sources' offers and lets each source
follow, commit and finish its sequences. The decoder asks it for a round's
proposals and names no source.
"""

from typing import Sequence

import numpy as np

from .constraints import Matcher, draft_masks
from .copying import LONGEST_MATCH, CopyIndex
from .rounds import propose
from .schedule import NOTHING, Choice, Offer, Offers, Planner
from .store import Store
from .types import Params, Proposal

NO_OFFER = Offer([], 0)


class PointSource:
    """A source of point-mass proposals. A subclass names itself (``name``,
    as statistics report it), says how many kinds its offers are rated by
    (``kinds``) and defines ``follow`` and ``offer``; ``commit`` and
    ``finish`` do nothing unless it learns."""

    name = ""
    kinds = 1

    def follow(self, context: list, matcher: Matcher | None) -> object:
        """Its state for a new sequence: ``context`` is the prompt's ids and
        the first token; ``matcher``, the sequence's constraint (or None)."""
        raise NotImplementedError

    def offer(self, state, slots: int) -> Offer:
        """Up to ``slots`` tokens to propose next, with their kind (1..``kinds``)."""
        raise NotImplementedError

    def commit(self, state, tokens: list) -> None:
        """The tokens the sequence committed in a round."""

    def finish(self, state, answer: list) -> None:
        """The sequence ended having emitted ``answer``."""


class ForcedTokens(PointSource):
    """What a row's grammar forces next (keys, punctuation, an enum's tail):
    the verify's masks make the constrained target certain of them."""

    name = "forced"

    def follow(self, context: list, matcher: Matcher | None) -> Matcher | None:
        return matcher  # advanced by the decoder as its row commits tokens

    def offer(self, matcher: Matcher | None, slots: int) -> Offer:
        if matcher is None or matcher.dead_end:
            return NO_OFFER
        return Offer(matcher.forced(slots), 1)


class ContextCopies(PointSource):
    """A copy of the stretch that followed the latest earlier occurrence of
    the row's ending (``copying.CopyIndex``), rated by the ending's length."""

    name = "copy"
    kinds = LONGEST_MATCH

    def follow(self, context: list, matcher: Matcher | None) -> CopyIndex:
        return CopyIndex(context)

    def offer(self, index: CopyIndex, slots: int) -> Offer:
        copy = index.lookup(slots)
        return Offer(copy.tokens, copy.match)

    def commit(self, index: CopyIndex, tokens: list) -> None:
        index.extend(tokens)


CONFIDENCE_LEVELS = (0.4, 0.75)  # a stored continuation's share among its ending's, split into three kinds


class StoredAnswers(PointSource):
    """The continuation the target's past answers most often took after the
    row's ending (``store.Store``), rated by the ending's length and by how
    clearly it led there (the first token's share of that ending's
    continuations, in three levels: an ending that went on many ways is
    rated apart from one that always went on alike); with ``learning`` each
    finished answer is added to the store."""

    name = "store"

    def __init__(self, store: Store, learning: bool = True):
        self.store, self.learning = store, learning
        self.kinds = store.longest * (len(CONFIDENCE_LEVELS) + 1)

    def follow(self, context: list, matcher: Matcher | None) -> list:
        return list(context[-self.store.longest :])

    def offer(self, ending: list, slots: int) -> Offer:
        recall = self.store.propose(ending, slots)
        if not recall.match:
            return NO_OFFER
        level = int(np.searchsorted(CONFIDENCE_LEVELS, recall.confidence, side="right"))
        return Offer(recall.tokens, (recall.match - 1) * (len(CONFIDENCE_LEVELS) + 1) + level + 1)

    def commit(self, ending: list, tokens: list) -> None:
        ending[:] = (ending + list(tokens))[-self.store.longest :]  # only the ending is ever looked up

    def finish(self, ending: list, answer: list) -> None:
        if self.learning:
            self.store.learn(answer)


def default_sources(store: Store | None = None) -> tuple:
    """The bundled point sources, in order of preference: forced tokens,
    copies, then the store's answers when a store is given."""
    return (ForcedTokens(), ContextCopies()) + ((StoredAnswers(store),) if store is not None else ())


class Proposers:
    """The draft and the point sources of one decoder. Each row of the
    decoder (``driver.Row``) holds one state per point source
    (``Row.followers``), its matcher and whether it joined after the
    pending draft was made (``Row.fresh``)."""

    def __init__(self, params: Params, planner: Planner, points: Sequence[PointSource]):
        self.params, self.planner, self.points = params, planner, tuple(points)
        self.pending: Proposal | None = None  # the coming round's draft, made with the last verify

    def follow(self, context: list, matcher: Matcher | None) -> list:
        """Each point source's state for a new sequence (none when the planner proposes no point masses)."""
        return [source.follow(context, matcher) for source in self.points] if self.planner.pointed else []

    def choose(self, rows: list, cache, anchors, sampling, live: np.ndarray) -> tuple[Offers, Choice, Proposal | None]:
        """The round's offers, choice and draft: chosen in the round before
        when the draft is the only source (the pending draft), else now (a
        draft made now gives each constrained row's first slot its grammar's
        mask)."""
        if self.ahead(rows):
            return Offers.none(len(rows)), Choice(self.pending is not None, np.full(len(rows), NOTHING)), self.pending
        slots = self.planner.max_width - 1
        offers = self.planner.offers([
            [source.offer(row.followers[s], slots) if row is not None and row.followers else NO_OFFER for row in rows]
            for s, source in enumerate(self.points)
        ]) if self.planner.pointed else Offers.none(len(rows))
        choice = self.planner.sources(offers, live)
        return offers, choice, self.draft(rows, cache, anchors, sampling) if choice.draft else None

    def draft(self, rows: list, cache, anchors, sampling) -> Proposal:
        """The draft pass, its first slot under each row's grammar (rows under a constraint)."""
        matchers = [row.matcher if row is not None else None for row in rows]
        masks = draft_masks(matchers, self.params.spec.block_size, self.params.spec.target.vocab_size) \
            if any(matchers) else None
        return propose(self.params, cache, anchors, sampling, masks)

    def ahead(self, rows: list) -> bool:
        """Whether a round's draft is made with the verify before it: when
        the draft is the only source (``Planner.ahead``) and no sequence is
        under a constraint. A constrained row's draft waits for the round's
        commits, so that its first slot takes the grammar's mask (a draft
        made ahead would propose, unmasked, tokens its grammar refuses)."""
        return self.planner.ahead and not any(row is not None and row.matcher is not None for row in rows)

    def launch_ahead(self, rows: list, cache, anchors, sampling, live: np.ndarray) -> Proposal | None:
        """The coming round's draft, launched now to be evaluated with this
        step, when drafts are made ahead and the planner drafts (else none)."""
        drafts = self.ahead(rows) and self.planner.sources(Offers.none(len(rows)), live).draft
        self.pending = self.draft(rows, cache, anchors, sampling) if drafts else None
        return self.pending

    def uncovered(self, rows: list, live: np.ndarray) -> np.ndarray:
        """``[B]`` live rows the pending draft does not cover (they joined after it was made)."""
        return live & np.array([row is not None and row.fresh for row in rows]) & self.ahead(rows)

    def commit(self, followers: list, tokens: list) -> None:
        for source, state in zip(self.points, followers):
            source.commit(state, tokens)

    def finish(self, followers: list, answer: list) -> None:
        for source, state in zip(self.points, followers):
            source.finish(state, answer)
