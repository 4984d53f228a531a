"""A target split over the ranks of an ``mx.distributed`` group (tensor
parallel), as a transform of its parameter tree.

Each rank keeps a share of every large matrix: a column-parallel linear
(query/key/value, gate/up) keeps its rank's output rows, whole heads each; a
row-parallel one (attention output, down) keeps its rank's input columns
and is marked ``PARTIAL_SUM``, so ``ops.linear`` sums its outputs over the
ranks; the embedding and output head keep a stretch of vocabulary rows,
marked ``VOCAB_SHARD``, so ``ops.embed`` sums the owners' rows and
``ops.linear`` gathers the logits. The residual stream, norms and
everything after the logits are whole on every rank, so every rank takes
the same decisions from the same numbers: the round, the draft and the
accept rule are unchanged. A family's ``shard_tensor`` says which of its
modules is which (``targets/llama.py``).
"""

import mlx.core as mx

from .ops import PARTIAL_SUM, VOCAB_SHARD

MARKER = mx.zeros((0,))  # the value of a marker key (only its presence is read)


class Ranks:
    """``rank`` of ``size``: which share of a split dimension this process keeps."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def share(self, length: int, what: str, unit: int = 1) -> slice:
        """This rank's stretch of a dimension of ``length`` split in whole ``unit``s (heads, groups)."""
        if length % (self.size * unit):
            raise ValueError(
                f"{length // unit} {what} do not split over {self.size} ranks: "
                f"use --pipeline, or a number of ranks that divides them"
            )
        step = length // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


def output_rows(p: dict, ranks: Ranks, what: str, unit: int = 1) -> dict:
    """A column-parallel linear: this rank's output rows (and their scales, biases, bias)."""
    rows = ranks.share(p["weight"].shape[0], what, unit)
    return {key: value[rows] for key, value in p.items()}


def input_columns(p: dict, ranks: Ranks, what: str) -> dict:
    """A row-parallel linear: this rank's input columns, its output summed over the ranks.
    A quantized weight splits by whole quantization groups."""
    shared = {"bias": p["bias"]} if "bias" in p else {}
    if "scales" in p:
        groups = ranks.share(p["scales"].shape[-1], f"{what} (quantization groups)")
        per_group = p["weight"].shape[-1] // p["scales"].shape[-1]
        packed = slice(groups.start * per_group, groups.stop * per_group)
        split = {"weight": p["weight"][:, packed], "scales": p["scales"][:, groups]}
        if "biases" in p:
            split["biases"] = p["biases"][:, groups]
    else:
        split = {"weight": p["weight"][:, ranks.share(p["weight"].shape[-1], what)]}
    return split | shared | {PARTIAL_SUM: MARKER}


def vocabulary_rows(p: dict, ranks: Ranks) -> dict:
    """An embedding or output head: this rank's stretch of vocabulary rows."""
    if "bias" in p:
        raise ValueError("an output head with a bias cannot be split by vocabulary rows")
    rows = ranks.share(p["weight"].shape[0], "vocabulary rows")
    return {key: value[rows] for key, value in p.items()} | {VOCAB_SHARD: mx.array(rows.start, mx.int32)}


def agree(values, group=None):
    """Rank 0's ``values`` (an array) on every rank: host decisions drawn from
    timings (the cost curve) must be the same everywhere, or the ranks would
    run different kernels and wait on each other for ever."""
    group = group or mx.distributed.init()
    values = mx.array(values)
    return mx.distributed.all_sum(values if group.rank() == 0 else mx.zeros_like(values), group=group)


def resident_bytes(tree) -> int:
    """Bytes of the arrays in ``tree`` (each array once)."""
    from mlx.utils import tree_flatten

    seen = {id(value): value for _, value in tree_flatten(tree)}
    return sum(value.nbytes for value in seen.values())
