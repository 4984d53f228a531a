"""A DSpark draft's configuration and first weights, for a given target."""

from typing import Sequence

import numpy as np

from ..checkpoints import SHARED_WITH_TARGET, draft_params_from_weights
from ..drafts import FRESH_ARCH
from ..drafts.fresh import random_draft_weights
from ..drafts.heads import DRAFT_VOCAB_KEY
from ..targets import resolve_target


def spread_taps(num_target_layers: int, count: int) -> list:
    """DeepSpec/DFlash default taps: from layer 1 to layer N-3, evenly spread."""
    if count == 1:
        return [1]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def draft_config_for(
    target_config: dict,
    layers: int = 1,
    taps: Sequence[int] | None = None,
    block_size: int = 5,
    markov_rank: int = 32,
    mask_token_id: int | None = None,
    draft_vocab: int = 0,
) -> dict:
    """A DeepSpec draft config for ``target_config``: the architecture fresh
    drafts are built in (``FRESH_ARCH``), in the target's geometry as its
    adapter reads it, plus the DSpark keys."""
    geometry = resolve_target(target_config).draft_geometry(target_config)
    depth = geometry["num_hidden_layers"]
    config = FRESH_ARCH.fresh_config(geometry, layers)
    config.update(
        num_target_layers=depth,
        target_layer_ids=list(taps) if taps else spread_taps(depth, 3),
        block_size=block_size,
        mask_token_id=geometry["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=markov_rank > 0,
    )
    if draft_vocab:
        config["draft_vocab_size"] = draft_vocab
    return config


def initial_draft(arch, spec, target_spec, target_params: dict, seed: int = 0, vocab_ids=None) -> dict:
    """Fresh draft parameters around the target's own embedding and output
    head; with ``vocab_ids`` the draft proposes from those target ids only."""
    weights = random_draft_weights(arch, spec, seed=seed)
    weights = {key: value for key, value in weights.items() if key not in SHARED_WITH_TARGET}
    if spec.draft_vocab_size:
        import mlx.core as mx

        weights[DRAFT_VOCAB_KEY] = mx.array(np.asarray(vocab_ids, np.int32))
    return draft_params_from_weights(arch, spec, weights, target_params, target_spec)
