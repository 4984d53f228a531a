"""Training sequences with the target's features, built in batched
teacher-forced passes and kept on disk in shards, never all in memory.

A shard holds up to ``SHARD_ROWS`` sequences (prompt + the target's answer),
right-padded to the shard's longest: tokens, the answer mask, the tapped
features (float16) and the target's top-K next-token distribution at every
position. ``index.json`` lists the shards and how many answers they cover,
so building resumes after the last complete shard and extends when the
answers file grows.
"""

import json
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

TOP_K = 16  # target distribution kept per position (greedy targets are peaked)
SHARD_ROWS = 64
PASS_ROWS = 8  # sequences per teacher-forced pass
LENGTH_STEP = 64  # sequences are padded to a multiple of this (one trace per length)
HEAD_CHUNK = 128  # positions whose logits are formed at once
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
    top_ids: mx.array  # [N, S, K] int32
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


def teacher_forced(adapter, spec, params: dict, taps: tuple, tokens: np.ndarray, k: int = TOP_K):
    """Features and top-K of the target over right-padded ``tokens [B, S]``."""
    hidden, features = _taps_kernel(adapter, spec, taps)(params, mx.array(tokens))
    ids, probs = [], []
    top_k = _top_k_kernel(adapter, spec, k)
    for begin in range(0, tokens.shape[1], HEAD_CHUNK):
        chunk_ids, chunk_probs = top_k(params, hidden[:, begin : begin + HEAD_CHUNK])
        mx.eval(chunk_ids, chunk_probs)
        ids.append(np.array(chunk_ids))
        probs.append(np.array(chunk_probs))
    return np.array(features), np.concatenate(ids, axis=1), np.concatenate(probs, axis=1)


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
    tokens, mask = sequence_arrays(answers, max_length)
    parts = [teacher_forced(adapter, spec, params, taps, tokens[i : i + PASS_ROWS]) for i in range(0, len(tokens), PASS_ROWS)]
    features, ids, probs = (np.concatenate(column) for column in zip(*parts))
    return {"tokens": tokens, "loss_mask": mask, "features": features, "top_ids": ids, "top_probs": probs}


def read_index(directory: Path) -> dict:
    path = Path(directory) / INDEX
    return json.loads(path.read_text()) if path.is_file() else {"shards": [], "answers": 0}


def build_shards(adapter, spec, params, taps: Sequence[int], answers: Sequence, directory, max_length: int = 512,
                 on_shard: Callable[[int, int], None] = lambda done, total: None, rows: int = SHARD_ROWS) -> dict:
    """Shards of ``rows`` answers for every whole group of answers not yet covered; returns the index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = read_index(directory)
    if index["shards"] and index.get("taps") != list(taps):
        raise ValueError(f"{directory} holds features of taps {index.get('taps')}, not {list(taps)}: use another directory")
    index["taps"] = list(taps)
    # shards hold similar lengths: sort each window of answers by length (less padding)
    for begin in range(index["answers"], len(answers) - rows + 1, rows):
        window = sorted(answers[begin : begin + rows], key=lambda a: len(a.prompt) + len(a.answer))
        arrays = build_shard(adapter, spec, params, tuple(taps), window, max_length)
        name = f"shard-{len(index['shards']):05d}.npz"
        np.savez(directory / name, **arrays)
        index["shards"].append({"file": name, "rows": len(window), "tokens": int(arrays["loss_mask"].sum())})
        index["answers"] = begin + rows
        (directory / INDEX).write_text(json.dumps(index, indent=1))
        on_shard(index["answers"], len(answers))
    return index


def load_shard(directory, entry: dict) -> Corpus:
    arrays = np.load(Path(directory) / entry["file"])
    return Corpus(*(mx.array(arrays[name]) for name in Corpus._fields))


def shard_stream(directory, index: dict, rng: np.random.Generator) -> Iterator[Corpus]:
    """Shards in a fresh random order each epoch, one in memory at a time."""
    while True:
        for position in rng.permutation(len(index["shards"])):
            yield load_shard(directory, index["shards"][position])
