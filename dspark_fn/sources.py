"""Where a round's proposals come from besides the draft: point sources.

The draft proposes a block with a distribution and a confidence at each
slot, for a draft pass's cost. A point source proposes, for each row, a
few tokens with certainty (point masses) at no pass's cost. The copy
source is built in (``copying.py``: matched on the device over the
cache's history); the others are ``PointSource``s handed to ``speculate``
(``sources=``): each names itself (``name``, as statistics report it),
says how many kinds its offers are rated by (``kinds``) and how many of a
row's last context tokens it reads (``reach``), and ``offers`` up to
``slots`` tokens for each row from those endings. A source holds no
planner and no row state: the policy (``policy.py``) rates every offer by
its source's measured acceptance per row, kind and slot, and picks, per
row and round, the best offer or the draft.

Rejection sampling stays exact for any point source whose offer is a
function of the committed tokens alone (never of the round's draws): a
point mass is verified as a draft whose distribution is certain of its
token. The bundled ones are ``ForcedTokens`` (what each row's grammar
forces next; the decoder hands it its rows' matchers every round) and
``StoredAnswers`` (the continuation the target's past answers most often
took, ``store.Store``).
"""

from typing import Sequence

import numpy as np

from .constraints import Matcher
from .schedule import Offer
from .store import Store

NO_OFFER = Offer([], 0)


class PointSource:
    """A source of point-mass proposals (see the module's docstring); ``learn``
    does nothing unless the source learns from finished answers."""

    name = ""
    kinds = 1
    reach = 0  # the row's last context tokens its offers read

    def offers(self, endings: Sequence[list], slots: int) -> list[Offer]:
        """One offer per row from its ending (its last ``reach`` context
        tokens, the anchor last; fewer at the start of a row)."""
        raise NotImplementedError

    def learn(self, answer: list) -> None:
        """A sequence ended having emitted ``answer``."""


class ForcedTokens(PointSource):
    """What each row's grammar forces next (keys, punctuation, an enum's
    tail): the verify's masks make the constrained target certain of them.
    ``matchers[b]``: row b's matcher after every token it committed, or None."""

    name = "forced"

    def __init__(self, matchers: Sequence[Matcher | None]):
        self.matchers = list(matchers)

    def offers(self, endings: Sequence[list], slots: int) -> list[Offer]:
        return [NO_OFFER if matcher is None or matcher.dead_end else Offer(matcher.forced(slots), 1)
                for matcher in self.matchers]


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
        self.reach = store.longest

    def offers(self, endings: Sequence[list], slots: int) -> list[Offer]:
        return [self._offer(ending, slots) for ending in endings]

    def _offer(self, ending: list, slots: int) -> Offer:
        recall = self.store.propose(ending, slots)
        if not recall.match:
            return NO_OFFER
        level = int(np.searchsorted(CONFIDENCE_LEVELS, recall.confidence, side="right"))
        return Offer(recall.tokens, (recall.match - 1) * (len(CONFIDENCE_LEVELS) + 1) + level + 1)

    def learn(self, answer: list) -> None:
        if self.learning:
            self.store.learn(answer)


def default_sources(store: Store | None = None) -> tuple:
    """The point sources handed to ``speculate`` besides the built-in copies:
    the store's answers when a store is given, else none."""
    return (StoredAnswers(store),) if store is not None else ()
