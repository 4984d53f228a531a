"""The copy proposal source: continue the text the way it went on the last
time its current ending appeared (prompt lookup), every row at once, in a
compiled kernel over the cache's token history.

A row's context is its committed tokens (``Cache.history[:length]``) and
its anchor, which stands at slot ``length``. The offer follows the latest
earlier occurrence of the row's last ``n`` context tokens, the longest
``n <= LONGEST_MATCH`` that occurred before: the tokens that came after
that occurrence, and, where they run into the present, the copy itself
again (a repeating pattern keeps repeating). An occurrence counts only if
a token followed it, so the row's own ending never matches itself.

The history is written where the K/V are (``write_tokens``: a verify
writes its block, a prefill its chunks), and only a row's first
``length`` slots are read, so a rejected proposal is rolled back with the
length, as the K/V are. A copy is a function of the committed tokens
alone, which is what keeps it a point-mass proposal for rejection
sampling.

``CopyIndex`` is the same matcher on the host, one row over a token list
that grows as tokens are committed (a dictionary write per n-gram): the
simulations over text in ``bench/`` use it, and the tests hold the kernel
to it. The rounds match on the device, where the history is written
(BENCHMARK.md, section 0t, times both).
"""

from functools import lru_cache
from typing import Iterable, NamedTuple

import mlx.core as mx

from .kernel import compiled

LONGEST_MATCH = 4  # the longest ending looked up
SHORTEST_MATCH = 1  # the shortest (whether short matches pay is measured per round, per match length)


class CopyOffers(NamedTuple):
    """Each row's copy offer: ``tokens [B, S]`` and ``match [B]``, the length
    of the matched ending (0: the ending never occurred; no offer)."""

    tokens: mx.array
    match: mx.array


def match_copies(history: mx.array, length: mx.array, anchors: mx.array, slots: int,
                 longest: int = LONGEST_MATCH) -> CopyOffers:
    """Every row's copy offer of ``slots`` tokens (see the module's docstring)
    from ``history [B, C]``, the committed ``length [B]`` and ``anchors [B]``."""
    capacity = history.shape[1]
    present = mx.minimum(length, capacity - 1)  # the anchor's slot (a full row offers nothing: no slot is valid)
    context = mx.put_along_axis(history, present[:, None], anchors[:, None].astype(history.dtype), axis=1)
    ends = mx.arange(capacity)[None, :]  # where an occurrence of the ending would end
    agree, run = mx.ones(context.shape, mx.bool_), mx.zeros(context.shape, mx.int32)
    for back in range(longest):  # run[b, j]: how many tokens ending at j equal those ending at the anchor
        before = mx.take_along_axis(context, mx.maximum(ends - back, 0), axis=1)
        ending = mx.take_along_axis(context, mx.maximum(present - back, 0)[:, None], axis=1)
        agree = agree & (before == ending) & (ends >= back) & (present[:, None] >= back)
        run = run + agree
    run = mx.where(ends < present[:, None], run, 0)  # a token followed the occurrence
    match = run.max(axis=1)
    latest = mx.where((run >= match[:, None]) & (match[:, None] > 0), ends, -1).max(axis=1)
    period = mx.maximum(present - latest, 1)  # past the present the copy repeats itself
    following = latest[:, None] + 1 + mx.arange(slots)[None, :] % period[:, None]
    tokens = mx.take_along_axis(context, mx.clip(following, 0, capacity - 1), axis=1)
    return CopyOffers(tokens=tokens, match=match)


@lru_cache(maxsize=None)
def _copies_kernel(slots: int):
    return compiled("copies", lambda history, length, anchors: match_copies(history, length, anchors, slots))


def copy_offers(history: mx.array, length: mx.array, anchors: mx.array, slots: int) -> CopyOffers:
    """``match_copies`` compiled (one kernel per offer size, batch and capacity)."""
    return _copies_kernel(slots)(history, length, anchors.astype(mx.int32))


def endings(history: mx.array, length: mx.array, anchors: mx.array, count: int) -> mx.array:
    """``[B, count]``: each row's last ``count`` context tokens, its anchor
    last (a row holding fewer starts with slot 0's token repeated: read
    only its last ``length + 1``)."""
    slots = mx.maximum(length[:, None] - count + 1 + mx.arange(count)[None, :], 0)
    tokens = mx.take_along_axis(history, mx.minimum(slots, history.shape[1] - 1), axis=1)
    return mx.concatenate([tokens[:, :-1], anchors[:, None].astype(tokens.dtype)], axis=1)


class Copy(NamedTuple):
    tokens: list  # the proposed continuation (empty: no earlier occurrence)
    match: int  # length of the matched ending (0: none)


class CopyIndex:
    """One row's context and where each of its n-grams last continued."""

    def __init__(self, tokens: Iterable[int] = (), longest: int = LONGEST_MATCH, shortest: int = SHORTEST_MATCH):
        if not 1 <= shortest <= longest:
            raise ValueError(f"match lengths must satisfy 1 <= shortest <= longest, got {shortest}, {longest}")
        self.longest, self.shortest = longest, shortest
        self.tokens: list = []
        self.following: dict = {}  # n-gram -> index of the token after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Commit ``tokens``: the n-grams ending just before each new token
        now have a continuation, which is the newest."""
        context, following = self.tokens, self.following
        for token in tokens:
            end = len(context)
            for n in range(1, min(self.longest, end) + 1):
                following[tuple(context[end - n : end])] = end
            context.append(int(token))

    def lookup(self, count: int) -> Copy:
        """Up to ``count`` tokens that followed the latest earlier occurrence
        of the longest ending found. Where that continuation runs into the
        present, it goes on with the copy itself (a repeating pattern keeps
        repeating)."""
        context = self.tokens
        end = len(context)
        if count < 1:
            return Copy([], 0)
        for n in range(min(self.longest, end), self.shortest - 1, -1):
            start = self.following.get(tuple(context[end - n :]))
            if start is not None:
                return Copy(continuation(context, start, count), n)
        return Copy([], 0)


def continuation(context: list, start: int, count: int) -> list:
    """``count`` tokens from ``context[start:]`` (``start < len(context)``),
    continued by the copied tokens themselves past the end."""
    copied = []
    for i in range(count):
        position = start + i
        copied.append(context[position] if position < len(context) else copied[position - len(context)])
    return copied
