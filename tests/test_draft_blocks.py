"""Several draft blocks side by side in one row (training: every anchor of a
sequence sharing its context, ``length [B, N]``) compute what one block a
row computes at inference, for every draft family and attention option.

Breaks tried, and what caught them:
- the context visible up to the row's first block's start for every block
  (``length[:, :1]`` in ``cache.block_slots``): every family;
- the block part of the mask left all ones (a slot sees the other blocks):
  every family;
- the extra mask slot of ``sample_from_anchor: false`` appended once per row
  instead of once per block: dflash-everything.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

from dspark_fn.checkpoints import draft_params_from_weights
from dspark_fn.drafts import resolve_arch
from dspark_fn.drafts.fresh import random_draft_weights
from helpers import draft_config, target_config
from numerics import assert_fp32_close
from test_deepseek_v4 import DSPARK, TEXT
from test_dflash_draft import CASES, draft_layout

pytestmark = pytest.mark.numerics

CONTEXT = 40  # longer than every window below (dflash 5-7, DeepSeek-V4 24)
ANCHORS = [[3, 17, 30, 31], [9, 10, 26, 38]]


def gemma4_draft(parity_dir):
    return json.loads((parity_dir / "gemma4_tiny" / "draft" / "config.json").read_text())


DRAFTS = {
    "qwen3": lambda _: draft_config(target_config(), block_size=5),
    "dflash-causal-sliding": lambda _: draft_layout(**CASES["causal-sliding"]),
    "dflash-everything": lambda _: draft_layout(**CASES["everything"]),
    "gemma4": gemma4_draft,
    "deepseek_v4": lambda _: {**TEXT, **DSPARK},
}


@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_blocks_side_by_side_equal_one_block_a_row(name, parity_dir):
    config = DRAFTS[name](parity_dir)
    arch = resolve_arch(config)
    spec = arch.spec_from_config(config)
    weights = random_draft_weights(arch, spec, seed=1, gain=2.0)
    params = draft_params_from_weights(arch, spec, weights, {}, None)
    rng = np.random.default_rng(0)
    width = len(spec.target_layer_ids) * spec.hidden_size
    features = mx.array(rng.normal(size=(2, CONTEXT, width)).astype(np.float32))
    state = arch.extend_context(spec, params, arch.init_context(spec, 2, CONTEXT), features, mx.zeros((2,), mx.int32))
    anchors = mx.array(ANCHORS, mx.int32)
    count, size = anchors.shape[1], spec.block_size
    block_ids = mx.array(rng.integers(0, spec.vocab_size, size=(2, count, size)), mx.int32)
    base, hidden = arch.block_forward(spec, params, state, anchors, block_ids.reshape(2, count * size))
    depth = getattr(spec, "num_layers", None) or spec.num_stages  # draft layers (DeepSeek-V4: stages)
    budget = dict(layers=depth, reduction=max(CONTEXT + count * size, 4 * spec.hidden_size))
    for n in range(count):
        alone_base, alone_hidden = arch.block_forward(spec, params, state, anchors[:, n], block_ids[:, n])
        slots = slice(n * size, (n + 1) * size)
        assert_fp32_close(base[:, slots], alone_base, f"{name}: block {n} base logits", **budget)
        assert_fp32_close(hidden[:, slots], alone_hidden, f"{name}: block {n} hidden", **budget)
