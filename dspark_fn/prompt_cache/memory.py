"""The server's prompt cache: finished conversations' caches, each found
again by the longest prefix it shares with a new prompt.

Entries sit in a radix trie over their tokens (``prompt_key`` lists: token
ids, image tokens as hashable pairs). An edge holds the run of tokens
between two branch points, so the trie keeps at most two nodes an entry
(rather than a node, with its dict, a token). A lookup walks the prompt down the trie, in time
that grows with the prompt and not with the number of entries: each node
counts the entries under it that can be cut to any length (those without
recurrent states), so the deepest node with one to give is known on the way
down; an entry with recurrent states is reused only where the walk passes
the node it ends at.

The entries are also kept in least recently used order, their bytes summed
as they come and go: storing evicts the oldest past the budget, each
eviction unlinking one entry's path.

Entries are kept apart by scope (the server's: one per API key, and per
``cache_salt`` a request gives): each scope has a trie of its own, and a
lookup walks only its own, so nothing a scope stored is found, or tells
of itself (``cached_tokens``), from another. The budget and the order of
use are the whole cache's.

With a disk tier (``disk``) an entry evicted leaves for a file rather
than for nothing, and so does every entry when the engine stops; a lookup
walks the disk tier's index (a trie like this one, of the files' tokens)
too, and a file sharing more with the prompt than any entry in memory is
loaded, checked, and kept in memory again.
"""

from collections import OrderedDict
from types import MappingProxyType
from typing import NamedTuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..cache import Cache
from ..types import TokenLogProbs
from .scoring import ScoredPrefix, common_length, scored_prefix


class Entry(NamedTuple):
    cache: Cache
    size: int  # bytes of its buffers (and scores)
    recurrent: bool  # its states hold after all its tokens only: reusable whole or not at all
    scores: TokenLogProbs | None = None  # [1, tokens - 1] each token's after the first, where it was scored
    scope: str = ""  # whose it is (``PrefixTrie``)

    @property
    def scored(self) -> bool:
        return self.scores is not None


PLAIN, SCORED = 0, 1  # the kinds of entry a node counts under it (``counted``)


def counted(entry) -> tuple[int, int]:
    """What ``entry`` adds to the counts of the nodes above it: whether it
    can be cut to any length (no recurrent states), and whether it can be
    and also holds its tokens' scores (a scored prompt's)."""
    plain = not entry.recurrent
    return int(plain), int(plain and entry.scored)


class Node:
    """A trie node: the tokens it adds to its parent's prefix (``edge``),
    the prefix's length (``depth``), its children by their edge's first
    token, the entry whose tokens end here (or None), and how many entries
    under it (itself included) are of each kind ``counted`` tells apart
    (``counts[PLAIN]``, ``counts[SCORED]``)."""

    __slots__ = ("edge", "depth", "parent", "children", "entry", "counts")

    def __init__(self, edge: tuple = (), parent: "Node | None" = None):
        self.edge, self.parent = edge, parent
        self.depth = len(edge) + (parent.depth if parent is not None else 0)
        self.children: dict = {}
        self.entry: Entry | None = None
        self.counts = [0, 0]


def shared_length(edge: tuple, key: tuple, start: int) -> int:
    """How many leading tokens of ``edge`` ``key`` repeats from ``start`` on."""
    return common_length(edge, key[start : start + len(edge)])


def descend(root: Node, key: tuple) -> list[tuple[Node, int]]:
    """The nodes ``key`` leads through below ``root``, each with the length
    of the prefix ``key`` shares with every entry under it: the node's depth
    where ``key`` runs through its whole edge, less where it parts from the
    edge or ends inside it (the last node then)."""
    path, node = [], root
    while node.depth < len(key) and (child := node.children.get(key[node.depth])) is not None:
        reach = node.depth + shared_length(child.edge, key, node.depth)
        path.append((child, reach))
        if reach < child.depth:
            break
        node = child
    return path


def split(node: Node, at: int) -> Node:
    """Part ``node``'s edge after ``at`` tokens; the new node between it and
    its parent, holding the first part, is returned. ``node`` itself stays
    (with its entry, which refers to it) below."""
    upper = Node(node.edge[:at], node.parent)
    upper.counts = list(node.counts)
    node.parent.children[upper.edge[0]] = upper
    node.edge, node.parent = node.edge[at:], upper
    upper.children[node.edge[0]] = node
    return upper


def graft(root: Node, key: tuple) -> Node:
    """The node where ``key`` ends, made where the trie lacks it (splitting
    the edge ``key`` parts from or ends inside)."""
    node = root
    while node.depth < len(key):
        child = node.children.get(key[node.depth])
        if child is None:
            child = Node(key[node.depth :], node)
            node.children[child.edge[0]] = child
            return child
        matched = shared_length(child.edge, key, node.depth)
        node = child if matched == len(child.edge) else split(child, matched)
    return node


def prune(node: Node) -> None:
    """Unlink what held up ``node`` now that its entry is gone: nodes with
    neither entry nor children up the path, then a node left with neither
    entry nor a branch merged into its only child (so walks and memory stay
    proportional to entries, not to the tokens once stored)."""
    while node.parent is not None and node.entry is None and not node.children:
        del node.parent.children[node.edge[0]]
        node = node.parent
    if node.parent is not None and node.entry is None and len(node.children) == 1:
        (child,) = node.children.values()
        child.edge, child.parent = node.edge + child.edge, node.parent
        node.parent.children[node.edge[0]] = child


def recount(node: Node, change: tuple[int, int]) -> None:
    """Add ``change`` (``counted``, or its negation) to the counts of ``node`` and all above it."""
    while node is not None:
        node.counts = [count + step for count, step in zip(node.counts, change)]
        node = node.parent


def tokens_of(node: Node) -> tuple:
    """The tokens leading from the root to ``node``."""
    edges = []
    while node is not None:
        edges.append(node.edge)
        node = node.parent
    return tuple(token for edge in reversed(edges) for token in edge)


def first_counted(node: Node, kind: int) -> Node:
    """The node of an entry of ``kind`` (``PLAIN`` or ``SCORED``) under
    ``node`` (itself first, then the first child holding one, down): any
    serves, all sharing the prefix that led to ``node``; this one keeps the
    choice repeatable."""
    while node.entry is None or not counted(node.entry)[kind]:
        node = next(child for child in node.children.values() if child.counts[kind])
    return node


def unchanged(length: int) -> int:
    return length


class PrefixTrie:
    """Entries under token sequences, in a radix trie and in least recently
    used order, their bytes summed. An entry is any record with a ``size``
    and a ``recurrent`` flag: the prompt cache keeps caches in one
    (``PromptCache``) and its disk tier the files on disk in another
    (``disk.DiskTier``); the rules of reuse are the same for both.
    An entry with ``scored`` true holds its tokens' scores too: a scored
    prompt reuses only those (``longest_scored``)."""

    def __init__(self):
        self.roots: dict = {}  # scope -> the root of its trie
        self.lru: OrderedDict = OrderedDict()  # the nodes holding entries, least recently used first
        self.used = 0  # bytes of all entries

    def __len__(self) -> int:
        return len(self.lru)

    def clear(self) -> None:
        self.roots, self.used = {}, 0
        self.lru.clear()

    def root(self, scope: str) -> Node:
        """The root of ``scope``'s trie (an empty one for a scope that stored nothing)."""
        return self.roots.get(scope) or Node()

    def put(self, tokens: tuple, entry, scope: str = "") -> Node:
        """``entry`` under ``tokens`` in ``scope``, the most recently used, in
        place of any entry stored there under the same tokens; the node that
        holds it (it stays that entry's node until the entry is removed or
        replaced)."""
        node = graft(self.roots.setdefault(scope, Node()), tokens)
        if node.entry is not None:
            self._release(node)
            del self.lru[node]
        node.entry = entry
        recount(node, counted(entry))
        self.used += entry.size
        self.lru[node] = None
        return node

    def remove(self, node: Node) -> None:
        """Take ``node``'s entry out, and the nodes only it held up."""
        del self.lru[node]
        self._release(node)
        prune(node)

    def _release(self, node: Node) -> None:
        """Take ``node``'s entry out of the counts and the bytes."""
        recount(node, tuple(-count for count in counted(node.entry)))
        self.used -= node.entry.size
        node.entry = None

    def oldest(self) -> Node:
        return next(iter(self.lru))

    def longest(self, prompt: list, resumable=None, scope: str = "") -> tuple[int, Node | None]:
        """``(length, node)``: the longest prefix of ``prompt`` an entry of
        ``scope`` can serve, and the node of that entry (0 and None where
        none serves any). The prefix leaves at least one prompt token, and with
        ``resumable`` it is the longest that allows (not inside an image);
        ``resumable`` only shortens, and a longer prefix never resumes
        earlier than a shorter one, so the deepest shared prefix gives the
        longest cut. Nothing is marked used."""
        resume = resumable if resumable is not None else unchanged
        path = descend(self.root(scope), tuple(prompt[: len(prompt) - 1]))
        length, holder = 0, None
        cuttable = [(node, reach) for node, reach in path if node.counts[PLAIN]]
        if cuttable:  # the deepest such node: its entries share the most with the prompt
            node, reach = cuttable[-1]
            length, holder = resume(reach), first_counted(node, PLAIN)
        for node, reach in reversed(path):  # deepest first: the first whole recurrent entry is the longest
            if reach <= length:
                break
            entry = node.entry
            if reach == node.depth and entry is not None and entry.recurrent and resume(reach) == reach:
                length, holder = reach, node
                break
        return length, holder

    def longest_scored(self, prompt: list, scope: str = "") -> tuple[int, Node | None]:
        """``(length, node)``: the longest prefix of ``prompt``, short of its
        last token, that a scored entry of ``scope`` shares, and that entry's
        node (0 and None where none shares any). Nothing is marked used."""
        path = descend(self.root(scope), tuple(prompt[: len(prompt) - 1]))
        scored = [(node, reach) for node, reach in path if node.counts[SCORED]]
        if not scored:
            return 0, None
        node, reach = scored[-1]
        return reach, first_counted(node, SCORED)


class PromptCache(PrefixTrie):
    """Finished conversations' caches, least recently used evicted past
    ``budget_bytes``. A new prompt reuses the stored sequence sharing its
    longest prefix (at least ``min_tokens``). A cache holding recurrent states
    is reused only whole: its states are those after all its tokens, so it
    matches only a prompt that starts with every one of them.

    With a ``disk`` tier (``disk.DiskTier``) an entry evicted from
    memory is written there, and so is every entry at ``spill`` (the
    engine's stop); a lookup that finds a longer prefix on disk than in
    memory loads that file, checked, and keeps it in memory again."""

    def __init__(self, budget_bytes: int, min_tokens: int = 16, disk=None):
        super().__init__()
        self.budget, self.min_tokens, self.disk = budget_bytes, min_tokens, disk
        self.hits = self.misses = 0

    @property
    def entries(self) -> MappingProxyType:
        """What is stored in memory, for inspection: (scope, tokens) -> (cache,
        bytes), least recently used first; rebuilt from the trie at each call, read-only."""
        return MappingProxyType({(node.entry.scope, tokens_of(node)): (node.entry.cache, node.entry.size)
                                 for node in self.lru})

    def clear(self) -> None:
        """Drop every entry in memory (the counts of hits and misses go on;
        the disk tier's files stay: each is checked again when loaded)."""
        super().clear()

    def store(self, tokens: list, cache: Cache, scores: TokenLogProbs | None = None, scope: str = "") -> None:
        """Keep a one-row ``cache`` in buffers of its own (``buffers.row_cache``)
        in ``scope``, under the leading tokens of ``tokens`` it holds (its
        length), in place of any cache stored there under the same tokens; with a scored prompt's
        ``scores`` (``[1, length - 1]``), which a later scored prompt reuses
        (``scored_prefix``; not kept with recurrent states: those prefixes
        never resume short of their end)."""
        tokens = tuple(tokens[: int(cache.length[0])])
        if self.budget <= 0 or len(tokens) < self.min_tokens:
            return
        scores = None if cache.recurrent else scores
        kept = (cache.target, cache.draft, cache.history) + ((scores,) if scores is not None else ())
        mx.eval(kept)  # the running batch's buffers stay free to update in place
        size = sum(a.nbytes for _, a in tree_flatten(kept))
        self.put(tokens, Entry(cache, size, cache.recurrent, scores, scope), scope)
        while self.lru and self.used > self.budget:
            self._evict(self.oldest())

    def _evict(self, node: Node) -> None:
        """Take ``node``'s entry out of memory, onto disk where there is a disk tier."""
        if self.disk is not None:
            self.disk.keep(tokens_of(node), node.entry.cache, node.entry.size, node.entry.scope)
        self.remove(node)

    def spill(self) -> None:
        """Every entry in memory written to the disk tier (the least recently
        used first, so the files' order of use is the memory's); the memory
        keeps them."""
        if self.disk is not None:
            for node in list(self.lru):
                self.disk.keep(tokens_of(node), node.entry.cache, node.entry.size, node.entry.scope)

    def lookup(self, prompt: list, resumable=None, scope: str = "") -> Cache | None:
        """The cache stored in ``scope`` sharing the longest prefix with
        ``prompt`` (a ``prompt_key``: images by their content), its length
        cut to that prefix (and to leave at least one prompt token; with
        ``resumable``, to the longest prefix it allows: not inside an image);
        from disk where a file of the scope shares more than any entry in memory."""
        length, holder = self.longest(prompt, resumable, scope)
        if self.disk is not None and (found := self._load(prompt, resumable, length, scope)) is not None:
            self.hits += 1
            return found
        if length < max(self.min_tokens, 1):  # an empty prefix saves nothing
            self.misses += 1
            return None
        self.hits += 1
        self.lru.move_to_end(holder)
        return holder.entry.cache._replace(length=mx.array([length], mx.int32))

    def scored_prefix(self, prompt: list, scope: str = "") -> ScoredPrefix | None:
        """The longest beginning of ``prompt`` a scored prompt kept in
        ``scope`` shares, as a ``ScoredPrefix`` (its positions but the last
        shared one, and their scores), or None where it saves fewer than
        ``min_tokens``. Files on disk hold no scores: only entries in memory serve."""
        shared, holder = self.longest_scored(prompt, scope)
        if shared - 1 < max(self.min_tokens, 1):
            self.misses += 1
            return None
        self.hits += 1
        self.lru.move_to_end(holder)
        return scored_prefix(holder.entry.cache, holder.entry.scores, shared)

    def _load(self, prompt: list, resumable, beaten: int, scope: str) -> Cache | None:
        """The disk tier's cache of ``scope`` for the longest prefix of
        ``prompt`` it holds past ``beaten`` tokens (and ``min_tokens``), kept
        in memory again, its length cut to that prefix; None where it holds
        none. A file that fails its checks is dropped, and the next best tried."""
        while True:
            length, node = self.disk.longest(prompt, resumable, scope)
            if length <= beaten or length < max(self.min_tokens, 1):
                return None
            tokens = tokens_of(node)
            cache = self.disk.load(node)
            if cache is not None:
                self.store(tokens, cache, scope=scope)
                return cache._replace(length=mx.array([length], mx.int32))
