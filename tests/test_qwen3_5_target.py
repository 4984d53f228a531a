"""The Qwen3.5 / Qwen3-Next target adapter (gated delta nets beside gated
attention) against mlx-lm's own models on the same random weights.

- chunked prefill then decode: a 13-token prompt through ``prompt_forward``
  in chunks of 8 (the last padded past the prompt's end), then 5 single-token
  steps through ``forward`` + ``settle``: logits and taps (the residual stream
  after layers 0, 2 and the last) against mlx-lm run with its prompt cache;
  for the dense and MoE Qwen3.5 shapes, a multimodal release directory
  (``text_config``, HF key names, vision weights beside them) and Qwen3-Next
  (fused projections, dense and MoE layers mixed);
- rollback: after 20 committed tokens, verify 6-token blocks keeping 0, 1,
  .., 6 of them in turn; every block's logits equal mlx-lm's uncached forward
  over the committed tokens and the block (dense and MoE);
- configs this adapter cannot run are refused with a ValueError naming why.

Breaks tried (each restored), and the test that caught it:
- the convolution's taps reversed, or rolled by one: prefill/decode;
- the convolution dropped (projection straight into silu): prefill/decode;
- the state decay skipped (``g = 1``): prefill/decode and rollback;
- the delta rule's ``beta`` dropped: prefill/decode;
- the state not settled (kept after every token of a block), or only the
  convolution window not settled: rollback;
- padding advancing the state (``keep`` = the whole chunk): prefill/decode;
- the gated norm's weight ignored: prefill/decode;
- q without its ``Dk**-0.5`` readout scale: prefill/decode;
- value heads spread over key heads interleaved (``mx.tile`` for
  ``mx.repeat``): prefill/decode;
- the attention's output gate dropped, or the whole head rotated: prefill/decode;
- the MoE routing weights' renormalisation inverted, the shared expert's
  gate dropped: prefill/decode (qwen3_5_moe);
- Qwen3-Next's fused ``b`` and ``a`` swapped: prefill/decode (qwen3_next).
"""

from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import make_prompt_cache

from dspark_fn.cache import settle
from dspark_fn.checkpoints import load_target, mlx_lm_model
from dspark_fn.targets import qwen3_5
from helpers import TargetRunner, build_target, random_prompt
from hybrids import HYBRID_SHAPES
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

CAPACITY = 64
PROMPT, CHUNK, DECODE = 13, 8, 5

# fused projections; layers 1 and 3 attend; only layer 1 has a MoE block (top
# 2 of 4, weights not renormalised): decoder_sparse_step 2 skips layers 0 and
# 2, mlp_only_layers skips layer 3
QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
    "intermediate_size": 128, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "decoder_sparse_step": 2, "mlp_only_layers": [3], "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}


def release_config(text: dict) -> dict:
    """A Qwen3.5 multimodal release's config around ``text``."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": dict(text, model_type="qwen3_5_text"),
        "vision_config": {"model_type": "qwen3_5", "hidden_size": 32, "depth": 1},
        "image_token_id": 250, "tie_word_embeddings": False,
    }


def release_key(key: str) -> str:
    """An mlx-lm key of the text model as a release names it."""
    return key.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")


def write_release_layout(directory) -> None:
    """Rewrite a built checkpoint under the release's key names, with vision weights beside it."""
    path = str(directory / "model.safetensors")
    weights = {release_key(key): value for key, value in mx.load(path).items()}
    weights["model.visual.patch_embed.proj.weight"] = mx.ones((32, 3, 2, 16, 16))
    mx.save_safetensors(path, weights)


CONFIGS = {
    "qwen3_5": HYBRID_SHAPES["qwen3_5"],
    "qwen3_5_moe": HYBRID_SHAPES["qwen3_5_moe"],
    "qwen3_5_release": release_config(HYBRID_SHAPES["qwen3_5"]),
    "qwen3_next": QWEN3_NEXT,
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def target(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config = CONFIGS[request.param]
    # non-unit norm weights, decay rates and biases: code ignoring one of them fails
    model = build_target(directory, config, seed=7, gain=2.0, vector_spread=0.4)
    if request.param == "qwen3_5_release":
        write_release_layout(directory)
    adapter, spec, params, text = load_target(directory)
    return text, model, adapter, spec, params


def close(actual, expected, what, config):
    assert_fp32_close(actual, expected, what, layers=config["num_hidden_layers"], reduction=2 * CAPACITY)


def mlx_lm_layer_outputs(model, tokens: mx.array, cache: list, taps: tuple) -> mx.array:
    """The residual stream after the tapped layers, running mlx-lm's layers as its model does."""
    inner = getattr(model, "language_model", model).model
    h = inner.embed_tokens(tokens)
    attention_mask = create_attention_mask(h, cache[inner.fa_idx])
    delta_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    outputs = []
    for layer, entry in zip(inner.layers, cache):
        h = layer(h, mask=delta_mask if layer.is_linear else attention_mask, cache=entry)
        outputs.append(h)
    return mx.concatenate([outputs[i] for i in taps], axis=-1)


def test_chunked_prefill_and_decode_match_mlx_lm(target):
    text, model, adapter, spec, params = target
    taps = (0, 2, spec.num_layers - 1)
    rng = np.random.default_rng(0)
    prompt = random_prompt(rng, PROMPT, spec.vocab_size)
    steps = [int(t) for t in rng.integers(0, spec.vocab_size, size=DECODE)]

    logits_cache, taps_cache = make_prompt_cache(model), make_prompt_cache(model)
    expected = []  # (logits, taps) of the prompt, then of each decode step
    for tokens in [prompt] + [[token] for token in steps]:
        x = mx.array([tokens])
        expected.append((model(x, cache=logits_cache)[0], mlx_lm_layer_outputs(model, x, taps_cache, taps)[0]))

    chunk_forward = mx.compile(partial(adapter.prompt_forward, spec, taps=taps))
    kv = adapter.init_kv(spec, 1, CAPACITY)
    logits, features = [], []
    for start in range(0, PROMPT, CHUNK):
        chunk = prompt[start : start + CHUNK]
        padded = mx.array([chunk + [0] * (CHUNK - len(chunk))])
        hidden, tapped, kv = chunk_forward(
            params, kv, padded, mx.array([start]), first=mx.array([0]), end=mx.array([PROMPT])
        )
        logits.append(adapter.logits(spec, params, hidden)[0, : len(chunk)])
        features.append(tapped[0, : len(chunk)])
    close(mx.concatenate(logits), expected[0][0], "prefill logits", text)
    close(mx.concatenate(features), expected[0][1], "prefill taps", text)

    for step, token in enumerate(steps):
        hidden, tapped, kv = adapter.forward(spec, params, kv, mx.array([[token]]), mx.array([PROMPT + step]), taps)
        kv = settle(kv, mx.array([1]))
        close(adapter.logits(spec, params, hidden)[0], expected[step + 1][0], f"decode step {step} logits", text)
        close(tapped[0], expected[step + 1][1], f"decode step {step} taps", text)


@pytest.mark.parametrize("target", ["qwen3_5", "qwen3_5_moe"], indirect=True)
def test_rollback_matches_an_uncached_forward(target):
    """Verify a block, keep ``kept`` of its tokens (the delta nets settle on
    the state after them), verify the next block."""
    text, model, adapter, spec, params = target
    rng = np.random.default_rng(1)
    committed = random_prompt(rng, 20, spec.vocab_size)
    ours = TargetRunner(adapter, spec, params, capacity=CAPACITY)
    ours(committed, 0)
    before = "the committed prompt"
    for kept in range(7):
        block = random_prompt(rng, 6, spec.vocab_size)
        expected = model(mx.array([committed + block]))[0, -len(block) :]
        close(ours(block, len(committed), kept=kept), expected, f"block after {before}", text)
        committed += block[:kept]
        before = f"keeping {kept} of a block"


@pytest.mark.parametrize("target", ["qwen3_5_release"], indirect=True)
def test_a_release_loads_as_its_text_model(target):
    text, model, adapter, spec, params = target
    assert adapter is qwen3_5.ADAPTER
    assert text["model_type"] == "qwen3_5_text" and "text_config" not in text
    assert sorted(params) == ["lm_head", "model"]
    # mlx-lm has no qwen3_5_text module: its own model of the text config (what
    # --quant-target and the side-by-side baselines build) comes from the release's
    tokens = mx.array([[3, 1, 4, 1, 5]])
    assert mx.array_equal(mlx_lm_model(text, params)(tokens), model(tokens))


def bad(**changes) -> dict:
    return {**HYBRID_SHAPES["qwen3_5"], **changes}


@pytest.mark.parametrize(
    "config, problem",
    [
        (bad(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple"),
        (bad(num_key_value_heads=3), "num_attention_heads 4 is not a multiple"),
        (bad(full_attention_interval=0), "full_attention_interval 0"),
        (bad(full_attention_interval=7), "no full-attention layer"),
        (bad(layer_types=["linear_attention"] * 5 + ["full_attention"]), "layer_types disagree"),
        (bad(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope type 'yarn'"),
        ({**HYBRID_SHAPES["qwen3_5_moe"], "num_experts_per_tok": 5}, "num_experts_per_tok 5 outside 1..4"),
        ({k: v for k, v in QWEN3_NEXT.items() if k != "mlp_only_layers"}, "qwen3_next config lacks mlp_only_layers"),
    ],
)
def test_bad_configs_are_refused(config, problem):
    with pytest.raises(ValueError, match=problem):
        qwen3_5.ADAPTER.spec_from_config(config)
