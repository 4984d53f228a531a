"""Speculation over an ``mx.distributed`` group (``mlx.launch -n N ...``).

Every rank runs the same program: it loads the pair, keeps its share of the
target (``sharding.py``: tensor parallel) and the whole draft, and runs the
same host loop. The ranks reach the same decisions because they see the
same numbers: the logits each round are whole on every rank, the seeds are
the same, and the one host input drawn from a clock, the cost curve of the
draft gate, is rank 0's on every rank (``sharding.agree``). Rank 0 alone
prints and serves.
"""

from dataclasses import replace

import mlx.core as mx

from .checkpoints import SHARED_WITH_TARGET
from .sharding import Ranks, resident_bytes
from .targets import resolve_target, target_module
from .types import Params


def world():
    """The group this process belongs to (one rank of one when not launched by ``mlx.launch``)."""
    return mx.distributed.init()


def check_split(config: dict, size: int) -> None:
    """Refuse, from the target's config alone, a tensor-parallel split over ``size`` ranks that cannot work."""
    adapter = resolve_target(config)
    if adapter.tensor_splits is None:
        raise ValueError(f"{config['model_type']} targets have no tensor-parallel split: run them on one rank")
    ranks = Ranks(0, size)
    for what, count in adapter.tensor_splits(config).items():
        ranks.share(count, what)


def shard_pair(params: Params, ranks: Ranks) -> Params:
    """The pair with this rank's share of the target; the draft stays whole and
    reads the target's shared embedding and head through their shards."""
    spec = params.spec
    target_spec, target = spec.target_adapter.shard_tensor(spec.target, params.target, ranks)
    shared = {
        id(target_module(params.target, key)["weight"]): target_module(target, key) for key in SHARED_WITH_TARGET
    }
    draft = {
        name: shared.get(id(module.get("weight")), module) if isinstance(module, dict) else module
        for name, module in params.draft.items()
    }
    return Params(replace(spec, target=target_spec), target, draft)


def load_sharded(group, model=None, draft=None, quant_target=None, dtype=None) -> tuple:
    """``load_named`` for this rank of ``group``: the split is checked from the
    config before any weight is read, the checkpoint read lazily, and only
    this rank's share of each target tensor kept (evaluated one at a time,
    so no more than one whole tensor is in memory beside the shares)."""
    from mlx.utils import tree_flatten

    from .models import load_named, target_config_named

    check_split(target_config_named(model), group.size())
    params, tokenizer, config = load_named(model, draft, quant_target, dtype, lazy=True)
    params = shard_pair(params, Ranks(group.rank(), group.size()))
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
