"""The store of past answers as a proposal source: its proposals against a
brute-force search of the sequences, learning, the memory bound and its
evictions, files written and read back, the files it refuses, and the
shipped store.

Breaks tried, and the tests that catch them:
- a continuation counted twice once seen (``build_store``'s tally, or
  ``counted``) and ties ranked by the larger token (``ranked``, or
  ``counted``): test_proposals_equal_a_brute_force_search and
  test_proposals_by_hand (the build), test_learning_one_by_one_equals_building_at_once
  (both);
- contexts one token shorter than ``longest`` (``contexts``), and a token
  past the vocabulary packed into an ending (``ending_keys`` without its
  check): test_proposals_equal_a_brute_force_search,
  test_learning_one_by_one_equals_building_at_once;
- a proposal that does not mark its entry used (``_longest_ending`` without
  ``move_to_end``), and the newest entry evicted (``popitem(last=True)``):
  test_eviction_keeps_the_bound_and_drops_the_least_recently_used;
- a file written without its last entry, or read back in reverse order:
  test_a_saved_store_proposes_the_same;
- ``BadZipFile`` (a torn archive) or ``zlib.error`` (a corrupt member) let
  through unwrapped; the identity, the vocabulary, the format or the
  ranking left unchecked: test_a_torn_corrupt_or_foreign_file_is_refused;
- the shipped store's recorded identity changed (``DEFAULT_IDENTITY``):
  test_the_shipped_store_proposes_the_corpus_text;
- the members' headers left unread before the arrays (``_check_members``
  skipped): test_a_crafted_file_is_refused_before_anything_large_is_read
  (the bomb allocates its 600 MB, the long header raises MemoryError);
- no cap on a context's continuations (``counted`` without its check):
  test_a_context_keeps_its_most_frequent_continuations.
"""

import gzip
import json
import random
import struct
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dspark_fn import store
from dspark_fn.store import Recall, Store, build_store, load

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "corpus" / "smollm2-135m-answers.jsonl.gz"
VOCAB = 6  # a small vocabulary: contexts recur and continuations tie


def brute_force(sequences: list, context: list, slots: int, longest: int, floor: int = 1) -> Recall:
    """At each step, the continuations of the text's longest ending (of 2
    to ``longest`` tokens) counted by scanning every sequence; the most
    frequent one (ties: the smaller token) is proposed while its count
    reaches ``floor``."""
    text, tokens, match, confidence = list(context), [], 0, 0.0
    while len(tokens) < slots:
        counts: Counter = Counter()
        for length in range(min(longest, len(text)), 1, -1):
            ending = text[-length:]
            counts = Counter(sequence[start + length] for sequence in sequences
                             for start in range(len(sequence) - length) if sequence[start : start + length] == ending)
            if counts:
                break
        if not counts:
            break
        token, count = min(counts.items(), key=lambda item: (-item[1], item[0]))
        if count < floor:
            break
        if not tokens:
            match, confidence = length, count / sum(counts.values())
        tokens.append(token)
        text.append(token)
    return Recall(tokens, match, confidence)


def random_sequences(rng: random.Random, count: int, vocab: int = VOCAB) -> list:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 25))] for _ in range(count)]


def random_contexts(rng: random.Random, count: int) -> list:
    # now and then a token past the vocabulary, one whose bits spill past a token's width: no stored ending holds it
    return [[rng.choice([VOCAB + 3] + list(range(VOCAB)) * 2) for _ in range(rng.randrange(0, 9))]
            for _ in range(count)]


@pytest.mark.parametrize("longest, floor", [(2, 1), (3, 1), (5, 1), (4, 2)])
def test_proposals_equal_a_brute_force_search(longest, floor):
    rng = random.Random(longest * 10 + floor)
    sequences = random_sequences(rng, 30)
    built = build_store(sequences, VOCAB, "toy", longest=longest, floor=floor)
    for context in random_contexts(rng, 300):
        slots = rng.randrange(0, 7)
        assert built.propose(context, slots) == brute_force(sequences, context, slots, longest, floor), context


def test_proposals_by_hand():
    built = build_store([[1, 2, 3, 4], [1, 2, 3, 5], [0, 2, 3, 4]], VOCAB, "toy", longest=3)
    assert built.propose([0, 1, 2], 5) == Recall([3, 4], 2, 1.0)  # "1 2", then "1 2 3": 4 and 5 tie, 4 is smaller
    assert built.propose([5, 2, 3], 5) == Recall([4], 2, 2 / 3)  # "2 3" went on to 4 twice, to 5 once
    assert built.propose([4, 3], 5) == Recall([], 0, 0.0)
    assert built.propose([2], 5) == Recall([], 0, 0.0)  # one token matches nothing
    assert built.propose([1, 2, 3], 1) == Recall([4], 3, 0.5)


def test_learning_one_by_one_equals_building_at_once():
    rng = random.Random(1)
    sequences = random_sequences(rng, 20)
    learning = Store(VOCAB, "toy", longest=4)
    for count, sequence in enumerate(sequences, 1):
        learning.learn(sequence)
        for context in random_contexts(rng, 20):
            assert learning.propose(context, 4) == brute_force(sequences[:count], context, 4, 4)
    built = build_store(sequences, VOCAB, "toy", longest=4)
    assert dict(learning.entries) == dict(built.entries)
    with pytest.raises(ValueError, match="outside the store's vocabulary"):
        learning.learn([1, VOCAB])


def test_eviction_keeps_the_bound_and_drops_the_least_recently_used():
    lru = Store(16, "toy", longest=2, capacity=3)
    lru.learn([1, 2, 3, 4])  # (1 2) and (2 3)
    lru.learn([5, 6, 7])  # (5 6): full
    assert lru.propose([9, 1, 2], 1).tokens == [3]  # (1 2) used: (2 3) is now the least recently used
    lru.learn([8, 9, 10])  # (8 9) evicts it
    assert len(lru) == 3
    assert [lru.propose(context, 1).tokens for context in ([2, 3], [1, 2], [5, 6], [8, 9])] == [[], [3], [7], [10]]
    rng = random.Random(2)
    bounded = Store(VOCAB, "toy", longest=5, capacity=40)
    for sequence in random_sequences(rng, 50):
        bounded.learn(sequence)
        assert len(bounded) <= 40
    assert len(bounded) == 40


def test_a_build_past_capacity_keeps_the_most_frequent_contexts():
    sequences = random_sequences(random.Random(3), 30)
    full = build_store(sequences, VOCAB, "toy", longest=3)
    totals = {key: sum(counts[1::2]) for key, counts in full.entries.items()}
    kept = build_store(sequences, VOCAB, "toy", longest=3, capacity=25)
    assert len(kept) == 25
    assert min(totals[key] for key in kept.entries) >= max(totals[key] for key in totals if key not in kept.entries)
    assert list(kept.entries) == list(full.entries)[-25:]  # the rarest first in line for eviction
    twice = build_store(sequences, VOCAB, "toy", longest=3, least_count=2)
    assert set(twice.entries) == {key for key, total in totals.items() if total >= 2}


def test_a_saved_store_proposes_the_same(tmp_path):
    rng = random.Random(4)
    built = build_store(random_sequences(rng, 40), VOCAB, "toy", longest=4)
    built.learn([1, 2, 3])
    path = built.save(tmp_path / "store.npz")
    loaded, order = load(path, VOCAB, "toy"), list(built.entries)
    assert list(loaded.entries.items()) == list(built.entries.items())  # the eviction order too
    for context in random_contexts(rng, 100):
        assert loaded.propose(context, 5) == built.propose(context, 5)
    assert list(load(path, VOCAB, "toy", capacity=10).entries) == order[-10:]
    assert not list(tmp_path.glob("*.partial"))


def rewritten(path: Path, **changes) -> Path:
    """The store file at ``path`` with some of its arrays replaced."""
    with np.load(path) as stored:
        arrays = {name: stored[name] for name in stored.files}
    with path.open("wb") as handle:
        np.savez_compressed(handle, **{**arrays, **changes})
    return path


def test_a_torn_corrupt_or_foreign_file_is_refused(tmp_path):
    path = build_store(random_sequences(random.Random(5), 20), VOCAB, "toy", longest=3).save(tmp_path / "store.npz")
    whole = path.read_bytes()
    torn = tmp_path / "torn.npz"
    torn.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="torn"):
        load(torn, VOCAB, "toy")
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
    for member in members:  # a byte flipped amid each array: a checksum or the decompression fails
        name_length, extra_length = struct.unpack("<HH", whole[member.header_offset + 26 : member.header_offset + 30])
        corrupt = bytearray(whole)
        corrupt[member.header_offset + 30 + name_length + extra_length + member.compress_size // 2] ^= 0xFF
        (tmp_path / "corrupt.npz").write_bytes(bytes(corrupt))
        with pytest.raises(ValueError, match="corrupt"):
            load(tmp_path / "corrupt.npz", VOCAB, "toy")
    with pytest.raises(ValueError, match="vocabulary"):
        load(path, VOCAB + 1, "toy")
    with pytest.raises(ValueError, match="answers of 'toy', not of 'other'"):
        load(path, VOCAB, "other")
    with pytest.raises(ValueError, match="format 2"):
        load(rewritten(tmp_path / "store.npz", format=np.array(2)), VOCAB, "toy")
    path = build_store([[1, 2, 3, 1, 2, 4]], VOCAB, "toy", longest=3).save(tmp_path / "store.npz")
    with np.load(path) as stored:
        continuations, tokens = stored["continuations"], stored["next_tokens"].copy()
    first = int((np.cumsum(continuations) - continuations)[np.flatnonzero(continuations == 2)[0]])
    tokens[[first, first + 1]] = tokens[[first + 1, first]]  # (1 2) went on to 3 and 4 once each: 4 now first
    with pytest.raises(ValueError, match="not ranked"):
        load(rewritten(path, next_tokens=tokens), VOCAB, "toy")
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(ValueError, match="no store file"):
        load(tmp_path / "other.npz", VOCAB, "toy")


def crafted(path: Path, copy: str, name: str, chunks) -> Path:
    """A copy of the store at ``path`` whose member ``name`` holds the bytes
    of ``chunks`` (deflated as they come, never held whole)."""
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    del members[name + ".npy"]
    with zipfile.ZipFile(path.with_name(copy), "w", zipfile.ZIP_DEFLATED) as archive:
        for member, content in members.items():
            archive.writestr(member, content)
        with archive.open(name + ".npy", "w", force_zip64=True) as member:
            for chunk in chunks:
                member.write(chunk)
    return path.with_name(copy)


def copied(path: Path, name: str) -> Path:
    copy = path.with_name(name)
    copy.write_bytes(path.read_bytes())
    return copy


def npy_header(dtype: str, shape: tuple) -> bytes:
    """An ``.npy`` version-1 header for an array of ``dtype`` and ``shape``."""
    text = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


def test_a_crafted_file_is_refused_before_anything_large_is_read(tmp_path):
    """A deflate bomb (600 MB of zeros in a few hundred kilobytes), a
    header claiming 2^40 elements over a few bytes, token ids of a signed
    type (negative ids wrap to valid ones) and a longest context of 10^9
    are each refused with one ``ValueError`` naming the field, with no
    large allocation (the process stays far below the bomb's size)."""
    import resource

    path = build_store(random_sequences(random.Random(5), 20), VOCAB, "toy", longest=3).save(tmp_path / "store.npz")
    zeros = bytes(1 << 20)
    cases = {
        "a deflate bomb": (crafted(path, "bomb.npz", "next_counts",
                                   [npy_header("<u4", (150 << 20,))] + [zeros] * 600), "more than a store file may"),
        "2^40 elements": (crafted(path, "long.npz", "next_counts", [npy_header("<u4", (1 << 40,)), bytes(16)]),
                          "its next_counts is uint32 \\(1099511627776,\\)"),
        "signed token ids": (rewritten(copied(path, "signed.npz"), next_tokens=np.array([-1] * 3, np.int16)),
                             "its next_tokens is int16"),
        "a huge longest": (rewritten(copied(path, "longest.npz"), longest=np.array(10**9)),
                           "up to 1000000000 tokens, not 2 to 16"),
    }
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, (crafted_path, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load(crafted_path, VOCAB, "toy")
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000, name  # KiB: no 600 MB read


def test_a_context_keeps_its_most_frequent_continuations(monkeypatch):
    """Past ``MOST_CONTINUATIONS`` a new continuation takes the least
    frequent one's place; the most frequent stays first."""
    monkeypatch.setattr(store, "MOST_CONTINUATIONS", 3)
    counts = ()
    for token in [5, 5, 5, 6, 6, 7, 8, 9]:
        counts = store.counted(counts, token)
    assert counts[0:2] == (5, 3) and len(counts) == 6 and counts[2:4] == (6, 2)


def test_the_shipped_store_proposes_the_corpus_text():
    assert store.DEFAULT_STORE.stat().st_size < 4_000_000
    # its 100,000 most frequent contexts (every array is still read and checked): a quarter of the full load's time
    shipped = load(store.DEFAULT_STORE, 49152, store.DEFAULT_IDENTITY, capacity=100_000)
    with gzip.open(CORPUS, "rt") as handle:
        answer = next(row["answer"] for row in map(json.loads, handle) if len(row["answer"]) >= 64)
    recalls = [shipped.propose(answer[:position], 5) for position in range(2, 64)]
    assert all(recall.match >= 2 and 0 < recall.confidence <= 1 for recall in recalls if recall.tokens)
    hits = [recall.tokens[0] == answer[position] for position, recall in enumerate(recalls, 2) if recall.tokens]
    assert len(hits) > 40 and sum(hits) > len(hits) / 3
