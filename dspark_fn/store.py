"""The store: an index of the target's own past answers that proposes how the
current text goes on, the way those answers went on after the same words
(SuffixDecoding's idea, kept as n-gram tables).

For every context length k from ``SHORTEST`` to ``longest``, the store maps
each k-token context seen in the answers to how often each token followed
it. ``propose`` finds the longest ending of the text that the store holds and
takes the token that most often followed it (ties: the smallest id), then
does the same for the text extended by that token, and so on while the
chosen token's count stays at or above ``floor``: a proposal follows the
most travelled path through the past answers. Like a copy it is a function
of the committed tokens alone, so it is a point-mass proposal; ``match``
(the length of the ending it continues) is what the planner rates it by,
and ``confidence`` is the share of the first token among that ending's
continuations.

Design, measured (``bench/store_sim.py designs``: the corpus's 1,007,131
answer tokens, CPU time): n-gram tables propose 5 tokens in 15-22 us at
about 200 bytes a context (51 MB shipped), a suffix array in 130-150 us at
8 MB; the tables win on time, and only they learn a sequence at O(1) a context.

Memory is bounded in entries (an entry: one context and its continuation
counts, about 200 bytes): past ``capacity`` the least recently used entry
(proposed from or learned into) goes first. The entries sit in an ordered
dictionary, so a use, an update and an eviction each cost O(1) (an update
also re-ranks that context's continuations, O(its continuations)).

A context keeps at most ``MOST_CONTINUATIONS`` continuations (a new one
past them takes the least frequent one's place), so learning an answer
costs the same however its contexts were fed.

A store file is one ``.npz`` of flat arrays, written whole or not at all,
that records the vocabulary size and the identity of the target whose
answers it holds: tokens of another tokenizer would match by accident and
propose garbage, so ``load`` refuses a file made for another, as it
refuses a file that is torn, corrupt or of another format version. A file
is input: before any array is read, each member's header must describe
exactly the bytes the archive says it holds, in an unsigned integer type
(a token id cannot be negative), and all of them together at most
``LARGEST_FILE`` bytes, so a crafted archive (a deflate bomb, a header
that claims 2^40 elements) is refused before anything large is allocated;
then the arrays must describe whole entries, ``longest`` at most
``LONGEST_CONTEXT``.
"""

import zipfile
import zlib
from collections import OrderedDict
from itertools import chain
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from . import atomic

SHORTEST = 2  # a one-token ending continues too many ways to be worth a verify slot
LONGEST = 4  # longer contexts cost entries and add nothing measured (copying.LONGEST_MATCH too)
CAPACITY = 1 << 19  # entries: about 100 MB, twice the shipped store
FLOOR = 1  # a continuation seen once is proposed (the planner's rates per match length judge it)
FORMAT = 1  # version of the file layout
LONGEST_CONTEXT = 16  # the longest context a store may keep (learning costs a dictionary write per length)
MOST_CONTINUATIONS = 1024  # continuations a context keeps (the shipped store's most: 791)
LARGEST_FILE = 256 << 20  # bytes of arrays a store file may hold (the shipped one: 6 MB)
DEFAULT_STORE = Path(__file__).parent / "default_store" / "store.npz"
DEFAULT_IDENTITY = "smollm2-135m"  # the embedded default target (catalog.DEFAULT_ALIAS), whose answers it holds


class Recall(NamedTuple):
    tokens: list  # the proposed continuation (empty: no ending of SHORTEST tokens or more is stored)
    match: int  # length of the ending it continues (0: none)
    confidence: float  # the first token's share of the continuations counted after that ending (0.0: none)


class Store:
    """Continuation counts of contexts of ``SHORTEST`` to ``longest`` tokens,
    at most ``capacity`` of them, least recently used first in ``entries``.

    A context is a key packing its tokens (the last one lowest, a leading 1
    bit above the first so lengths never collide); its entry is a tuple
    ``(token, count, token, count, ...)``, most frequent first, ties by the
    smaller token (a tuple takes a third of a dictionary's memory)."""

    def __init__(self, vocab_size: int, identity: str, longest: int = LONGEST, capacity: int = CAPACITY,
                 floor: int = FLOOR, entries: OrderedDict | None = None):
        if not SHORTEST <= longest <= LONGEST_CONTEXT:
            raise ValueError(f"contexts must be of {SHORTEST} to {LONGEST_CONTEXT} tokens, got longest={longest}")
        if capacity < 1 or floor < 1 or vocab_size < 1:
            raise ValueError(f"capacity, floor and vocab_size must be positive, got {capacity}, {floor}, {vocab_size}")
        self.vocab_size, self.identity = vocab_size, identity
        self.longest, self.capacity, self.floor = longest, capacity, floor
        self.entries: OrderedDict = entries if entries is not None else OrderedDict()
        self._evict()

    def __len__(self) -> int:
        return len(self.entries)

    def propose(self, context: list, slots: int) -> Recall:
        """Up to ``slots`` tokens continuing ``context`` the way the stored
        answers most often went on, each from the longest ending found."""
        text = [int(token) for token in context[-self.longest :]]
        tokens, match, confidence = [], 0, 0.0
        while len(tokens) < slots:
            length, counts = self._longest_ending(text)
            if not length or counts[1] < self.floor:
                break
            if not tokens:
                match, confidence = length, counts[1] / sum(counts[1::2])
            tokens.append(counts[0])
            text = text[1:] + [counts[0]] if len(text) == self.longest else text + [counts[0]]
        return Recall(tokens, match, confidence)

    def learn(self, tokens: Iterable[int]) -> None:
        """Count every continuation in ``tokens`` (a finished sequence)."""
        sequence = in_vocabulary(tokens, self.vocab_size)
        for key, following in contexts(sequence, self.longest, self.vocab_size):
            self.entries[key] = counted(self.entries.get(key, ()), following)
            self.entries.move_to_end(key)
            self._evict()

    def save(self, path) -> Path:
        """The store as one file at ``path``, least recently used entries first."""
        arrays = self._arrays()
        return atomic.write_with(path, lambda partial: _save_npz(partial, arrays))

    def _longest_ending(self, text: list) -> tuple[int, tuple]:
        """``(length, counts)`` of the longest stored ending of ``text`` (``(0, ())``: none); it counts as used."""
        keys = ending_keys(text, self.longest, self.vocab_size)
        for length in range(len(keys), SHORTEST - 1, -1):
            counts = self.entries.get(keys[length - 1])
            if counts is not None:
                self.entries.move_to_end(keys[length - 1])
                return length, counts
        return 0, ()

    def _evict(self) -> None:
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def _arrays(self) -> dict:
        bits = token_bits(self.vocab_size)
        lengths = [(key.bit_length() - 1) // bits for key in self.entries]
        context_tokens = [(key >> (bits * place)) & ((1 << bits) - 1)
                          for key, length in zip(self.entries, lengths) for place in range(length - 1, -1, -1)]
        token_type = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return {
            "format": np.array(FORMAT), "vocab_size": np.array(self.vocab_size), "identity": np.array(self.identity),
            "longest": np.array(self.longest),
            "context_lengths": np.array(lengths, np.uint8),
            "context_tokens": np.array(context_tokens, token_type),
            "continuations": np.array([len(counts) // 2 for counts in self.entries.values()], np.uint32),
            "next_tokens": np.array([t for counts in self.entries.values() for t in counts[::2]], token_type),
            "next_counts": np.array([c for counts in self.entries.values() for c in counts[1::2]], np.uint32),
        }


def token_bits(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


def in_vocabulary(tokens: Iterable[int], vocab_size: int) -> list:
    sequence = [int(token) for token in tokens]
    outside = [token for token in sequence if not 0 <= token < vocab_size]
    if outside:
        raise ValueError(f"tokens {outside[:4]} lie outside the store's vocabulary of {vocab_size}")
    return sequence


def ending_keys(text: list, longest: int, vocab_size: int) -> list:
    """The keys of ``text``'s endings of 1, 2, ... up to ``longest`` tokens;
    they stop before a token outside the vocabulary (no stored context holds
    one, and its bits would spill into its neighbour's)."""
    bits, keys, packed = token_bits(vocab_size), [], 0
    for place in range(min(longest, len(text))):
        token = text[-1 - place]
        if not 0 <= token < vocab_size:
            break
        packed |= token << (bits * place)
        keys.append(packed | 1 << (bits * (place + 1)))
    return keys


def contexts(sequence: list, longest: int, vocab_size: int) -> Iterable[tuple[int, int]]:
    """``(key, following token)`` of every context of ``SHORTEST`` to
    ``longest`` tokens in ``sequence``."""
    for end in range(SHORTEST, len(sequence)):
        keys = ending_keys(sequence[max(0, end - longest) : end], longest, vocab_size)
        for key in keys[SHORTEST - 1 :]:
            yield key, sequence[end]


def counted(counts: tuple, token: int) -> tuple:
    """``counts`` with one more ``token``, still ranked: it moves up past
    the continuations it now outnumbers (a common context has thousands, so
    no re-sort)."""
    tokens = counts[::2]
    place = tokens.index(token) if token in tokens else len(tokens)
    count = counts[2 * place + 1] + 1 if place < len(tokens) else 1
    rest = counts[: 2 * place] + counts[2 * place + 2 :]
    if len(rest) >= 2 * MOST_CONTINUATIONS:  # full: the least frequent continuation makes room
        rest = rest[: 2 * MOST_CONTINUATIONS - 2]
        place = min(place, len(rest) // 2)
    while place and (count, -token) > (rest[2 * place - 1], -rest[2 * place - 2]):
        place -= 1
    return rest[: 2 * place] + (token, count) + rest[2 * place :]


def ranked(tally: dict) -> tuple:
    """``{token: count}`` as ``(token, count, ...)``, most frequent first, ties by the smaller token."""
    return tuple(value for pair in sorted(tally.items(), key=lambda item: (-item[1], item[0])) for value in pair)


def build_store(sequences: Iterable[Iterable[int]], vocab_size: int, identity: str, longest: int = LONGEST,
                capacity: int = CAPACITY, least_count: int = 1, floor: int = FLOOR) -> Store:
    """A store of ``sequences`` (answers): contexts seen ``least_count``
    times or more, the ``capacity`` most frequent of them; the rarer an
    entry, the sooner it is evicted (until use reorders them)."""
    tallies: dict = {}
    for tokens in sequences:
        for key, following in contexts(in_vocabulary(tokens, vocab_size), longest, vocab_size):
            tally = tallies.setdefault(key, {})
            tally[following] = tally.get(following, 0) + 1
    totals = {key: sum(tally.values()) for key, tally in tallies.items()}
    kept = sorted((key for key, total in totals.items() if total >= least_count), key=totals.__getitem__)
    entries = OrderedDict((key, ranked(tallies[key])) for key in kept[-capacity:])
    return Store(vocab_size, identity, longest, capacity, floor, entries)


def load(path, vocab_size: int, identity: str, capacity: int = CAPACITY, floor: int = FLOOR) -> Store:
    """The store saved at ``path``, for a target of ``vocab_size`` tokens
    known as ``identity``; past ``capacity`` its least recently used entries
    are left out. A file that is torn, corrupt, of another format or made
    for another vocabulary or target raises ``ValueError``."""
    arrays = _read_npz(Path(path))
    _check_header(path, arrays, vocab_size, identity)
    lengths, continuations = arrays["context_lengths"].astype(np.int64), arrays["continuations"].astype(np.int64)
    _check_layout(path, arrays, lengths, continuations)
    entries = stored_entries(arrays, lengths, continuations, capacity)
    if len(entries) != min(len(lengths), capacity):
        raise ValueError(f"{path} is inconsistent: it holds a context twice")
    return Store(vocab_size, identity, int(arrays["longest"]), capacity, floor, entries)


def stored_entries(arrays: dict, lengths: np.ndarray, continuations: np.ndarray, count: int) -> OrderedDict:
    """The last ``count`` entries of a file's checked arrays, in order."""
    vocab_size = int(arrays["vocab_size"])
    bits, integers = token_bits(vocab_size), list(range(vocab_size))
    # one int object per token id, shared by every entry: a token held as its own object costs 28 bytes
    tokens = map(integers.__getitem__, arrays["next_tokens"].tolist())
    pairs = list(chain.from_iterable(zip(tokens, arrays["next_counts"].tolist())))
    context_tokens = arrays["context_tokens"].tolist()
    context_ends, pair_ends = np.cumsum(lengths).tolist(), (2 * np.cumsum(continuations)).tolist()
    entries = OrderedDict()
    for entry in range(max(0, len(lengths) - count), len(lengths)):
        key = 1
        for token in context_tokens[context_ends[entry - 1] if entry else 0 : context_ends[entry]]:
            key = key << bits | token
        entries[key] = tuple(pairs[pair_ends[entry - 1] if entry else 0 : pair_ends[entry]])
    return entries


FIELDS = ("format", "vocab_size", "identity", "longest", "context_lengths", "context_tokens", "continuations",
          "next_tokens", "next_counts")


def _read_npz(path: Path) -> dict:
    """The store's arrays at ``path``; a torn or corrupt archive (each member
    carries a checksum), one that lacks a field, or one whose members'
    headers do not describe what they hold (``_check_members``) raises
    ``ValueError`` before any array is read."""
    try:
        with zipfile.ZipFile(path) as archive:
            _check_members(path, archive)
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in FIELDS}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        if str(error).startswith(str(path)):
            raise
        raise ValueError(f"{path} is torn or corrupt ({error})") from error
    return arrays


TEXT_FIELDS = ("identity",)


def _check_members(path: Path, archive: zipfile.ZipFile) -> None:
    """Every field is a member whose ``.npy`` header describes exactly the
    bytes the archive says it holds, in an unsigned integer type (the
    identity: text), and all members together hold at most ``LARGEST_FILE``
    bytes: read from the headers, before any array is."""
    members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
    missing = [name for name in FIELDS if name not in members]
    if missing:
        raise ValueError(f"{path} is no store file: it lacks {', '.join(missing)}")
    total = sum(members[name].file_size for name in FIELDS)
    if total > LARGEST_FILE:
        raise ValueError(f"{path} holds {total} bytes of arrays, more than a store file may ({LARGEST_FILE})")
    for name in FIELDS:
        with archive.open(members[name]) as member:
            version = np.lib.format.read_magic(member)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(member)
            size = member.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        wanted = "U" if name in TEXT_FIELDS else "u" if name not in ("format", "vocab_size", "longest") else "ui"
        if dtype.kind not in wanted or size != members[name].file_size:
            raise ValueError(f"{path}: its {name} is {dtype} {tuple(shape)} in {members[name].file_size} bytes, not "
                             f"{'text' if wanted == 'U' else 'unsigned integers'} filling them: not a store file")


def _check_header(path, arrays: dict, vocab_size: int, identity: str) -> None:
    if int(arrays["format"]) != FORMAT:
        raise ValueError(f"{path} is a store of format {int(arrays['format'])}; this version reads format {FORMAT}")
    if int(arrays["vocab_size"]) != vocab_size:
        raise ValueError(f"{path} holds tokens of a {int(arrays['vocab_size'])}-token vocabulary, "
                         f"not {vocab_size}: its proposals would be another tokenizer's")
    if str(arrays["identity"]) != identity:
        raise ValueError(f"{path} holds the answers of {str(arrays['identity'])!r}, not of {identity!r}")
    if not SHORTEST <= int(arrays["longest"]) <= LONGEST_CONTEXT:
        raise ValueError(f"{path} stores contexts of up to {int(arrays['longest'])} tokens, not {SHORTEST} to "
                         f"{LONGEST_CONTEXT}")
    if int(arrays["vocab_size"]) < 1 or int(arrays["format"]) < 0:
        raise ValueError(f"{path} is inconsistent: a vocabulary of {int(arrays['vocab_size'])} tokens")


def _check_layout(path, arrays: dict, lengths: np.ndarray, continuations: np.ndarray) -> None:
    """The flat arrays describe whole entries: contexts of a stored length,
    tokens in the vocabulary, each context's continuations ranked, counts
    positive."""
    vocab_size, longest = int(arrays["vocab_size"]), int(arrays["longest"])
    tokens, counts = arrays["next_tokens"].astype(np.int64), arrays["next_counts"].astype(np.int64)
    if len(continuations) != len(lengths) or ((lengths < SHORTEST) | (lengths > longest)).any() or (
            continuations > MOST_CONTINUATIONS).any():
        raise ValueError(f"{path} is inconsistent: its contexts' lengths do not match its continuation lists, "
                         f"lie outside {SHORTEST}..{longest}, or a context has more than {MOST_CONTINUATIONS} "
                         f"continuations")
    if lengths.sum() != len(arrays["context_tokens"]) or (continuations < 1).any() or (
            continuations.sum() != len(tokens) or len(tokens) != len(counts)):
        raise ValueError(f"{path} is inconsistent: its tokens do not add up to its contexts and continuations")
    if (arrays["context_tokens"] >= vocab_size).any() or (tokens >= vocab_size).any() or (counts < 1).any():
        raise ValueError(f"{path} is inconsistent: tokens outside its vocabulary of {vocab_size} or counts below 1")
    first = np.zeros(len(tokens), bool)
    first[np.cumsum(continuations) - continuations] = True
    behind = (counts[1:] > counts[:-1]) | ((counts[1:] == counts[:-1]) & (tokens[1:] <= tokens[:-1]))
    if (behind & ~first[1:]).any():
        raise ValueError(f"{path} is inconsistent: a context's continuations are not ranked by count")


def _save_npz(path: Path, arrays: dict) -> None:
    with path.open("wb") as handle:  # a file object: numpy would add ``.npz`` to a path
        np.savez_compressed(handle, **arrays)
