"""A reduced draft vocabulary: the draft proposes from the target's most frequent tokens.

The draft's output head and Markov output rows are cut to the subset, which
makes the draft's largest matrix several times smaller; drafted indices map
back to target ids through ``draft_vocab_ids``. The target still verifies
over its whole vocabulary, so greedy output stays token-identical and
rejection sampling stays exact: the draft simply puts no mass outside the
subset, and the residual distribution covers the rest.
"""

from collections import Counter
from typing import Iterable

import mlx.core as mx
import numpy as np

from .heads import DRAFT_VOCAB_KEY


def restrict_vocabulary(params: dict, ids: mx.array, markov_rows: bool = True) -> dict:
    """The draft with its output head (dense or quantized rows) and, with
    ``markov_rows``, its Markov output rows cut to the target ids ``ids``."""
    restricted = dict(params, lm_head={name: value[ids] for name, value in params["lm_head"].items()})
    if markov_rows and "markov_head" in params:
        markov = params["markov_head"]
        restricted["markov_head"] = dict(markov, markov_w2={"weight": markov["markov_w2"]["weight"][ids]})
    return restricted


def widen_vocabulary(params: dict, ids: np.ndarray, head: dict) -> dict:
    """A reduced-vocabulary draft proposing from ``ids``, a superset of its own
    vocabulary: the output head is ``head`` (the target's, which the draft
    shares) cut to ``ids``, and each token keeps its trained Markov output row
    while the new tokens start at zero (no Markov bias until trained), so the
    widened draft scores its old tokens exactly as before."""
    own = np.array(params[DRAFT_VOCAB_KEY])
    ids = np.asarray(ids, np.int32)
    check_vocabulary(ids, head["weight"].shape[0])
    if len(np.setdiff1d(own, ids)):
        raise ValueError(f"a widened vocabulary must keep the draft's own {len(own)} tokens")
    if not mx.array_equal(params["lm_head"]["weight"], head["weight"][mx.array(own)]):
        raise ValueError("this draft has an output head of its own, with no rows for new tokens: it cannot be widened")
    widened = restrict_vocabulary(dict(params, lm_head=head), mx.array(ids), markov_rows=False)
    widened[DRAFT_VOCAB_KEY] = mx.array(ids)
    if "markov_head" in params:
        rows = np.array(params["markov_head"]["markov_w2"]["weight"])
        markov = np.zeros((len(ids), rows.shape[1]), rows.dtype)
        order = np.argsort(ids)
        markov[order[np.searchsorted(ids[order], own)]] = rows  # each own token's row at its place in ids
        widened["markov_head"] = dict(params["markov_head"], markov_w2={"weight": mx.array(markov)})
    return widened


def check_vocabulary(ids: np.ndarray, vocab_size: int) -> None:
    """Refuse a draft vocabulary that is empty, repeats an id or leaves ``0..vocab_size - 1``."""
    if ids.ndim != 1 or not len(ids):
        raise ValueError(f"{DRAFT_VOCAB_KEY} must be a non-empty list of token ids")
    if ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids):
        raise ValueError(f"{DRAFT_VOCAB_KEY} must hold distinct token ids in 0..{vocab_size - 1}")


def frequent_tokens(sequences: Iterable[Iterable[int]], size: int, vocab_size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent ids of ``sequences`` (ties by id), plus
    ``always`` (e.g. stop tokens), sorted: a draft vocabulary."""
    counts = Counter(token for sequence in sequences for token in sequence)
    chosen = set(always)
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= size:
            break
        chosen.add(token)
    for token in range(vocab_size):  # fewer distinct tokens than asked: fill with the lowest ids
        if len(chosen) >= size:
            break
        chosen.add(token)
    ids = np.array(sorted(chosen), np.int32)
    check_vocabulary(ids, vocab_size)
    return ids


def reduced_checkpoint(config: dict, weights: dict, ids: np.ndarray) -> tuple[dict, dict]:
    """A full-vocabulary draft checkpoint turned into one that proposes from ``ids``."""
    check_vocabulary(ids, config["vocab_size"])
    if config.get("draft_vocab_size"):
        raise ValueError("this draft already has a reduced vocabulary")
    weights = dict(weights)
    ids_array = mx.array(ids)
    for key in list(weights):
        if key.endswith("markov_head.markov_w2.weight"):
            weights[key] = weights[key][ids_array]
            prefix = key[: -len("markov_head.markov_w2.weight")]
            weights[prefix + DRAFT_VOCAB_KEY] = ids_array
    if not any(key.endswith(DRAFT_VOCAB_KEY) for key in weights):
        weights[DRAFT_VOCAB_KEY] = ids_array
    return {**config, "draft_vocab_size": len(ids)}, weights
