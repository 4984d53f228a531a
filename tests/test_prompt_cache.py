"""The server's prompt cache (``prompt_cache.memory``) on small stand-in
caches: random stores and lookups (of caches, and of scored prompts'
prefixes) against a linear scan over every entry (the rule the trie must
give the same answers to), the rules one by one, and a lookup that walks
the prompt without going through the entries."""

import random
from collections import OrderedDict
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from dspark_fn.prompt_cache import memory
from dspark_fn.prompt_cache.memory import PromptCache, descend
from dspark_fn.types import TokenLogProbs

IMAGE_A, IMAGE_B = (9, "digest-a"), (9, "digest-b")  # image tokens as ``prompt_key`` pairs them
VOCAB = [0, 1, 2, 3, IMAGE_A, IMAGE_B]


class FakeCache(NamedTuple):
    """What the prompt cache reads of a ``cache.Cache``, and the tokens it was stored under, to tell entries apart."""

    target: list
    draft: list
    length: mx.array
    recurrent: bool
    tokens: tuple
    history: mx.array = mx.zeros((0,), mx.int32)  # no bytes: each entry's size is its target's


def fake_cache(tokens, size: int = 10, recurrent: bool = False, length: int | None = None) -> FakeCache:
    length = len(tokens) if length is None else length
    return FakeCache([mx.zeros((size,), mx.uint8)], [], mx.array([length], mx.int32), recurrent,
                     tuple(tokens[:length]))


def fake_scores(tokens) -> TokenLogProbs:
    """Scores for ``tokens`` (one a token after the first), each telling which entry and position it came from."""
    count = max(len(tokens) - 1, 0)
    marks = mx.array([[hash((tuple(tokens), i)) % 256 for i in range(count)]], mx.uint8)  # a byte a token
    return TokenLogProbs(marks, mx.zeros((1, count, 0), mx.int32), mx.zeros((1, count, 0), mx.float32))


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class LinearPromptCache:
    """The reference: every lookup scans every entry for its common prefix with the prompt."""

    def __init__(self, budget: int, min_tokens: int):
        self.budget, self.min_tokens = budget, min_tokens
        self.entries: OrderedDict = OrderedDict()  # (scope, tokens) -> (recurrent, bytes, scores or None)

    @property
    def used(self) -> int:
        return sum(size for _, size, _ in self.entries.values())

    def store(self, cache: FakeCache, scores: TokenLogProbs | None = None, scope: str = "") -> None:
        if self.budget <= 0 or len(cache.tokens) < self.min_tokens:
            return
        scores = None if cache.recurrent else scores  # a recurrent prefix never resumes short of its end
        size = int(cache.target[0].nbytes) + (sum(a.nbytes for a in scores) if scores is not None else 0)
        self.entries[scope, cache.tokens] = (cache.recurrent, size, scores)
        self.entries.move_to_end((scope, cache.tokens))
        while self.entries and self.used > self.budget:
            self.entries.popitem(last=False)

    def best(self, prompt: list, resumable=None, scope: str = "") -> tuple[int, set]:
        """The longest usable prefix in ``scope`` and every entry giving it."""
        lengths = {}
        for (own, tokens), (recurrent, _, _) in self.entries.items():
            if own != scope:
                continue
            length = min(common_prefix(tokens, prompt), len(prompt) - 1)
            length = resumable(length) if resumable is not None else length
            if not (recurrent and length != len(tokens)):
                lengths[tokens] = length
        longest = max(lengths.values(), default=0)
        return longest, {tokens for tokens, length in lengths.items() if length == longest}

    def best_scored(self, prompt: list, scope: str = "") -> tuple[int, set]:
        """The longest prefix a scored entry of ``scope`` shares with ``prompt`` short of its last token, and every
        entry giving it."""
        lengths = {tokens: min(common_prefix(tokens, prompt), len(prompt) - 1)
                   for (own, tokens), (_, _, scores) in self.entries.items() if scores is not None and own == scope}
        longest = max(lengths.values(), default=0)
        return longest, {tokens for tokens, length in lengths.items() if length == longest}


def image_cuts(ranges):
    """An ``ImagePrompt.resumable`` over images at the prompt positions ``ranges`` (first, last)."""
    return lambda length: min([first for first, last in ranges if first < length <= last], default=length)


def random_image_ranges(rng: random.Random, length: int) -> list:
    ranges, position = [], 0
    while position < length:
        position += rng.randint(0, 6)
        last = position + rng.randint(0, 4)
        if last < length:
            ranges.append((position, last))
        position = last + 1
    return ranges


def random_sequence(rng: random.Random, seen: list) -> list:
    """A prefix of an earlier sequence (so sequences share prefixes), then a few tokens more."""
    base = rng.choice(seen) if seen and rng.random() < 0.85 else []
    return list(base[: rng.randint(0, len(base))]) + [rng.choice(VOCAB) for _ in range(rng.randint(0, 8))]


def stored_order(cache: PromptCache) -> list:
    return [tokens for _, tokens in cache.entries]


def check_trie(cache: PromptCache) -> None:
    """Every node's edge, depth and counts of cuttable (and scored) entries agree with what
    hangs below it; a node other than the root holds an entry or branches;
    the nodes holding entries are those in the LRU order, each at its tokens."""
    held = []

    def visit(node, prefix: tuple) -> np.ndarray:
        plain = np.zeros(2, int)  # entries below that can be cut, and those of them holding scores
        if node.entry is not None:
            assert node.entry.cache.tokens == prefix
            held.append(node)
            plain += [not node.entry.recurrent, node.entry.scores is not None]
        assert node.parent is None or node.entry is not None or len(node.children) >= 2
        for first, child in node.children.items():
            assert child.edge and child.edge[0] == first and child.parent is node
            assert child.depth == node.depth + len(child.edge)
            plain += visit(child, prefix + child.edge)
        assert list(node.counts) == plain.tolist()
        return plain

    for root in cache.roots.values():
        visit(root, ())
    assert set(held) == set(cache.lru) and len(held) == len(cache)


@pytest.mark.parametrize("seed", range(8))
def test_random_stores_and_lookups_answer_as_the_linear_scan(seed):
    rng = random.Random(seed)
    min_tokens = [0, 1, 4, 6][seed % 4]
    recurrent_share = [0.0, 1.0, 0.5][seed % 3]
    scopes = ["", "another key"] if seed % 4 in (1, 2) else [""]  # each scope finds only its own entries
    budget = 200
    cache, reference = PromptCache(budget, min_tokens=min_tokens), LinearPromptCache(budget, min_tokens)
    seen, hits, misses = [], 0, 0
    for _ in range(400):
        tokens, scope = random_sequence(rng, seen), rng.choice(scopes)
        seen.append(tokens)
        if rng.random() < 0.5:
            stored = fake_cache(tokens, size=rng.randint(1, 40), recurrent=rng.random() < recurrent_share,
                                length=max(0, len(tokens) - rng.choice([0, 0, 1, 3])))
            scores = fake_scores(stored.tokens) if rng.random() < 0.5 else None
            cache.store(tokens, stored, scores, scope)
            reference.store(stored, scores, scope)
        elif rng.random() < 0.3:
            shared, candidates = reference.best_scored(tokens, scope)
            found = cache.scored_prefix(tokens, scope)
            if shared - 1 < max(min_tokens, 1):
                assert found is None
                misses += 1
            else:
                assert int(found.cache.length[0]) == shared - 1 and found.cache.tokens in candidates
                expected = reference.entries[scope, found.cache.tokens][2]
                assert found.scores.log_probs.tolist() == expected.log_probs[:, : shared - 1].tolist()
                reference.entries.move_to_end((scope, found.cache.tokens))
                hits += 1
        else:
            resumable = image_cuts(random_image_ranges(rng, len(tokens))) if rng.random() < 0.5 else None
            length, candidates = reference.best(tokens, resumable, scope)
            found = cache.lookup(tokens, resumable, scope)
            if length < max(min_tokens, 1):
                assert found is None
                misses += 1
            else:
                assert int(found.length[0]) == length and found.tokens in candidates
                reference.entries.move_to_end((scope, found.tokens))  # the choice among equals is the trie's
                hits += 1
        assert list(cache.entries) == list(reference.entries)  # (scope, tokens), least recently used first
        assert cache.used == reference.used <= budget
        assert (cache.hits, cache.misses) == (hits, misses)
        check_trie(cache)
    assert hits and misses and len(cache) > 3


def test_the_longest_shared_prefix_wins_cut_to_leave_a_prompt_token():
    cache = PromptCache(1 << 20, min_tokens=2)
    cache.store([1, 2, 3, 4, 5], fake_cache([1, 2, 3, 4, 5]))
    cache.store([1, 2, 7, 7], fake_cache([1, 2, 7, 7]))
    found = cache.lookup([1, 2, 3, 9, 9])
    assert found.tokens == (1, 2, 3, 4, 5) and int(found.length[0]) == 3
    found = cache.lookup([1, 2, 3, 4, 5])  # the whole entry, less the token the prompt must still give
    assert found.tokens == (1, 2, 3, 4, 5) and int(found.length[0]) == 4
    found = cache.lookup([1, 2, 7, 7, 7, 7])
    assert found.tokens == (1, 2, 7, 7) and int(found.length[0]) == 4


def test_a_recurrent_entry_is_reused_only_whole():
    cache = PromptCache(1 << 20, min_tokens=2)
    cache.store([1, 2, 3, 4], fake_cache([1, 2, 3, 4], recurrent=True))
    assert cache.lookup([1, 2, 3, 9, 9]) is None  # shares 3 of its 4 tokens
    assert cache.lookup([1, 2, 3, 4]) is None  # all of them, but the last prompt token must stay to prefill
    found = cache.lookup([1, 2, 3, 4, 5])
    assert found.tokens == (1, 2, 3, 4) and int(found.length[0]) == 4
    cache.store([1, 2], fake_cache([1, 2], recurrent=True))  # a shorter whole one serves where the longer cannot
    assert int(cache.lookup([1, 2, 3, 9]).length[0]) == 2
    cache.store([1, 2, 3, 7], fake_cache([1, 2, 3, 7]))  # a cuttable one sharing more wins over it
    found = cache.lookup([1, 2, 3, 9])
    assert found.tokens == (1, 2, 3, 7) and int(found.length[0]) == 3


def test_resumable_cuts_the_prefix_before_an_image():
    cache = PromptCache(1 << 20, min_tokens=2)
    stored = [1, 2, IMAGE_A, IMAGE_A, IMAGE_A, 5]
    cache.store(stored, fake_cache(stored))
    prompt = [1, 2, IMAGE_A, IMAGE_A, IMAGE_A, 6, 7]
    assert int(cache.lookup(prompt, image_cuts([(2, 4)])).length[0]) == 5
    other_image = [1, 2, IMAGE_A, IMAGE_B, IMAGE_B, 6]  # the same token id, another picture: parts inside the image
    assert int(cache.lookup(other_image).length[0]) == 3
    assert int(cache.lookup(other_image, image_cuts([(2, 4)])).length[0]) == 2
    cache.store(stored, fake_cache(stored, recurrent=True))  # a recurrent one cannot be cut back to before the image
    assert cache.lookup(other_image, image_cuts([(2, 4)])) is None


def test_prefixes_shorter_than_min_tokens_are_neither_stored_nor_reused():
    cache = PromptCache(1 << 20, min_tokens=4)
    cache.store([1, 2, 3], fake_cache([1, 2, 3]))
    assert len(cache) == 0
    cache.store([1, 2, 3, 4, 5, 6], fake_cache([1, 2, 3, 4, 5, 6]))
    assert cache.lookup([1, 2, 3, 9, 9]) is None
    assert int(cache.lookup([1, 2, 3, 4, 9]).length[0]) == 4
    assert (cache.hits, cache.misses) == (1, 1)


def test_the_least_recently_used_go_first_past_the_budget():
    cache = PromptCache(30, min_tokens=1)
    for first in (1, 2, 3):
        cache.store([first, 0, 0], fake_cache([first, 0, 0], size=10))
    cache.lookup([1, 0, 0, 0])  # touches [1, 0, 0]: [2, 0, 0] is now the oldest
    cache.store([4, 0, 0], fake_cache([4, 0, 0], size=10))
    assert stored_order(cache) == [(3, 0, 0), (1, 0, 0), (4, 0, 0)] and cache.used == 30
    cache.store([5, 0, 0], fake_cache([5, 0, 0], size=25))
    assert stored_order(cache) == [(5, 0, 0)] and cache.used == 25
    assert cache.lookup([3, 0, 0, 0]) is None
    check_trie(cache)


def test_storing_the_same_tokens_again_replaces_the_entry_and_its_bytes():
    cache = PromptCache(100, min_tokens=1)
    cache.store([1, 2, 3], fake_cache([1, 2, 3], size=10))
    cache.store([1, 2], fake_cache([1, 2], size=5))
    replacement = fake_cache([1, 2, 3], size=40, recurrent=True)
    cache.store([1, 2, 3, 4], replacement._replace(length=mx.array([3], mx.int32)))  # held: its first 3 tokens
    assert len(cache) == 2 and cache.used == 45 and stored_order(cache) == [(1, 2), (1, 2, 3)]
    assert cache.lookup([1, 2, 3, 4]).target[0].nbytes == 40
    check_trie(cache)


def test_entries_show_what_is_stored_and_cannot_be_changed_through():
    cache = PromptCache(100, min_tokens=1)
    first, second = fake_cache([1, 2, 3], size=10), fake_cache([1, 2, IMAGE_A], size=20)
    cache.store([1, 2, 3], first)
    cache.store([1, 2, IMAGE_A], second)
    assert dict(cache.entries) == {("", (1, 2, 3)): (first, 10), ("", (1, 2, IMAGE_A)): (second, 20)}
    with pytest.raises(AttributeError):
        cache.entries.clear()


def test_clear_empties_the_trie():
    cache = PromptCache(100, min_tokens=1)
    cache.store([1, 2, 3], fake_cache([1, 2, 3]))
    cache.clear()
    assert len(cache) == 0 and cache.used == 0 and cache.lookup([1, 2, 3, 4]) is None
    check_trie(cache)


class Unscannable(OrderedDict):
    """An LRU order that fails any pass over its entries."""

    def __iter__(self):
        raise AssertionError("the entries were scanned")

    keys = values = items = __iter__


def test_a_lookup_walks_the_prompt_and_never_the_entries(monkeypatch):
    rng = random.Random(0)
    system = [rng.randrange(50) for _ in range(20)]
    cache = PromptCache(1 << 30, min_tokens=4)
    conversations = []
    for _ in range(2000):
        tokens = system + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
        conversations.append(tokens)
        cache.store(tokens, fake_cache(tokens, size=1))
    assert len(cache.lru) > 1900  # a few random conversations repeat
    nodes = [cache.root("")]
    for node in nodes:
        nodes.extend(node.children.values())
    assert len(nodes) <= 2 * len(cache) + 1  # a node a token would be ~60,000
    cache.lru = Unscannable(cache.lru)
    walked = []

    def counted_descend(root, key):
        path = descend(root, key)
        walked.append(len(path))
        return path

    monkeypatch.setattr(memory, "descend", counted_descend)
    for tokens in rng.sample(conversations, 50):
        prompt = tokens + [7, 7]
        found, length = cache.lookup(prompt), len(tokens)
        assert int(found.length[0]) >= length and found.tokens[:length] == tuple(tokens)
        assert walked[-1] <= len(prompt)
    assert len(walked) == 50
