"""The LFM2 target adapter (lfm2, lfm2_moe, and lfm2-vl's text model) against
mlx-lm's own models on the same random weights: a prompt prefilled in padded
chunks then decoded token by token (logits and tapped layers), rollback of
the conv windows to every kept count of a verify block, and refused configs.

Breaks tried (each restored after), and the tests that caught them
("prefill/decode" and "rollback" are the first two tests; both families unless named):
- conv kernel shifted by one row (every tap reads the next input, the last
  one past the end): prefill/decode, rollback, lfm2-vl;
- settled conv window one row late (it keeps the inputs after ``kept + 1``
  tokens): rollback;
- B gate dropped (ungated inputs into the conv): prefill/decode, rollback, lfm2-vl;
- C gate dropped (conv output not gated): prefill/decode, rollback, lfm2-vl;
- state not settled (the windows keep every token of the block): rollback;
- padding advancing the windows (``prompt_forward`` keeping the whole
  chunk): prefill/decode (its first decode step);
- ``q_layernorm``, ``k_layernorm``, ``ffn_norm`` or the final
  ``embedding_norm`` weight ignored (each alone): prefill/decode, rollback;
- conv bias dropped: lfm2 prefill/decode, rollback;
- expert bias ignored in the choice, routed scaling or top-k normalisation
  dropped (each alone): lfm2_moe prefill/decode, rollback;
- a release loaded through mlx-lm's own lfm2-vl wrapper instead of its
  declared text weights (``Release.text_weights``): lfm2-vl[published]
  ("Received 59 parameters not in model").
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import make_prompt_cache

from dspark_fn.checkpoints import load_target
from dspark_fn.targets import resolve_target
from helpers import TargetRunner, build_target, random_prompt
from hybrids import HYBRID_SHAPES
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

FAMILIES = ("lfm2", "lfm2_moe")
CHUNK = 8


def randomise_zero_vectors(directory, model, seed: int):
    """Give the 1-D parameters mlx-lm initialises to zero (conv biases, the
    expert bias) random values, so code that ignores them fails; save again."""
    rng = np.random.default_rng(seed)

    def filled(w):
        if w.ndim == 1 and not bool(mx.any(w != 0)):
            return mx.array(rng.normal(0, 0.5, w.shape).astype(np.float32))
        return w

    model.update(tree_map(filled, model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def target(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config = HYBRID_SHAPES[request.param]
    # non-unit norm weights: code that ignores one of them fails
    model = build_target(directory, config, seed=3, gain=1.5, vector_spread=0.4)
    model = randomise_zero_vectors(directory, model, seed=3)
    adapter, spec, params, _ = load_target(directory)
    return config, model, adapter, spec, params


def close(actual, expected, what, config):
    assert_fp32_close(actual, expected, what, layers=config["num_hidden_layers"], reduction=128)


def mlx_lm_with_taps(model, tokens: list, cache, taps: tuple):
    """mlx-lm's logits ``[L, V]`` and the residual stream after each tapped layer,
    running its layers by hand as ``Lfm2Model.__call__`` does."""
    inner = model.model
    h = inner.embed_tokens(mx.array([tokens]))
    attn_mask = create_attention_mask(h, cache[inner.fa_idx])
    conv_mask = create_ssm_mask(h, cache[inner.conv_idx])
    tapped = {}
    for index, (layer, c) in enumerate(zip(inner.layers, cache)):
        h = layer(h, attn_mask if layer.is_attention_layer else conv_mask, cache=c)
        if index in taps:
            tapped[index] = h[0]
    logits = inner.embed_tokens.as_linear(inner.embedding_norm(h))[0]
    return np.array(logits), np.concatenate([np.array(tapped[i]) for i in taps], axis=-1)


def test_chunked_prefill_then_decode_match_mlx_lm(target):
    """The 13-token prompt in chunks of 8 (the last padded with zeros past its
    end) through ``prompt_forward``, then 5 decode steps through ``forward`` +
    ``settle``: logits and taps equal mlx-lm's over its prompt cache."""
    config, model, adapter, spec, params = target
    taps = (0, 2, spec.num_layers - 1)
    rng = np.random.default_rng(0)
    prompt = random_prompt(rng, 13, config["vocab_size"])
    cache = make_prompt_cache(model)
    expected_logits, expected_taps = mlx_lm_with_taps(model, prompt, cache, taps)

    kv = adapter.init_kv(spec, 1, 64)
    end = mx.array([len(prompt)])
    logits, features = [], []
    for begin in range(0, len(prompt), CHUNK):
        chunk = prompt[begin : begin + CHUNK]
        padded = mx.array([chunk + [0] * (CHUNK - len(chunk))])
        hidden, tapped, kv = adapter.prompt_forward(
            spec, params, kv, padded, mx.array([begin]), taps, mx.array([0]), end
        )
        logits.append(np.array(adapter.logits(spec, params, hidden)[0, : len(chunk)]))
        features.append(np.array(tapped[0, : len(chunk)]))
    close(np.concatenate(logits), expected_logits, "prefill logits", config)
    close(np.concatenate(features), expected_taps, "prefill taps", config)

    ours = TargetRunner(adapter, spec, params, capacity=64, taps=taps)
    ours.kv = kv
    for step in range(5):
        position = len(prompt) + step
        token = int(rng.integers(0, config["vocab_size"]))
        expected_logits, expected_taps = mlx_lm_with_taps(model, [token], cache, taps)
        close(ours([token], position), expected_logits, f"decode step {step} logits", config)
        close(ours.features[0], expected_taps, f"decode step {step} taps", config)


def test_rollback_to_every_kept_count_matches_an_uncached_forward(target):
    """Verify a 6-token block, keep ``kept`` of it (conv windows settle on
    them), verify the next: each block's logits equal mlx-lm's uncached
    forward over everything committed plus that block."""
    config, model, adapter, spec, params = target
    rng = np.random.default_rng(1)
    committed = random_prompt(rng, 20, config["vocab_size"])
    ours = TargetRunner(adapter, spec, params)
    ours(committed, 0)
    for kept in range(6):
        block = random_prompt(rng, 6, config["vocab_size"])
        expected = np.array(model(mx.array([committed + block]))[0])[-len(block):]
        close(ours(block, len(committed), kept=kept), expected, f"block before keeping {kept}", config)
        committed += block[:kept]
    block = random_prompt(rng, 6, config["vocab_size"])
    expected = np.array(model(mx.array([committed + block]))[0])[-len(block):]
    close(ours(block, len(committed)), expected, "block after keeping 5", config)


def published_layout(weights: dict) -> dict:
    """mlx-lm's ``lfm2-vl`` tree as the transformers release names and shapes
    it: the text model and the towers under ``model.``, conv kernels ``[D, 1, K]``."""
    published = {}
    for key, value in weights.items():
        if "conv.conv.weight" in key:
            value = value.transpose(0, 2, 1)
        published["model." + key.replace("language_model.model.", "language_model.")] = value
    return published


@pytest.mark.parametrize("layout", ["converted", "published"])
def test_multimodal_release_runs_its_text_model(tmp_path, layout):
    """An ``lfm2-vl`` release (vision tower and projector beside the text
    model) loads as an lfm2 target over its text model's weights, in the
    layout mlx-vlm converts to (``language_model.model.*``) and in the
    published one (``model.language_model.*``, which mlx-lm's own lfm2-vl
    loader cannot read)."""
    from mlx_lm.utils import _get_classes

    text = HYBRID_SHAPES["lfm2"]
    config = {"model_type": "lfm2-vl", "architectures": ["Lfm2VlForConditionalGeneration"], "text_config": dict(text)}
    model_class, args_class = _get_classes(config)
    mx.random.seed(4)
    model = model_class(args_class.from_dict(json.loads(json.dumps(config))))
    weights = dict(tree_flatten(model.parameters()))
    weights["vision_tower.encoder.weight"] = mx.zeros((4, 4))
    weights["multi_modal_projector.linear_1.weight"] = mx.zeros((4, 4))
    if layout == "published":
        weights = published_layout(weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    adapter, spec, params, loaded = load_target(tmp_path)
    assert loaded["model_type"] == "lfm2" and spec.attention_layers == (1, 3)
    prompt = random_prompt(np.random.default_rng(2), 9, text["vocab_size"])
    close(TargetRunner(adapter, spec, params)(prompt, 0), np.array(model(mx.array([prompt]))[0]), "logits", text)


def changed(family: str, **changes) -> dict:
    config = {**HYBRID_SHAPES[family], **changes}
    return {key: value for key, value in config.items() if value is not None}


@pytest.mark.parametrize(
    "config, problem",
    [
        (changed("lfm2", full_attn_idxs=None), "names no attention layers"),
        (changed("lfm2", full_attn_idxs=[1, 5]), r"full_attn_idxs \[5\] outside the 5 layers"),
        (changed("lfm2", full_attn_idxs=[]), "no full-attention layer"),
        (changed("lfm2_moe", layer_types=["conv", "sliding_attention", "conv", "full_attention"]),
         r"unknown \['sliding_attention'\]"),
        (changed("lfm2_moe", layer_types=["conv", "full_attention"]), "got 2 entries"),
        (changed("lfm2", num_attention_heads=5), "heads do not divide"),
        (changed("lfm2", num_key_value_heads=3), "heads do not divide"),
        (changed("lfm2", conv_L_cache=None), "lacks conv_L_cache"),
        (changed("lfm2", rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
        (changed("lfm2_moe", num_experts_per_tok=9), "num_experts_per_tok 9"),
        (changed("lfm2_moe", num_dense_layers=None), "lacks num_dense_layers"),
    ],
)
def test_unsupported_configs_are_refused(config, problem):
    adapter = resolve_target(config)
    with pytest.raises(ValueError, match=problem):
        adapter.spec_from_config(config)
