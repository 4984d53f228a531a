"""The copy proposal source: continue the text the way it went on the last time
its current ending appeared (prompt lookup), per row, on the host.

A ``CopyIndex`` holds one row's committed tokens (prompt, then everything the
row emitted) and, for every n-gram of up to ``longest`` tokens, the position
that followed its latest occurrence. ``extend`` indexes tokens as they are
committed (a dictionary write per n, so the cost of a round does not grow with
the context); ``lookup`` answers with the continuation after the most recent
earlier occurrence of the row's last n tokens, longest n first.

An n-gram enters the index only once the token after it is committed, so
the row's own ending never matches itself, and only committed tokens are ever
indexed: a rejected proposal never reaches the index, so there is nothing to
roll back. A copy is a function of the committed tokens alone, which is what
keeps it a point-mass proposal for rejection sampling.
"""

from typing import Iterable, NamedTuple

LONGEST_MATCH = 4  # the longest ending looked up
SHORTEST_MATCH = 1  # the shortest (whether short matches pay is measured per round, per match length)


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
