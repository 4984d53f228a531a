"""A new hybrid family is its target module, one registry line and one table
entry: this test adds one (IBM's GraniteMoeHybrid, dense, as mlx-lm builds
it: Mamba-2 mixers beside attention, scaled embeddings, residuals, attention
and logits) and runs it through code that never names it.

In the package, everything between the two rules below would be
``dspark_fn/targets/granitemoehybrid.py`` (its Mamba-2 math is
``layers/mamba2.py``'s), the fixture's ``TARGET_REGISTRY.add`` an entry in
``targets.FAMILIES``, and ``SHAPES``'s entry one in ``hybrids.HYBRID_SHAPES``.
Nothing else changes: loading (mlx-lm's tree), ``--quant-target``, the
pipeline split, the shared embedding and head, a fresh draft's config and
the round read what the adapter declares.

Breaks tried, each caught by every greedy test, the rollback test and the
quantized one: the residual multiplier left off the MLP; the attention
scaled by ``head_dim ** -0.5`` instead of ``attention_multiplier``; the
layout naming the head ``output`` (the logits then come from the embedding);
prompt chunks run without ``keep`` (the Mamba-2 states left pending).
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import ops
from dspark_fn.cache import causal_mask, kv_buffers, positions_from, write_rows
from dspark_fn.checkpoints import mlx_lm_model, pair_with_draft
from dspark_fn.distill.config import draft_config_for
from dspark_fn.distributed import check_split, pipeline_share
from dspark_fn.interfaces import Layout, TargetAdapter
from dspark_fn.layers import mamba2
from dspark_fn.quantize import quantize_target
from dspark_fn.sharding import Ranks
from dspark_fn.targets import TARGET_REGISTRY, resolve_target
from dspark_fn.targets.base import decoder_layers, stopping_at_prompt_end
from helpers import build_draft, build_target, drive_proposals, mlx_lm_greedy, random_prompt, speculative_tokens

pytestmark = pytest.mark.numerics

# ---------------------------------------------------------------- the target module

LAYOUT = Layout()  # mlx-lm's tree: model.layers, model.embed_tokens, lm_head unless tied


@dataclass(frozen=True)
class GraniteSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    attends: tuple  # per layer: attention (else a Mamba-2 mixer)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    embedding_multiplier: float
    attention_multiplier: float  # the attention's scale
    residual_multiplier: float  # on both branches of every layer
    logits_scaling: float  # the logits are divided by it
    mamba: mamba2.Mamba2Spec


def spec_from_config(config: dict) -> GraniteSpec:
    """The target spec, read with mlx-lm's defaults; MoE layers and Mamba
    groups (a per-group gated norm) are refused."""
    from mlx_lm.models.granitemoehybrid import ModelArgs

    args = ModelArgs.from_dict(config)
    if args.use_moe or args.mamba_n_groups != 1:
        raise ValueError("granitemoehybrid: only dense layers and one Mamba group here")
    return GraniteSpec(
        model_type=config["model_type"], vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        num_layers=args.num_hidden_layers, attends=tuple(kind == "attention" for kind in args.layer_types),
        num_heads=args.num_attention_heads, num_kv_heads=args.num_key_value_heads,
        head_dim=args.hidden_size // args.num_attention_heads, eps=args.rms_norm_eps, rope_theta=args.rope_theta,
        embedding_multiplier=args.embedding_multiplier, attention_multiplier=args.attention_multiplier,
        residual_multiplier=args.residual_multiplier, logits_scaling=args.logits_scaling,
        mamba=mamba2.Mamba2Spec(num_heads=args.mamba_n_heads, head_dim=args.mamba_d_head,
                                state_size=args.mamba_d_state, num_groups=1, conv_kernel=args.mamba_d_conv,
                                eps=args.rms_norm_eps, time_step_limit=tuple(args.time_step_limit)),
    )


def init_kv(spec: GraniteSpec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per layer: K/V buffers ``[B, H_kv, C, D]`` or a Mamba-2 state."""
    return [kv_buffers(batch, spec.num_kv_heads, capacity, spec.head_dim, dtype) if attends
            else mamba2.init_state(spec.mamba, batch, dtype) for attends in spec.attends]


def attention(spec: GraniteSpec, p: dict, x, keys, values, start, positions, mask, inv_freq):
    q = ops.apply_rope(ops.split_heads(ops.linear(p["q_proj"], x), spec.num_heads), positions, inv_freq)
    k = ops.apply_rope(ops.split_heads(ops.linear(p["k_proj"], x), spec.num_kv_heads), positions, inv_freq)
    keys = write_rows(keys, k, start)
    values = write_rows(values, ops.split_heads(ops.linear(p["v_proj"], x), spec.num_kv_heads), start)
    out = ops.attention(q, keys, values, mask, spec.attention_multiplier)
    return ops.linear(p["o_proj"], ops.merge_heads(out)), (keys, values)


def forward(spec: GraniteSpec, params: dict, kv: list, tokens, start, taps: tuple, keep=None):
    """``(final-normed hidden, taps, kv)``; Mamba-2 states pending, or committed after ``keep[b]`` tokens."""
    model = params["model"]
    positions = positions_from(start, tokens.shape[1])
    mask = causal_mask(positions, kv[spec.attends.index(True)][0].shape[2])
    inv_freq = ops.rope_inv_freq(spec.head_dim, {"rope_theta": spec.rope_theta})
    h = ops.embed(model["embed_tokens"], tokens, spec.hidden_size) * spec.embedding_multiplier

    def step(index, layer, entry, h):
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        if spec.attends[index]:
            mixed, entry = attention(spec, layer["self_attn"], x, *entry, start, positions, mask, inv_freq)
        else:
            mixed, entry = mamba2.mixer(spec.mamba, layer["mamba"], x, entry, keep)
        h = h + mixed * spec.residual_multiplier
        x = ops.rms_norm(h, layer["post_attention_layernorm"]["weight"], spec.eps)
        return h + ops.glu_mlp(layer["mlp"], x, "silu") * spec.residual_multiplier, entry

    h, features, new_kv = decoder_layers(h, model["layers"], kv, step, taps)
    return ops.rms_norm(h, model["norm"]["weight"], spec.eps), features, new_kv


def logits(spec: GraniteSpec, params: dict, hidden: mx.array) -> mx.array:
    return LAYOUT.logits(spec, params, hidden) / spec.logits_scaling


ADAPTER = TargetAdapter(model_types=("granitemoehybrid",), layout=LAYOUT, spec_from_config=spec_from_config,
                        init_kv=init_kv, forward=forward, logits=logits,
                        prompt_forward=stopping_at_prompt_end(forward))

# ---------------------------------------------------------------- the test-table entry

# layers 1 and 3 attend, the others are Mamba-2 mixers (8 heads, one group); a time_step_limit that binds
SHAPES = {
    "granitemoehybrid": {
        "model_type": "granitemoehybrid", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 5, "layer_types": ["mamba", "attention", "mamba", "attention", "mamba"],
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "embedding_multiplier": 2.0, "attention_multiplier": 0.3, "residual_multiplier": 0.8, "logits_scaling": 1.5,
        "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
        "mamba_proj_bias": False, "mamba_conv_bias": True, "time_step_limit": [0.05, 1.5],
    },
}

# ----------------------------------------------------------------

NEW_TOKENS = 120


@pytest.fixture(scope="module")
def registered():
    TARGET_REGISTRY.add(ADAPTER)  # the one registry line
    yield ADAPTER
    for model_type in ADAPTER.model_types:
        del TARGET_REGISTRY[model_type]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, registered, tmp_path_factory):
    """The family's target as mlx-lm writes it, with a fresh draft configured
    for it as ``dspark train`` configures one."""
    root = tmp_path_factory.mktemp(request.param)
    config = SHAPES[request.param]
    model = build_target(root / "target", config, seed=3, vector_spread=0.4)
    build_draft(root / "draft", draft_config_for(config, layers=1, taps=(0, 3), block_size=5), seed=1)
    params = dspark_fn.load(root / "target", root / "draft")
    assert params.spec.target_adapter is registered
    return model, params, config, root


def test_the_target_does_not_repeat_itself(pair):
    model, _, config, _ = pair
    stream = mlx_lm_greedy(model, random_prompt(np.random.default_rng(0), 13, config["vocab_size"]), NEW_TOKENS)
    assert len(set(stream)) >= 20


@pytest.mark.parametrize("prompt_length, width", [(13, None), (300, None), (40, "auto")])
def test_generate_equals_target_greedy(pair, prompt_length, width):
    """300 tokens prefill in a 256-token chunk, then a padded 64-token one."""
    model, params, config, _ = pair
    prompt = random_prompt(np.random.default_rng(prompt_length), prompt_length, config["vocab_size"])
    assert speculative_tokens(params, prompt, NEW_TOKENS, width=width) == mlx_lm_greedy(model, prompt, NEW_TOKENS)


def test_verify_keeps_exactly_the_right_prefix(pair):
    """Every accepted count 0..W, rows accepting unevenly: the Mamba-2 states roll back."""
    model, params, config, _ = pair
    rng = np.random.default_rng(12)
    prompts = [random_prompt(rng, n, config["vocab_size"]) for n in (5, 17)]
    drive_proposals(model, params, config["vocab_size"], prompts, "partly-right", 60, shift=2)


def test_a_quantized_target_decodes_as_mlx_lm(pair):
    """``--quant-target 8``: mlx-lm's own conversion of the family's tree,
    the draft sharing its quantized embedding and head, decoded as mlx-lm decodes it."""
    _, params, config, root = pair
    quantized, quantized_config = quantize_target(config, params.target, 8)
    prompt = random_prompt(np.random.default_rng(7), 21, config["vocab_size"])
    reference = mlx_lm_greedy(mlx_lm_model(quantized_config, quantized), prompt, 60)
    assert speculative_tokens(pair_with_draft(quantized_config, quantized, root / "draft"), prompt, 60) == reference


def test_a_pipeline_split_takes_whole_layers_and_vocabulary_rows(pair):
    """The split is read from the adapter's layout: each rank keeps its stretch of layers and half the vocabulary."""
    _, params, config, _ = pair
    check_split(config, 2, pipeline=True)
    with pytest.raises(ValueError, match="granitemoehybrid targets have no tensor-parallel split: use --pipeline"):
        check_split(config, 2)
    for rank, stage in enumerate(([0, 1], [2, 3, 4])):
        share = pipeline_share(resolve_target(config), params.spec.target, params.target, Ranks(rank, 2))
        assert [index for index, layer in enumerate(LAYOUT.layers(share)) if layer] == stage
        assert LAYOUT.embedding_module(share)["weight"].shape[0] == config["vocab_size"] // 2
