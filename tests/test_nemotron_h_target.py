"""The Nemotron-H target adapter (Mamba-2, attention, MLP and MoE blocks)
against mlx-lm's own model on the same random weights: chunked prefill then
decode (logits and tapped residual streams), rollback of the recurrent
state to every kept count, and refused configs.

Breaks tried, and the tests that catch them:
- caught by test_chunked_prefill_then_decode_match_mlx_lm and
  test_rollback_to_every_kept_count_matches_an_uncached_forward, on both
  shapes (dense and MoE): the conv window shifted by one (previous inputs
  misaligned), the conv bias dropped, the D skip dropped, dt not clipped
  to ``time_step_limit``, softplus dropped, ``dt_bias`` dropped, heads
  reading B/C of the wrong group (``tile`` for ``repeat``), the gated
  norm's weight ignored, the gated norm over the whole width (not per
  group), the gate not applied, a block norm's weight ignored, the final
  norm's weight ignored, ReLU for ReLU² in the MLP, attention not seeing
  the K/V of earlier calls;
- prompt padding entering the SSM state (``keep`` ignored by the scan):
  test_chunked_prefill_then_decode_match_mlx_lm[dense, moe];
- the SSM state not rolled back (pending history holding the final state):
  test_rollback_to_every_kept_count_matches_an_uncached_forward[dense, moe];
- caught by the same two tests on the MoE shape only: the router bias
  weighting the experts, expert groups not restricted to the top
  ``topk_group``, top-k weights not normalised, ``routed_scaling_factor``
  dropped, the output latent projection skipped, the shared expert dropped.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import make_prompt_cache

from dspark_fn.cache import settle
from dspark_fn.checkpoints import load_target
from dspark_fn.targets import resolve_target
from helpers import TargetRunner, build_target, random_prompt
from hybrids import HYBRID_SHAPES
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

CAPACITY = 64
CHUNK = 8
# MoE blocks: 8 experts in 4 groups (top 2 groups, then top 2 experts), latent
# projections around them, a shared expert; biases on every projection
MOE_SHAPE = dict(
    HYBRID_SHAPES["nemotron_h"],
    hybrid_override_pattern="ME*-E*", mamba_proj_bias=True, attention_bias=True, mlp_bias=True,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scaling_factor=2.0, moe_intermediate_size=32, moe_latent_size=32, n_shared_experts=1,
    moe_shared_expert_intermediate_size=48,
)
SHAPES = {"dense": HYBRID_SHAPES["nemotron_h"], "moe": MOE_SHAPE}


def randomise_zero_initialised(directory, model, seed: int) -> None:
    """mlx-lm starts convolution biases, router weights and router biases at
    zero (every expert tied): give them random values, so that code ignoring
    one of them fails, and save again."""
    mx.random.seed(seed)
    for layer in model.layers:
        if layer.block_type == "M" and "bias" in layer.mixer.conv1d:
            layer.mixer.conv1d.bias = mx.random.uniform(-0.5, 0.5, layer.mixer.conv1d.bias.shape)
        if layer.block_type == "E":
            gate = layer.mixer.gate
            gate.weight = mx.random.normal(gate.weight.shape)
            gate.e_score_correction_bias = mx.random.uniform(-0.3, 0.3, gate.e_score_correction_bias.shape)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))


@pytest.fixture(scope="module", params=sorted(SHAPES))
def target(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config = SHAPES[request.param]
    model = build_target(directory, config, seed=3, gain=2.5, vector_spread=0.4)
    randomise_zero_initialised(directory, model, seed=4)
    adapter, spec, params, _ = load_target(directory)
    return config, model, adapter, spec, params


def close(actual, expected, what, config):
    assert_fp32_close(actual, expected, what, layers=len(config["hybrid_override_pattern"]), reduction=128)


def mlx_lm_run(model, tokens: list, cache=None):
    """mlx-lm's backbone loop by hand: ``(logits [L, V], residual stream after each block [L, d])``."""
    backbone = model.backbone
    h = backbone.embeddings(mx.array([tokens]))
    attention_mask = create_attention_mask(h, cache[backbone.fa_idx] if cache else None)
    ssm_mask = create_ssm_mask(h, cache[backbone.ssm_idx] if cache else None)
    layer_caches = iter(cache or [])
    residuals = []
    for layer in backbone.layers:
        stateful = layer.block_type in ("M", "*")
        mask = attention_mask if layer.block_type == "*" else ssm_mask
        h = layer(h, mask=mask, cache=next(layer_caches) if cache and stateful else None)
        residuals.append(h[0])
    return model.lm_head(backbone.norm_f(h))[0], residuals


def tapped(residuals: list, taps: tuple) -> np.ndarray:
    return np.concatenate([np.array(residuals[i]) for i in taps], axis=-1)


def test_chunked_prefill_then_decode_match_mlx_lm(target):
    """Three prompts (13, 10, 6 tokens) prefilled together in chunks of 8, the
    last padded with zeros (the 6-token prompt's whole second chunk is
    padding), then 5 decode steps, each row against mlx-lm alone."""
    config, model, adapter, spec, params = target
    rng = np.random.default_rng(0)
    vocab, taps = config["vocab_size"], (0, 2, spec.num_layers - 1)
    prompts = [random_prompt(rng, n, vocab) for n in (13, 10, 6)]
    ends = [len(p) for p in prompts]
    caches = [make_prompt_cache(model) for _ in prompts]
    expected = [mlx_lm_run(model, p, c) for p, c in zip(prompts, caches)]
    whole, _ = mlx_lm_run(model, prompts[0])
    assert np.array_equal(np.array(whole), np.array(model(mx.array(prompts[:1]))[0])), "the hand-run loop is mlx-lm's"

    kv = adapter.init_kv(spec, len(prompts), CAPACITY)
    padded = np.zeros((len(prompts), 2 * CHUNK), np.int32)
    for b, prompt in enumerate(prompts):
        padded[b, : len(prompt)] = prompt
    for first in range(0, 2 * CHUNK, CHUNK):
        hidden, features, kv = adapter.prompt_forward(
            spec, params, kv, mx.array(padded[:, first : first + CHUNK]), mx.array([first] * len(prompts)), taps,
            mx.zeros((len(prompts),), mx.int32), mx.array(ends),
        )
        logits = adapter.logits(spec, params, hidden)
        for b, (want_logits, want_residuals) in enumerate(expected):
            rows = min(CHUNK, ends[b] - first)
            if rows > 0:
                span = slice(first, first + rows)
                close(logits[b, :rows], want_logits[span], f"row {b} prefill logits from {first}", config)
                taps_expected = tapped(want_residuals, taps)[span]
                close(features[b, :rows], taps_expected, f"row {b} prefill taps from {first}", config)

    lengths = list(ends)
    for step in range(5):
        tokens = rng.integers(0, vocab, size=len(prompts))
        hidden, features, kv = adapter.forward(
            spec, params, kv, mx.array(tokens[:, None]), mx.array(lengths), taps
        )
        kv = settle(kv, mx.ones((len(prompts),), mx.int32))
        logits = adapter.logits(spec, params, hidden)
        for b, cache in enumerate(caches):
            want_logits, want_residuals = mlx_lm_run(model, [int(tokens[b])], cache)
            close(logits[b], want_logits, f"row {b} decode step {step} logits", config)
            close(features[b], tapped(want_residuals, taps), f"row {b} decode step {step} taps", config)
        lengths = [n + 1 for n in lengths]


def test_rollback_to_every_kept_count_matches_an_uncached_forward(target):
    """Commit 20 tokens; verify 6-token blocks keeping 0..5 of each; the
    next block sees exactly the kept tokens."""
    config, model, adapter, spec, params = target
    rng = np.random.default_rng(1)
    vocab = config["vocab_size"]
    committed = random_prompt(rng, 20, vocab)
    ours = TargetRunner(adapter, spec, params, capacity=CAPACITY)
    ours(committed, 0)
    for kept in [*range(6), None]:
        block = random_prompt(rng, 6, vocab)
        expected = np.array(model(mx.array([committed + block]))[0])[-len(block) :]
        close(ours(block, len(committed), kept=kept), expected, f"block before keeping {kept}", config)
        committed += block[:kept]


BAD_CONFIGS = {
    "an unknown block type": ({"hybrid_override_pattern": "M*X-"}, "X"),
    "no layer stack": ({"hybrid_override_pattern": None}, "hybrid_override_pattern"),
    "heads not in groups": ({"mamba_num_heads": 6, "n_groups": 4}, "n_groups=4"),
    "attention heads not in KV groups": ({"num_attention_heads": 3}, "num_key_value_heads=2"),
    "MoE blocks without experts": ({"n_routed_experts": None}, "n_routed_experts"),
    "more router groups kept than exist": ({"topk_group": 5}, "topk_group=5"),
}


@pytest.mark.parametrize("problem", sorted(BAD_CONFIGS))
def test_unsupported_configs_are_refused(problem):
    changes, named = BAD_CONFIGS[problem]
    config = dict(MOE_SHAPE, **changes)
    with pytest.raises(ValueError, match=named):
        resolve_target(config).spec_from_config(config)
