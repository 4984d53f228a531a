"""Quantized targets (MLX affine, as ``mlx_lm.convert -q`` writes them): greedy
DSpark output equals mlx-lm's greedy decoding of the very same quantized model.
``--quant-target`` also runs on hybrid targets (recurrent layers beside attention).

Breaks tried, and the tests that catch them:
- ``quantize_target`` quantizing every module whatever its width (plain
  ``nn.quantize``): test_quant_target_matches_mlx_lm_convert[lfm2-* / qwen3_5-* / qwen3_5_moe-*]
  (lfm2's 96-wide w2 and qwen3_5's 32-wide delta-net out_proj cannot be grouped by 64);
- ``quantize_target`` returning mlx-lm's multimodal wrapper tree (no unwrap of
  ``language_model``): test_quant_target_matches_mlx_lm_convert[qwen3_5-* / qwen3_5_moe-*];
- the model's ``quant_predicate`` ignored (MoE routers at the default bits,
  not 8): test_quant_target_matches_mlx_lm_convert[qwen3_5_moe-4 / qwen3_5_moe-8].
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn.checkpoints import load_target, pair_with_draft
from dspark_fn.quantize import quantize_target
from helpers import build_draft, build_target, draft_config, mlx_lm_greedy, random_prompt, speculative_tokens, target_config
from hybrids import HYBRID_SHAPES, hybrid_draft_config
from test_gemma4_target import gemma4_config

pytestmark = pytest.mark.numerics

FAMILIES = {
    "llama": target_config("llama", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, tied=False),
    "qwen3": target_config("qwen3", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16),
    "gemma4": gemma4_config(window=8, tied=True, vocab=256),
}
HYBRIDS = {name: HYBRID_SHAPES[name] for name in ("lfm2", "qwen3_5", "qwen3_5_moe")}  # the last: 8-bit routers
# (group size, bits) per module kind; None keeps it in float, as mixed conversions do
LAYOUTS = {
    "4-bit g64": dict(default=(64, 4)),
    "8-bit g32": dict(default=(32, 8)),
    "quantized embedding, float head": dict(default=(64, 4), lm_head=None),
    "float embedding, 4-bit g128 body": dict(default=(128, 4), embed_tokens=None),
}


def layout_predicate(layout: dict):
    def predicate(path: str, module) -> dict | bool:
        if not hasattr(module, "to_quantized"):
            return False
        kind = path.rsplit(".", 1)[-1]
        choice = layout.get(kind, layout["default"])
        if choice is None or module.weight.shape[-1] % choice[0]:
            return False
        return {"group_size": choice[0], "bits": choice[1]}

    return predicate


def write_quantized(directory, config: dict, model, layout: dict) -> None:
    """What ``mlx_lm.convert -q`` leaves on disk: packed weights, scales and
    biases, and a ``quantization`` entry (per-module entries for the rest)."""
    nn.quantize(model, class_predicate=layout_predicate(layout))
    group, bits = layout["default"]
    quantization = {"group_size": group, "bits": bits}
    for path, module in model.named_modules():
        if hasattr(module, "group_size") and (module.group_size, module.bits) != (group, bits):
            quantization[path] = {"group_size": module.group_size, "bits": module.bits}
    (directory / "config.json").write_text(json.dumps({**config, "quantization": quantization}))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))


def family_draft(name: str, config: dict) -> dict:
    if name in HYBRIDS:
        last = config["num_hidden_layers"] - 1
        return hybrid_draft_config(config, layers=1, taps=(0, last - 1), block_size=4)
    if name == "gemma4":
        draft = draft_config(config, layers=1, taps=(1, 3), block_size=4, model_type="gemma4_text")
        return draft | dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    return draft_config(config, layers=1, taps=(0, 2), block_size=4)


def gain(name: str) -> float:
    return 1.0 if name == "gemma4" else 2.5  # unit gain: scaled-up gemma4 weights decode one repeated token


def with_draft(name: str, configs: dict, tmp_path_factory):
    root = tmp_path_factory.mktemp(name)
    build_draft(root / "draft", family_draft(name, configs[name]), seed=2)
    return name, root / "draft", configs[name]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return with_draft(request.param, FAMILIES, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(FAMILIES | HYBRIDS))
def any_family(request, tmp_path_factory):
    """The attention families and the hybrids."""
    return with_draft(request.param, FAMILIES | HYBRIDS, tmp_path_factory)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quantized_target_greedy_equals_mlx_lm(family, layout, tmp_path):
    """Every round, prefill and the draft's shared embedding/head read the
    quantized arrays as stored; a batch of two rows decodes too."""
    from mlx_lm.utils import load_model

    name, draft_dir, config = family
    model = build_target(tmp_path, config, seed=2, gain=gain(name))
    write_quantized(tmp_path, config, model, LAYOUTS[layout])
    reference, _ = load_model(tmp_path)
    params = dspark_fn.load(tmp_path, draft_dir)
    assert "scales" in params.target["model"]["layers"][0]["mlp"]["down_proj"]
    head_kind = "embed_tokens" if config["tie_word_embeddings"] else "lm_head"
    head_layout = LAYOUTS[layout].get(head_kind, LAYOUTS[layout]["default"])
    head_quantized = head_layout is not None and config["hidden_size"] % head_layout[0] == 0
    assert ("scales" in params.draft["lm_head"]) == head_quantized
    prompts = [random_prompt(np.random.default_rng(seed), 5 + 9 * seed, config["vocab_size"]) for seed in range(2)]
    expected = [mlx_lm_greedy(reference, prompt, 60) for prompt in prompts]
    for width in ("auto", None):
        assert [speculative_tokens(params, prompt, 60, width=width) for prompt in prompts] == expected
    rows = [[] for _ in prompts]
    for event in dspark_fn.generate(params, prompts, 60, width=None):
        rows[event.tag] += event.emitted
    assert rows == expected


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_target_matches_mlx_lm_convert(any_family, bits, tmp_path):
    """``--quant-target`` turns a float target into exactly what
    ``mlx_lm.convert -q`` makes of it (modules too narrow for a group stay in
    float), and greedy DSpark decoding of it, two rows of different lengths
    in one batch, is mlx-lm's greedy decoding of that quantized model."""
    from mlx_lm.utils import quantize_model

    name, draft_dir, config = any_family
    model = build_target(tmp_path, config, seed=3, gain=gain(name), vector_spread=0.4)
    _, _, target_params, loaded_config = load_target(tmp_path)
    params, quantized_config = quantize_target(loaded_config, target_params, bits)
    _, converted_config = quantize_model(model, config, 64, bits)
    ours = dict(tree_flatten(params))
    theirs = dict(tree_flatten(getattr(model, "language_model", model).parameters()))  # a wrapper's text model
    assert set(ours) == set(theirs)
    assert all(mx.array_equal(ours[k], theirs[k]) for k in theirs)
    assert quantized_config["quantization"] == converted_config["quantization"]
    with pytest.raises(ValueError, match="already quantized"):
        quantize_target(quantized_config, params, 8)

    pair = pair_with_draft(quantized_config, params, draft_dir)
    prompts = [random_prompt(np.random.default_rng(seed), 5 + 9 * seed, config["vocab_size"]) for seed in range(2)]
    rows = [[] for _ in prompts]
    for event in dspark_fn.generate(pair, prompts, 40, width=None):
        rows[event.tag] += event.emitted
    assert rows == [mlx_lm_greedy(model, prompt, 40) for prompt in prompts]
