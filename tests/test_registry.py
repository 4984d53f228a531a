"""A new draft backbone is one module and one registry line: this test defines
a toy architecture here, registers it, and runs the whole pipeline with it."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import ops
from dspark_fn.cache import positions_from, prefix_mask, write_rows
from dspark_fn.drafts import ARCH_REGISTRY, DraftArch, register_arch
from dspark_fn.drafts.base import DSparkFields, dspark_fields
from dspark_fn.drafts.heads import frame_shapes, head_shapes
from dspark_fn.checkpoints import save_draft
from dspark_fn.drafts.fresh import random_draft_weights
from helpers import build_target, draft_config, mlx_lm_greedy, random_prompt, target_config


@dataclass(frozen=True)
class MeanSpec(DSparkFields):
    """No extra fields: the toy block reads the mean of its visible context."""


def spec_from_config(config):
    return MeanSpec(**dspark_fields(config))


def checkpoint_shapes(spec):
    return frame_shapes(spec) | head_shapes(spec) | {"mix.weight": (spec.hidden_size, spec.hidden_size)}


def init_context(spec, batch, capacity):
    return mx.zeros((batch, 1, capacity, spec.hidden_size))


def extend_context(spec, params, state, features, start):
    rows = ops.rms_norm(ops.linear(params["fc"], features), params["hidden_norm"]["weight"], 1e-6)
    return write_rows(state, rows[:, None], start)


def block_forward(spec, params, state, length, block_ids):
    visible = prefix_mask(length, state.shape[2])[:, 0, 0, :, None]  # [B, C, 1]
    context = (state[:, 0] * visible).sum(axis=1) / mx.maximum(length, 1)[:, None]
    slot = positions_from(mx.zeros_like(length), block_ids.shape[1])[..., None] / block_ids.shape[1]
    h = ops.embed(params["embed_tokens"], block_ids, spec.hidden_size) + context[:, None] * (1 + slot)
    hidden = ops.rms_norm(ops.linear(params["mix"], h), params["norm"]["weight"], 1e-6)
    return ops.linear(params["lm_head"], hidden), hidden


TOY = DraftArch(spec_from_config=spec_from_config, checkpoint_shapes=checkpoint_shapes, init_context=init_context,
                extend_context=extend_context, block_forward=block_forward)


@pytest.fixture()
def toy_registered():
    register_arch("toy_mean_draft", TOY)  # the one registry line
    yield TOY
    del ARCH_REGISTRY["toy_mean_draft"]


def test_toy_architecture_runs_end_to_end_lossless(toy_registered, tmp_path):
    config = target_config("qwen3", vocab=192, hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16)
    model = build_target(tmp_path / "target", config, seed=9)
    toy_config = draft_config(config, taps=(0, 2), block_size=4, model_type="toy_mean_draft")
    spec = toy_registered.spec_from_config(toy_config)
    weights = random_draft_weights(toy_registered, spec, seed=9)
    save_draft(tmp_path / "draft", toy_config, {k: v for k, v in weights.items() if k != "lm_head.weight"})
    params = dspark_fn.load(tmp_path / "target", tmp_path / "draft")
    assert params.spec.draft_arch is toy_registered
    prompt = random_prompt(np.random.default_rng(9), 11, 192)
    events = list(dspark_fn.generate(params, prompt, 120, width=None))
    assert [t for e in events for t in e.emitted] == mlx_lm_greedy(model, prompt, 120)
    assert all(len(e.drafted) == 4 for e in events if e.kind == "round")


def test_unregistered_model_type_names_the_registered_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown draft model_type 'toy_mean_draft'.*qwen3"):
        dspark_fn.resolve_arch({"model_type": "toy_mean_draft"})
