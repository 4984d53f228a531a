"""The gemma4 target adapter against mlx-lm's own ``gemma4_text`` model on the same weights."""

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.checkpoints import load_target
from dspark_fn.targets import resolve_target
from numerics import assert_fp32_close
from helpers import (
    TargetRunner,
    build_draft,
    build_target,
    draft_config,
    mlx_lm_greedy,
    random_prompt,
    speculative_tokens,
)

pytestmark = pytest.mark.numerics  # rerun on the bundled BLAS by .ci/run

NEW_TOKENS = 200
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma4_config(window=512, kv_shared=0, per_layer_input=0, k_eq_v=True, tied=True, vocab=256):
    return {
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "hidden_size": 64,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": LAYER_TYPES,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": k_eq_v,
        "sliding_window": window,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
        },
        "num_kv_shared_layers": kv_shared,
        "use_double_wide_mlp": bool(kv_shared),
        "hidden_size_per_layer_input": per_layer_input,
        "enable_moe_block": False,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
    }


CONFIGS = {
    # K=V full layers, window longer than every sequence here
    "k_eq_v": gemma4_config(),
    # sliding layers see only the last 8 positions of 40+
    "window8": gemma4_config(window=8),
    # the small models' extras: per-layer inputs, KV sharing (double-wide MLPs), untied head
    "shared_kv_per_layer_input": gemma4_config(
        window=8, kv_shared=2, per_layer_input=8, k_eq_v=False, tied=False
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def target(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config = CONFIGS[request.param]
    # Unit gain: scaled-up random gemma4 weights decode into one repeated token.
    model = build_target(directory, config, seed=1, gain=1.0, vector_spread=0.4)
    adapter, spec, params, _ = load_target(directory)
    return config, directory, model, adapter, spec, params


def reference_logits(model, tokens: list, cache=None) -> np.ndarray:
    return np.array(model(mx.array([tokens]), cache=cache)[0])


def close(actual, expected, what):
    """Within the fp32 budget of the target (tests/numerics.py): its layers,
    sums as long as the double-wide MLP."""
    assert_fp32_close(actual, expected, what, layers=len(LAYER_TYPES), reduction=4 * 64)


def test_prefill_and_decode_match_mlx_lm_cache(target):
    """Prompt longer than the sliding window, then single-token steps, both
    against mlx-lm with the cache it builds for this model (rotating for
    sliding layers)."""
    config, _, model, adapter, spec, params = target
    rng = np.random.default_rng(0)
    prompt = random_prompt(rng, 44, config["vocab_size"])
    cache = model.make_cache()
    ours = TargetRunner(adapter, spec, params)
    close(ours(prompt, 0), reference_logits(model, prompt, cache), "prefill logits")
    sequence = list(prompt)
    for step in range(6):
        token = int(rng.integers(0, config["vocab_size"]))
        close(ours([token], len(sequence)), reference_logits(model, [token], cache), f"decode step {step}")
        sequence.append(token)


def test_rollback_matches_uncached_forward(target):
    """Verify a block, keep only a prefix of it by position, continue: logits
    equal mlx-lm's uncached forward over the committed tokens (a rotating
    cache past its window cannot be trimmed, so the reference recomputes)."""
    config, _, model, adapter, spec, params = target
    rng = np.random.default_rng(1)
    vocab = config["vocab_size"]
    committed = random_prompt(rng, 41, vocab)
    ours = TargetRunner(adapter, spec, params)
    ours(committed, 0)
    for kept in (2, 0, 5):
        block = random_prompt(rng, 5, vocab)
        expected = reference_logits(model, committed + block)[-len(block):]
        close(ours(block, len(committed)), expected, f"verify after keeping {kept}")
        committed += block[:kept]  # the rejected rows stay in the buffers, masked


def test_window_changes_the_result(target):
    """Guard against a vacuous window test: with window 8 the sliding layers
    really drop keys, so the full-causal logits differ."""
    config, _, model, adapter, spec, params = target
    if config["sliding_window"] >= 64:
        pytest.skip("window longer than the sequence")
    prompt = random_prompt(np.random.default_rng(2), 44, config["vocab_size"])
    windowed = TargetRunner(adapter, spec, params)(prompt, 0)
    unwindowed_spec = adapter.spec_from_config(dict(config, sliding_window=4096))
    unwindowed = TargetRunner(adapter, unwindowed_spec, params)(prompt, 0)
    assert np.abs(windowed[-1] - unwindowed[-1]).max() > 1e-2


def test_greedy_speculation_is_lossless(target, tmp_path):
    """``dspark_fn.generate`` with a random gemma4 draft emits mlx-lm's own greedy stream."""
    config, directory, model, *_ = target
    draft = draft_config(config, taps=(1, 3), block_size=5, model_type="gemma4_text")
    draft.update(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    build_draft(tmp_path / "draft", draft, seed=3)
    params = dspark_fn.load(directory, tmp_path / "draft")
    prompt = random_prompt(np.random.default_rng(3), 13, config["vocab_size"])
    expected = mlx_lm_greedy(model, prompt, NEW_TOKENS)
    assert len(set(expected)) > 20, "degenerate reference stream"
    assert speculative_tokens(params, prompt, NEW_TOKENS) == expected


def test_scaled_proportional_rope_matches_mlx_lm(tmp_path):
    """A ``factor`` in the full layers' proportional RoPE divides their frequencies."""
    config = gemma4_config()
    rope = config["rope_parameters"]
    config["rope_parameters"] = dict(rope, full_attention=dict(rope["full_attention"], factor=8.0))
    model = build_target(tmp_path, config, seed=2, gain=1.0)
    adapter, spec, params, _ = load_target(tmp_path)
    prompt = random_prompt(np.random.default_rng(4), 30, config["vocab_size"])
    close(TargetRunner(adapter, spec, params)(prompt, 0), reference_logits(model, prompt), "logits")


@pytest.mark.parametrize(
    "override, message",
    [
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}, "MoE"),
        ({"use_bidirectional_attention": "all"}, "bidirectional"),
        ({"num_kv_shared_layers": 5}, "share from"),
    ],
)
def test_unsupported_target_configs_are_rejected(override, message):
    config = dict(CONFIGS["k_eq_v"], **override)
    with pytest.raises(ValueError, match=message):
        resolve_target(config).spec_from_config(config)
