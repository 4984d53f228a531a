"""A DeepSeek-V4-DSpark checkpoint in the released on-disk format: one
directory holding target and ``mtp.*`` draft, official tensor names, FP8
(``F8_E4M3`` bytes, one ``F8_E8M0`` scale per 128 x 128 block) projections,
FP4 (``I8``, two e2m1 a byte, an ``F8_E8M0`` scale per 32 values) routed
experts, a legacy ``num_nextn_predict_layers`` of 1 beside three stages.

The reference is a float twin of the same checkpoint whose values are decoded
here with numpy from the FP8/FP4 bit layouts, independently of MLX: the
quantized pair, kept quantized, must compute what the twin computes.
"""

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn.drafts import deepseek_v4 as draft_v4
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

NOISE = 150
CONFIG = dict(
    model_type="deepseek_v4",
    vocab_size=160,
    hidden_size=128,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    q_lora_rank=128,
    o_lora_rank=128,
    o_groups=2,
    head_dim=128,
    qk_rope_head_dim=16,
    compress_ratios=[0, 4, 128, 0],
    index_n_heads=2,
    index_head_dim=64,
    index_topk=3,
    num_hash_layers=1,
    sliding_window=24,
    num_nextn_predict_layers=1,  # the released configs' legacy value; three stages are stored
    max_position_embeddings=4096,
    dspark_block_size=5,
    dspark_markov_rank=16,
    dspark_target_layer_ids=[1, 2, 3],
    dspark_noise_token_id=NOISE,
)
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}
STAGES = 3
FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
       "indexer.wq_b.weight", "main_proj.weight")
BUDGET = dict(layers=CONFIG["num_hidden_layers"] + STAGES, reduction=4 * CONFIG["hidden_size"])


def official_shapes() -> dict:
    """Every tensor of the release (official names) with its float shape."""
    from mlx_vlm.models.deepseek_v4 import Model, ModelConfig

    model = Model(ModelConfig.from_dict(CONFIG))
    renames = {"embed_tokens.weight": "embed.weight", "norm.weight": "norm.weight", "hc_head.fn": "hc_head_fn",
               "hc_head.base": "hc_head_base", "hc_head.scale": "hc_head_scale"}
    projections = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    shapes = {}
    for key, value in tree_flatten(model.language_model.parameters()):
        key = key.removeprefix("model.")
        key = renames.get(key, key).replace("lm_head.", "head.")
        for part in ("attn", "ffn"):
            for name in ("fn", "base", "scale"):
                key = key.replace(f".{part}_hc.{name}", f".hc_{part}_{name}")
        key = key.replace("ffn.gate.e_score_correction_bias", "ffn.gate.bias")
        if ".switch_mlp." in key:
            layer, projection = key.split(".ffn.switch_mlp.")
            for expert in range(value.shape[0]):
                shapes[f"{layer}.ffn.experts.{expert}.{projections[projection.split('.')[0]]}.weight"] = value.shape[1:]
            continue
        for name, short in projections.items():
            key = key.replace(f"shared_experts.{name}.", f"shared_experts.{short}.")
        shapes[key] = (value.shape[0] * value.shape[1], value.shape[2]) if key.endswith("wo_a.weight") else value.shape
    spec = draft_v4.spec_from_config({**CONFIG, "n_mtp_layers": STAGES})
    draft = draft_v4.checkpoint_shapes(spec)
    return shapes | {k: v for k, v in draft.items() if k.startswith("mtp.")}


def e4m3(codes: np.ndarray) -> np.ndarray:
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent.astype(np.int32) - 7)
    return sign * np.where(exponent == 0, mantissa / 8 * 2.0**-6, normal)


def e2m1(nibbles: np.ndarray) -> np.ndarray:
    sign = np.where(nibbles >> 3, -1.0, 1.0)
    exponent, mantissa = (nibbles >> 1) & 3, nibbles & 1
    return sign * np.where(exponent == 0, mantissa * 0.5, (1 + mantissa / 2) * 2.0 ** (exponent.astype(np.int32) - 1))


def e8m0(codes: np.ndarray) -> np.ndarray:
    return 2.0 ** (codes.astype(np.int32) - 127)


def release_tensors(rng) -> tuple[dict, dict]:
    """``(stored, decoded)``: each tensor as ``(dtype tag, shape, bytes)`` and as float32."""
    stored, decoded = {}, {}
    for key, shape in sorted(official_shapes().items()):
        rows, columns = shape[0], int(np.prod(shape[1:]))
        prefix = key[: -len("weight")]
        if ".experts." in key:  # FP4 pairs, low nibble first, a scale per 32 values
            nibbles = rng.integers(0, 16, (rows, columns), dtype=np.uint8)
            scales = rng.integers(122, 125, (rows, columns // 32), dtype=np.uint8)
            packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)
            stored[key] = ("I8", (rows, columns // 2), packed.tobytes())
            stored[prefix + "scale"] = ("F8_E8M0", scales.shape, scales.tobytes())
            decoded[key] = e2m1(nibbles) * np.repeat(e8m0(scales), 32, axis=1)
        elif key.endswith(FP8) or ".shared_experts." in key:  # FP8 with exponent fields 5..8, block scales
            codes = (rng.integers(0, 2, (rows, columns)) << 7 | rng.integers(5, 9, (rows, columns)) << 3
                     | rng.integers(0, 8, (rows, columns))).astype(np.uint8)
            scales = rng.integers(121, 124, (-(-rows // 128), -(-columns // 128)), dtype=np.uint8)
            stored[key] = ("F8_E4M3", (rows, columns), codes.tobytes())
            stored[prefix + "scale"] = ("F8_E8M0", scales.shape, scales.tobytes())
            block = np.repeat(np.repeat(e8m0(scales), 128, axis=0), 128, axis=1)[:rows, :columns]
            decoded[key] = e4m3(codes) * block
        else:
            decoded[key] = float_tensor(key, shape, rng)
            stored[key] = ("F32", shape, decoded[key].astype(np.float32).tobytes())
    return stored, {key: value.astype(np.float32).reshape(official_shapes()[key]) for key, value in decoded.items()}


def float_tensor(key: str, shape, rng) -> np.ndarray:
    if key.endswith("tid2eid"):
        return np.argsort(rng.random((shape[0], CONFIG["n_routed_experts"])), axis=-1)[:, : shape[1]]
    if key.endswith("norm.weight"):
        return 1 + 0.1 * rng.standard_normal(shape)
    if key.endswith("scale"):
        return rng.uniform(0.5, 1.0, shape)
    return 0.2 * rng.standard_normal(shape)


def write_safetensors(path, tensors: dict) -> None:
    """A safetensors file with the given dtype tags (``F8_E4M3`` and ``F8_E8M0`` included)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": [int(n) for n in shape], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for _, _, data in tensors.values():
            file.write(data)


def write_release(directory, tensors: dict, config: dict) -> None:
    """Target shard and draft shard (as the release puts ``mtp.*`` last), with the index."""
    directory.mkdir()
    parts = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for key, tensor in tensors.items():
        parts[f"model-0000{2 if key.startswith('mtp.') else 1}-of-00002.safetensors"][key] = tensor
    for name, part in parts.items():
        write_safetensors(directory / name, part)
    weight_map = {key: name for name, part in parts.items() for key in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v4_release")
    stored, decoded = release_tensors(np.random.default_rng(0))
    write_release(root / "quantized", stored, {**CONFIG, "quantization_config": QUANTIZATION, "expert_dtype": "fp4"})
    twin = {key: ("F32", value.shape, value.tobytes()) for key, value in decoded.items()}
    write_release(root / "float", twin, CONFIG)
    return root


def test_release_loads_quantized_and_computes_what_its_float_twin_does(release):
    quantized = dspark_fn.load(release / "quantized", release / "quantized")
    twin = dspark_fn.load(release / "float", release / "float")
    assert quantized.spec.draft.num_stages == STAGES
    expert = quantized.target["model"]["layers"][0]["ffn"]["switch_mlp"]["gate_proj"]
    projection = quantized.draft["stages"][0]["attn"]["wq_a"]
    assert expert["weight"].dtype == projection["weight"].dtype == mx.uint32  # kept packed, not dequantized
    prompt = np.random.default_rng(1).integers(0, NOISE, 150).tolist()
    results = []
    for params in (quantized, twin):
        cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), prompt)
        proposal = dspark_fn.draft_block(params, cache, tokens)
        spec, adapter = params.spec, params.spec.target_adapter
        hidden, features, _ = adapter.forward(spec.target, params.target, cache.target, tokens[:, None],
                                              cache.length, spec.taps)
        results.append((adapter.logits(spec.target, params.target, hidden), features, proposal.base_logits))
    for name, ours, reference in zip(("target logits", "taps", "draft logits"), *results):
        assert_fp32_close(ours, reference, name, **BUDGET)


def test_release_greedy_equals_mlx_vlm_on_the_float_twin(release):
    """Greedy decoding of the quantized release equals mlx-vlm's greedy decoding
    of the float twin. (mlx-vlm 0.7.10's loader reads every tensor of an fp8
    config as mxfp8, so it cannot read the FP4 experts of the release itself.)"""
    from mlx_vlm.utils import load_model

    target = load_model(release / "float").language_model
    prompt = np.random.default_rng(2).integers(0, NOISE, 20).tolist()
    cache = target.make_cache()
    logits = target(mx.array([prompt]), cache=cache).logits
    expected = []
    for _ in range(40):
        expected.append(int(mx.argmax(logits[0, -1])))
        logits = target(mx.array([[expected[-1]]]), cache=cache).logits
    params = dspark_fn.load(release / "quantized", release / "quantized")
    assert [t for event in dspark_fn.generate(params, prompt, 40) for t in event.emitted] == expected


def test_alias_loads_the_release_from_the_hub_cache_offline(release, tmp_path, monkeypatch):
    """``deepseek-v4-flash`` names one repository for target and draft: with
    that repository in huggingface-hub's cache (offline) it loads and decodes
    as the directory does; a machine without the memory is refused first."""
    import shutil

    import huggingface_hub.constants as constants

    from dspark_fn import catalog

    repo = tmp_path / "hub" / ("models--" + catalog.ALIASES["deepseek-v4-flash"].target.replace("/", "--"))
    snapshot = "0" * 40
    shutil.copytree(release / "quantized", repo / "snapshots" / snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(catalog, "machine_memory_gb", lambda: 128.0)
    with pytest.raises(ValueError, match="deepseek-v4-flash needs about 160 GB of memory"):
        catalog.load_named("deepseek-v4-flash")
    monkeypatch.setattr(catalog, "machine_memory_gb", lambda: 1024.0)  # the stand-in is tiny
    params, _, _ = catalog.load_named("deepseek-v4-flash")
    direct = dspark_fn.load(release / "quantized", release / "quantized")
    prompt = np.random.default_rng(3).integers(0, NOISE, 12).tolist()
    decode = lambda pair: [t for event in dspark_fn.generate(pair, prompt, 20) for t in event.emitted]  # noqa: E731
    assert decode(params) == decode(direct)
