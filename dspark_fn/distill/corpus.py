"""Training sequences with the target's features, built in batched
teacher-forced passes and kept on disk in shards, never all in memory.

A shard holds up to ``SHARD_ROWS`` sequences (prompt + the target's answer),
right-padded to the shard's longest: tokens, the answer mask, the tapped
features (float16) and the target's top-K next-token distribution where the
loss reads it (the positions whose next token is an answer token, and the
answer's last). Each pass runs a few sequences of similar length padded to
their own longest, and the output head runs only at those positions: the
49k-row head is a large share of a small target's forward on a CPU.
``index.json`` lists the shards and how many answers they cover, so
building resumes after the last complete shard and extends when the answers
grow; shard and index are each written whole or not at all. Shard ``w``
holds the answers' ``w``-th window of ``rows``; a shard found on disk past
the index (another process built it, or a kill came before the index) joins
the index once its tokens and taps are checked against its window. Shards may
store more tapped layers than a draft reads: each draft reads its own taps
from them, so drafts with other taps train from the same shards.
"""

import json
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from .. import atomic

TOP_K = 16  # target distribution kept per position (greedy targets are peaked)
SHARD_ROWS = 64
PASS_ROWS = 8  # sequences per teacher-forced pass
LENGTH_STEP = 64  # sequences are padded to a multiple of this (one trace per length)
HEAD_CHUNK = 512  # positions whose logits are formed at once
INDEX = "index.json"


class Corpus(NamedTuple):
    """Prompt + target response per row, right-padded to one length ``S``.

    loss_mask marks response tokens (the target's own, up to and including a
    stop token); ``top_ids/top_probs`` at position ``t`` describe the target's
    distribution of the token at ``t + 1``.
    """

    tokens: mx.array  # [N, S] int32
    loss_mask: mx.array  # [N, S] bool
    features: mx.array  # [N, S, F] concatenated target taps
    top_ids: mx.array  # [N, S, K] int32 (zeros where the loss never reads them)
    top_probs: mx.array  # [N, S, K]


@lru_cache(maxsize=None)
def _taps_kernel(adapter, spec, taps: tuple):
    def run(params, tokens):
        batch, length = tokens.shape
        kv = adapter.init_kv(spec, batch, length)
        hidden, features, _ = adapter.forward(spec, params, kv, tokens, mx.zeros((batch,), mx.int32), taps)
        return hidden, features.astype(mx.float16)

    return mx.compile(run)


@lru_cache(maxsize=None)
def _top_k_kernel(adapter, spec, k: int):
    def run(params, hidden):
        logits = adapter.logits(spec, params, hidden).astype(mx.float32)
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        probs = mx.take_along_axis(mx.softmax(logits, axis=-1), ids, axis=-1)
        return ids.astype(mx.int32), probs.astype(mx.float16)

    return mx.compile(run)


def distribution_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Where the loss reads the target's distribution: positions followed by an answer token, and answer tokens."""
    needed = loss_mask.copy()
    needed[:, :-1] |= loss_mask[:, 1:]
    return needed


def teacher_forced(adapter, spec, params: dict, taps: tuple, tokens: np.ndarray, loss_mask: np.ndarray,
                   k: int = TOP_K):
    """Features of the target over right-padded ``tokens [B, S]``, and its
    top-K where ``distribution_positions(loss_mask)`` (zeros elsewhere)."""
    hidden, features = _taps_kernel(adapter, spec, taps)(params, mx.array(tokens))
    rows, columns = np.nonzero(distribution_positions(loss_mask))
    ids = np.zeros((*tokens.shape, k), np.int32)
    probs = np.zeros((*tokens.shape, k), np.float16)
    top_k = _top_k_kernel(adapter, spec, k)
    for begin in range(0, len(rows), HEAD_CHUNK):
        chunk = slice(begin, begin + HEAD_CHUNK)
        picked = np.zeros(HEAD_CHUNK, np.int64)  # a fixed chunk shape: one trace
        picked[: len(rows[chunk])] = rows[chunk] * tokens.shape[1] + columns[chunk]
        flat = hidden.reshape(-1, hidden.shape[-1])[mx.array(picked)]
        chunk_ids, chunk_probs = top_k(params, flat[None])
        count = len(rows[chunk])
        ids[rows[chunk], columns[chunk]] = np.array(chunk_ids[0, :count])
        probs[rows[chunk], columns[chunk]] = np.array(chunk_probs[0, :count])
    return np.array(features), ids, probs


def sequence_arrays(answers: Sequence, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, loss_mask)`` of prompt + answer rows, cut to ``max_length``,
    padded to a multiple of ``LENGTH_STEP``."""
    rows = [(list(a.prompt) + list(a.answer))[:max_length] for a in answers]
    width = -(-max(map(len, rows)) // LENGTH_STEP) * LENGTH_STEP
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, (row, answer) in enumerate(zip(rows, answers)):
        tokens[i, : len(row)] = row
        mask[i, len(answer.prompt) : len(row)] = True
    return tokens, mask


def build_shard(adapter, spec, params, taps: tuple, answers: Sequence, max_length: int) -> dict:
    """Arrays of one shard; ``answers`` sorted by length, each pass padded to its own longest."""
    tokens, mask = sequence_arrays(answers, max_length)
    lengths = [min(max_length, len(a.prompt) + len(a.answer)) for a in answers]
    parts = []
    for begin in range(0, len(tokens), PASS_ROWS):
        rows = slice(begin, begin + PASS_ROWS)
        used = -(-max(lengths[rows]) // LENGTH_STEP) * LENGTH_STEP
        part = teacher_forced(adapter, spec, params, taps, tokens[rows, :used], mask[rows, :used])
        parts.append([np.pad(array, [(0, 0), (0, tokens.shape[1] - used), (0, 0)]) for array in part])
    features, ids, probs = (np.concatenate(column) for column in zip(*parts))
    return {"tokens": tokens, "loss_mask": mask, "features": features, "top_ids": ids, "top_probs": probs,
            "taps": np.asarray(taps, np.int32)}


def read_index(directory: Path) -> dict:
    path = Path(directory) / INDEX
    return json.loads(path.read_text()) if path.is_file() else {"shards": [], "answers": 0}


def window_answers(answers: Sequence, window: int, rows: int) -> list:
    """The answers of shard ``window``, sorted by length (a shard holds similar lengths: less padding)."""
    return sorted(answers[window * rows : (window + 1) * rows], key=lambda a: len(a.prompt) + len(a.answer))


def shard_path(directory, window: int) -> Path:
    return Path(directory) / f"shard-{window:05d}.npz"


def shard_holds(path: Path, window: Sequence, taps: Sequence[int], max_length: int) -> bool:
    """Whether the shard file at ``path`` was built from ``window`` with ``taps``."""
    if not path.is_file():
        return False
    stored = np.load(path)
    if "taps" not in stored.files or stored["taps"].tolist() != list(taps):
        return False
    return np.array_equal(stored["tokens"], sequence_arrays(window, max_length)[0])


def build_window(adapter, spec, params, taps: Sequence[int], members: Sequence, path: Path, max_length: int) -> None:
    """The shard of one window's answers (sorted by length) written whole at
    ``path``, unless the file there already holds it."""
    if not shard_holds(path, members, taps, max_length):
        arrays = build_shard(adapter, spec, params, tuple(taps), members, max_length)
        atomic.write_with(path, lambda partial: _save_npz(partial, arrays))


def adopt_shards(directory, index: dict, answers: Sequence, taps: Sequence[int], max_length: int,
                 rows: int = SHARD_ROWS) -> dict:
    """The index extended by the shards on disk that continue it, each checked
    against its window; written whole when it grows."""
    grown = False
    while (len(index["shards"]) + 1) * rows <= len(answers):
        window = len(index["shards"])
        path = shard_path(directory, window)
        if not shard_holds(path, window_answers(answers, window, rows), taps, max_length):
            break
        tokens = int(np.load(path)["loss_mask"].sum())
        index["shards"].append({"file": path.name, "rows": rows, "tokens": tokens})
        index["answers"] = (window + 1) * rows
        grown = True
    if grown:
        atomic.write_text(Path(directory) / INDEX, json.dumps(index, indent=1))
    return index


def build_shards(adapter, spec, params, taps: Sequence[int], answers: Sequence, directory, max_length: int = 512,
                 on_shard: Callable[[int, int], None] = lambda done, total: None, rows: int = SHARD_ROWS,
                 builds: Callable[[int], bool] = lambda window: True) -> dict:
    """Shards of ``rows`` answers for every whole window not yet covered (of
    those this process ``builds``; the others are left to other processes and
    adopted when they appear); returns the index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = read_index(directory)
    if index["shards"] and index.get("taps") != list(taps):
        raise ValueError(f"{directory} holds features of taps {index.get('taps')}, not {list(taps)}: "
                         f"store those taps, or use another directory")
    index["taps"] = list(taps)
    index = adopt_shards(directory, index, answers, taps, max_length, rows)
    for window in range(len(index["shards"]), len(answers) // rows):
        if builds(window):
            build_window(adapter, spec, params, taps, window_answers(answers, window, rows),
                         shard_path(directory, window), max_length)
        before = index["answers"]
        index = adopt_shards(directory, index, answers, taps, max_length, rows)
        if index["answers"] > before:
            on_shard(index["answers"], len(answers))
    return index


def _save_npz(path: Path, arrays: dict) -> None:
    with path.open("wb") as handle:  # a file object: numpy would add ``.npz`` to a path
        np.savez(handle, **arrays)


def tap_columns(index: dict, taps: Sequence[int]) -> list[int]:
    """Where each of a draft's ``taps`` sits among the stored ones."""
    stored = index.get("taps", [])
    missing = [tap for tap in taps if tap not in stored]
    if missing:
        raise ValueError(f"the feature shards store taps {stored}, not {missing}: train a draft with taps among "
                         f"them, or build shards of its taps in another directory")
    return [stored.index(tap) for tap in taps]


def load_shard(directory, entry: dict, columns: Sequence[int] | None = None, stored_taps: int = 1) -> Corpus:
    """A shard; with ``columns``, its features cut to the stored taps at
    those places (of ``stored_taps`` side by side)."""
    arrays = dict(np.load(Path(directory) / entry["file"]))
    if columns is not None:
        rows, length, width = arrays["features"].shape
        per_tap = arrays["features"].reshape(rows, length, stored_taps, width // stored_taps)
        arrays["features"] = per_tap[:, :, list(columns)].reshape(rows, length, -1)
    return Corpus(*(mx.array(arrays[name]) for name in Corpus._fields))


def shard_schedule(directory, index: dict, seed: int, taps: Sequence[int] | None = None) -> Callable[[int], Corpus]:
    """``shards(n)``: the n-th shard read, in a fresh random order each epoch,
    with the features of ``taps`` (default: every stored tap); a function
    of ``(seed, n)`` alone, so a resumed run reads what it would have read.
    One shard is in memory at a time."""
    count = len(index["shards"])
    columns = tap_columns(index, taps) if taps is not None else None

    def shard(n: int) -> Corpus:
        epoch, place = divmod(n, count)
        order = np.random.default_rng([seed, epoch]).permutation(count)
        return load_shard(directory, index["shards"][order[place]], columns, len(index["taps"]))

    return shard
