"""Speculation over an ``mx.distributed`` group (``mlx.launch -n N ...``).

Every rank runs the same program: it loads the pair, keeps its share of the
target and the whole draft, and runs the same host loop. The share is a
tensor-parallel one (``sharding.py``: every layer split by heads and
columns) or, with ``pipeline``, a stretch of whole layers
(``targets.base.pipeline_stages``: each rank runs its layers and hands the
hidden state on, ``decoder_layers``), any family and any head count; either
way the embedding and output head are split by vocabulary rows. The ranks reach the same decisions because they see the
same numbers: the logits each round are whole on every rank, the seeds are
the same, and the one host input drawn from a clock, the cost curve of the
draft gate, is rank 0's on every rank (``sharding.agree``). Rank 0 alone
prints and serves.
"""

from dataclasses import replace

import mlx.core as mx

from .checkpoints import shared_modules
from .interfaces import TargetAdapter
from .sharding import Ranks, resident_bytes, vocabulary_rows
from .targets import resolve_target
from .targets.base import pipeline_stages
from .types import Params


def world():
    """The group this process belongs to (one rank of one when not launched by ``mlx.launch``)."""
    return mx.distributed.init()


def check_split(config: dict, size: int, pipeline: bool = False) -> None:
    """Refuse, from the target's config alone, a split over ``size`` ranks that cannot work."""
    adapter = resolve_target(config)
    if pipeline:
        pipeline_stages(config["num_hidden_layers"], size)
        return
    if adapter.tensor_splits is None:
        raise ValueError(f"{config['model_type']} targets have no tensor-parallel split: use --pipeline")
    ranks = Ranks(0, size)
    for what, count in adapter.tensor_splits(config).items():
        ranks.share(count, what)


def pipeline_share(adapter: TargetAdapter, spec, target: dict, ranks: Ranks) -> dict:
    """This rank's stretch of whole layers (``{}`` for the others') and vocabulary rows."""
    layout = adapter.layout
    layers = layout.layers(target)
    stage = pipeline_stages(len(layers), ranks.size)[ranks.rank]
    split = [(layer, read) for layer, read in adapter.pipeline_links(spec) if (layer in stage) != (read in stage)]
    if split:
        raise ValueError(f"layer {split[0][0]} reads the cache of layer {split[0][1]}, which another rank runs: "
                         f"use a number of ranks that keeps them together")
    shared = shared_modules(layout, target)
    vocabulary = layout.embedding_module(target)["weight"].shape[0]
    split_rows = {
        id(module): vocabulary_rows(module, ranks) if vocabulary % ranks.size == 0 else module
        for module in shared.values()
    }

    def kept(tree):
        if isinstance(tree, dict) and id(tree) in split_rows:
            return split_rows[id(tree)]
        return {key: kept(value) for key, value in tree.items()} if isinstance(tree, dict) else tree

    return layout.with_layers(kept(target), [layer if index in stage else {} for index, layer in enumerate(layers)])


def shard_pair(params: Params, ranks: Ranks, pipeline: bool = False) -> Params:
    """The pair with this rank's share of the target (tensor parallel, or
    pipeline); the draft stays whole and reads the target's shared
    embedding and head through their shards."""
    spec, layout = params.spec, params.spec.target_adapter.layout
    if pipeline:
        target_spec, target = spec.target, pipeline_share(spec.target_adapter, spec.target, params.target, ranks)
    else:
        target_spec, target = spec.target_adapter.shard_tensor(spec.target, params.target, ranks)
    whole, split = shared_modules(layout, params.target), shared_modules(layout, target)
    shared = {id(whole[key]["weight"]): split[key] for key in whole}
    draft = {
        name: shared.get(id(module.get("weight")), module) if isinstance(module, dict) else module
        for name, module in params.draft.items()
    }
    return Params(replace(spec, target=target_spec), target, draft)


def load_sharded(group, model=None, draft=None, quant_target=None, dtype=None, pipeline: bool = False) -> tuple:
    """``load_named`` for this rank of ``group``: the split is checked from the
    config before any weight is read, the checkpoint read lazily, and only
    this rank's share of each target tensor kept (evaluated one at a time,
    so no more than one whole tensor is in memory beside the shares)."""
    from mlx.utils import tree_flatten

    from .catalog import load_named, target_config_named

    check_split(target_config_named(model), group.size(), pipeline)
    params, tokenizer, config = load_named(model, draft, quant_target, dtype, lazy=True)
    params = shard_pair(params, Ranks(group.rank(), group.size()), pipeline)
    for _, value in tree_flatten((params.target, params.draft)):
        mx.eval(value)
    return params, tokenizer, config


def share(payload: bytes, group) -> bytes:
    """Rank 0's ``payload`` on every rank (the others pass anything): its length, then its bytes, each an all_sum."""
    import numpy as np

    from .sharding import agree

    length = int(agree([len(payload)], group).item())
    data = np.zeros(length, np.uint8)
    if group.rank() == 0:
        data[:] = np.frombuffer(payload, np.uint8)
    return bytes(np.array(mx.distributed.all_sum(mx.array(data), group=group)))


def rank_report(params: Params, group) -> list[dict]:
    """``[{"rank", "target_bytes"}]`` for every rank: the target weights each one holds."""
    mine = mx.zeros((group.size(),), mx.int64).at[group.rank()].add(resident_bytes(params.target))
    totals = mx.distributed.all_sum(mine, group=group).tolist()
    return [{"rank": rank, "target_bytes": int(count)} for rank, count in enumerate(totals)]
