"""Tiny stand-ins of the published DSpark pairs, written in each release's file layout.

Each stand-in keeps what loading depends on and shrinks only the sizes:
the release's config fields (transformers 5 layout for the DeepSpec drafts:
``dtype``, ``rope_parameters``), its tensor key names, bf16 storage, its
sharding (Qwen3 targets: ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``; Gemma 4 and every draft: one
``model.safetensors``), its tokenizer files and chat template, and for
Gemma 4 the multimodal wrapper (``gemma4_unified`` with the text model
under ``model.language_model.*`` and vision/audio weights beside it).
Sources: the release configs of Qwen/Qwen3-{4B,8B,14B}, google/gemma-4-12B,
deepseek-ai/dspark_*_block7 and DeepSpec's ``build_draft_config``.

The hybrid pairs: LiquidAI's LFM2.5 text targets (``lfm2``, ``lfm2_moe``; the
LFM2 release fields in LFM2.5's spelling: ``layer_types``,
``rope_parameters``, ``intermediate_size``, as mlx-vlm's lfm2_vl config
notes for LFM2.5; HF key names, conv kernels stored ``[D, 1, K]``, lfm2_moe
MLPs as ``w1``/``w2``/``w3`` with every expert on its own, the layout
mlx-lm's lfm2 / lfm2_moe ``sanitize`` reads; a ChatML template after the
BOS token and the LFM2.5 tokenizer_config) and Qwen/Qwen3.8-27B (a
multimodal Qwen3.5 release: text model under ``model.language_model.*``
with its (1 + w) norms stored as w and conv kernels ``[C, 1, K]``, vision
tower and ``mtp.*`` weights beside it, shards named
``model.safetensors-0000k-of-0000n.safetensors``). Their drafts are in the
``dflash_config`` layout, with the fields of the published configs as
mlx-vlm's tests/test_models_dspark.py copies them: LFM2.5 drafts keep only
mask_token_id, target_layer_ids and num_target_layers in ``dflash_config``
and block_size 9, markov_rank 256 at the top level; RadixArk's Qwen3.8
draft has ``projector_type: dspark``, block_size 7 and YaRN RoPE (factor
32 over 8192 positions). No draft ships an embedding or head.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dspark_fn import catalog
from helpers import build_target

SNAPSHOT = "5" * 40


# ---- tokenizers


def write_tokenizer(directory: Path, vocab_size: int, specials: list, config: dict, template: str | None = None):
    """A byte-level BPE tokenizer of ``vocab_size`` entries (specials first)."""
    from tokenizers import Tokenizer, decoders, models as token_models, pre_tokenizers, trainers

    tokenizer = Tokenizer(token_models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = ["hello world, the quick brown fox jumps over the lazy dog. " * 4, "def add(a, b): return a + b"] * 8
    tokenizer.train_from_iterator(text, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer.model.save(str(directory))  # vocab.json + merges.txt, as the Qwen releases ship them
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_CHAT = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message.role == 'assistant' else message.role }}\n{{ message.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def qwen_tokenizer(directory: Path) -> None:
    write_tokenizer(
        directory, 300, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "chat_template": CHATML, "model_max_length": 131072},
    )


def gemma_tokenizer(directory: Path) -> None:
    write_tokenizer(
        directory, 300, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
        {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": False},
        GEMMA_CHAT,
    )


# ---- weights


def bf16(weights: dict) -> dict:
    return {key: value.astype(mx.bfloat16) for key, value in weights.items()}


def write_shards(directory: Path, weights: dict, shards: int, prefix: str = "model-") -> None:
    """``{prefix}0000k-of-0000n.safetensors`` and the index mapping every key to its shard."""
    keys = sorted(weights)
    per_shard = -(-len(keys) // shards)
    weight_map = {}
    for index in range(shards):
        name = f"{prefix}{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: weights[key] for key in keys[index * per_shard : (index + 1) * per_shard]}
        mx.save_safetensors(str(directory / name), part, metadata={"format": "pt"})
        weight_map |= {key: name for key in part}
    total = sum(value.nbytes for value in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def random_model_weights(config: dict, scratch: Path, seed: int, gain: float, spread: float = 0.0) -> dict:
    model = build_target(scratch, config, seed=seed, gain=gain, vector_spread=spread)
    shutil.rmtree(scratch)
    return dict(tree_flatten(model.parameters()))


# ---- Qwen3 targets and their DeepSpec drafts


def qwen3_config(tied: bool) -> dict:
    """Qwen/Qwen3-*B config.json, field for field, at tiny sizes."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 40960,
        "max_window_layers": 8, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 8,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 320,
    }


def write_qwen3_target(directory: Path, tied: bool) -> dict:
    config = qwen3_config(tied)
    directory.mkdir(parents=True, exist_ok=True)
    weights = random_model_weights(config, directory / "scratch", seed=11, gain=2.5)
    if tied:
        weights.pop("lm_head.weight", None)
    write_shards(directory, bf16(weights), shards=3)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [2, 0], "pad_token_id": 0,
                  "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=4))
    qwen_tokenizer(directory)
    return config


def deepspec_draft_config(target: dict, architecture: str, taps: list, mask_token_id: int) -> dict:
    """``build_draft_config``: a copy of the target's (text) config with the
    DSpark keys, serialised by transformers 5 (``dtype``, ``rope_parameters``)."""
    config = {key: value for key, value in target.items() if key not in ("torch_dtype", "rope_theta", "rope_scaling")}
    if "rope_theta" in target:
        config["rope_parameters"] = {"rope_theta": target["rope_theta"], "rope_type": "default"}
    config.update(
        architectures=[architecture], dtype="bfloat16", transformers_version="5.10.2",
        num_target_layers=target["num_hidden_layers"], num_hidden_layers=2, block_size=7,
        tie_word_embeddings=False, layer_types=["full_attention"] * 2, mask_token_id=mask_token_id,
        target_layer_ids=taps, num_anchors=512, enable_confidence_head=True, confidence_head_with_markov=True,
        markov_rank=16, markov_head_type="vanilla",
    )
    return config


def write_draft(directory: Path, config: dict, target_weights: dict, seed: int) -> None:
    """Every draft tensor in bf16 in one ``model.safetensors``, with the
    target's embedding and head copied in, as DeepSpec saves them."""
    from dspark_fn.drafts import resolve_arch
    from dspark_fn.drafts.fresh import random_draft_weights

    arch = resolve_arch(config)
    weights = random_draft_weights(arch, arch.spec_from_config(config), seed=seed, gain=2.0)
    embedding = next(v for k, v in target_weights.items() if k.endswith("embed_tokens.weight"))
    weights["embed_tokens.weight"] = embedding
    weights["lm_head.weight"] = target_weights.get("lm_head.weight", embedding)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), bf16(weights), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def qwen3_pair(tied: bool, taps: list):
    def write(target_dir: Path, draft_dir: Path) -> None:
        config = write_qwen3_target(target_dir, tied)
        weights = {k: v for file in target_dir.glob("*.safetensors") for k, v in mx.load(str(file)).items()}
        draft = deepspec_draft_config(config, "Qwen3DSparkModel", taps, mask_token_id=config["vocab_size"] - 1)
        write_draft(draft_dir, draft, weights, seed=12)

    return write


# ---- Gemma 4 (multimodal release) and its DeepSpec draft


def gemma4_text_config() -> dict:
    """google/gemma-4-12B(-it) ``text_config``, field for field, at tiny sizes."""
    return {
        "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True, "bos_token_id": 2,
        "enable_moe_block": False, "eos_token_id": 1, "final_logit_softcapping": 30.0, "global_head_dim": 32,
        "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64,
        "hidden_size_per_layer_input": 0, "initializer_range": 0.02, "intermediate_size": 128,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "max_position_embeddings": 262144,
        "model_type": "gemma4_unified_text", "moe_intermediate_size": None, "num_attention_heads": 4,
        "num_experts": None, "num_global_key_value_heads": 1, "num_hidden_layers": 6, "num_key_value_heads": 2,
        "num_kv_shared_layers": 0, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 8, "tie_word_embeddings": True, "top_k_experts": None,
        "use_bidirectional_attention": "vision", "use_cache": True, "use_double_wide_mlp": False,
        "vocab_size": 320, "vocab_size_per_layer_input": 320,
    }


def multimodal_config(text: dict, model_type: str) -> dict:
    return {
        "architectures": ["Gemma4UnifiedForConditionalGeneration"], "model_type": model_type,
        "text_config": text, "vocab_size": text["vocab_size"], "dtype": "bfloat16", "tie_word_embeddings": True,
        "audio_token_id": text["vocab_size"] - 7, "image_token_id": text["vocab_size"] - 8,
        "vision_config": {"model_type": "gemma4_unified_vision", "mm_embed_dim": text["hidden_size"], "patch_size": 16},
        "audio_config": {"model_type": "gemma4_unified_audio", "hidden_size": 16},
        "transformers_version": "5.10.0.dev0",
    }


def towers(hidden: int) -> dict:
    """The vision and audio weights a text-only run must leave on disk."""
    return {
        "model.vision_embedder.patch_dense.weight": mx.ones((hidden, 48)),
        "model.vision_embedder.patch_ln1.weight": mx.ones((48,)),
        "model.embed_vision.embedding_projection.weight": mx.ones((hidden, hidden)),
        "model.embed_audio.embedding_projection.weight": mx.ones((hidden, 16)),
    }


def as_multimodal(weights: dict) -> dict:
    return {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
            for k, v in weights.items()}


def write_multimodal_gemma4(source: Path, out: Path, model_type: str) -> Path:
    """A text-only gemma4 checkpoint rewritten in the multimodal release layout."""
    text = dict(json.loads((source / "config.json").read_text()), model_type="gemma4_unified_text")
    weights = as_multimodal(mx.load(str(source / "model.safetensors"))) | towers(text["hidden_size"])
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(multimodal_config(text, model_type), indent=2))
    return out


def gemma4_pair(target_dir: Path, draft_dir: Path) -> None:
    text = gemma4_text_config()
    target_dir.mkdir(parents=True, exist_ok=True)
    runnable = dict(text, model_type="gemma4_text")
    weights = random_model_weights(runnable, target_dir / "scratch", seed=13, gain=1.0)
    weights.pop("lm_head.weight", None)
    stored = bf16(as_multimodal(weights)) | bf16(towers(text["hidden_size"]))
    mx.save_safetensors(str(target_dir / "model.safetensors"), stored, metadata={"format": "pt"})
    (target_dir / "config.json").write_text(json.dumps(multimodal_config(text, "gemma4_unified"), indent=2))
    generation = {"bos_token_id": 2, "do_sample": True, "eos_token_id": [1, 6], "pad_token_id": 0,
                  "temperature": 1.0, "top_k": 64, "top_p": 0.95}
    (target_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    gemma_tokenizer(target_dir)
    draft = deepspec_draft_config(text, "Gemma4DSparkModel", [0, 1, 2, 3, 4], mask_token_id=4)
    draft.update(target_model_type="gemma4_unified", target_text_model_type="gemma4_unified_text")
    write_draft(draft_dir, draft, weights, seed=14)


# ---- DSpark drafts in the dflash_config layout (the hybrid targets' drafts)


def write_dflash_draft(directory: Path, config: dict, seed: int) -> None:
    """A draft's random weights in bf16 in one ``model.safetensors``: no
    embedding or head (the target's serve), norm weights spread around 1."""
    from dspark_fn.drafts import resolve_arch
    from dspark_fn.drafts.fresh import random_draft_weights

    arch = resolve_arch(config)
    weights = random_draft_weights(arch, arch.spec_from_config(config), seed=seed, gain=2.0)
    rng = np.random.default_rng(seed)
    spread = {key: mx.array(rng.uniform(0.6, 1.4, value.shape).astype(np.float32))
              for key, value in weights.items() if value.ndim == 1 and not key.endswith("bias")}
    weights = {key: value * spread.get(key, 1.0) for key, value in weights.items()
               if key not in ("embed_tokens.weight", "lm_head.weight")}
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), bf16(weights), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


# ---- LFM2.5 targets (text releases) and Liquid's DSpark drafts

LFM_CHAT = "{{ bos_token }}" + CHATML
LFM_LAYERS = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]
LFM_MLP = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # mlx-lm's lfm2_moe names -> the release's


def lfm_tokenizer(directory: Path) -> None:
    write_tokenizer(
        directory, 300,
        ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
         "<|im_start|>", "<|im_end|>"],
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|im_end|>",
         "pad_token": "<|pad|>", "add_bos_token": True, "add_eos_token": False, "legacy": False},
        LFM_CHAT,
    )


def lfm2_config(moe: bool) -> dict:
    """A LiquidAI/LFM2.5-* config.json at tiny sizes (6 layers, attention at 2 and 4)."""
    config = {
        "architectures": ["Lfm2MoeForCausalLM" if moe else "Lfm2ForCausalLM"],
        "model_type": "lfm2_moe" if moe else "lfm2", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 6,
        "layer_types": LFM_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 1,
        "max_position_embeddings": 128000, "norm_eps": 1e-05, "conv_bias": False, "conv_L_cache": 3,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0, "dtype": "bfloat16", "use_cache": True,
        "initializer_range": 0.02, "transformers_version": "5.0.0",
    }
    if moe:  # LFM2-8B-A1B's fields: 32 experts, top 4, the first 2 layers dense
        return config | {"intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
                         "num_experts_per_tok": 4, "norm_topk_prob": True, "use_expert_bias": True,
                         "num_dense_layers": 2}
    return config | {"intermediate_size": 192, "block_dim": 64, "block_multiple_of": 16,
                     "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "conv_dim": 64,
                     "conv_dim_out": 64, "num_heads": 4}


def lfm2_release_weights(weights: dict) -> dict:
    """mlx-lm's lfm2 / lfm2_moe tree as LiquidAI's releases name and shape it."""
    release = {}
    for key, value in weights.items():
        if key.endswith("conv.conv.weight"):
            value = value.swapaxes(1, 2)  # [D, K, 1] -> PyTorch's [D, 1, K]
        prefix, _, expert_key = key.partition("switch_mlp.")
        if expert_key:
            name = LFM_MLP[expert_key.split(".")[0]]
            release |= {f"{prefix}experts.{e}.{name}.weight": value[e] for e in range(value.shape[0])}
            continue
        for mlx_name, name in LFM_MLP.items():
            key = key.replace(f"feed_forward.{mlx_name}.", f"feed_forward.{name}.")
        release[key] = value
    return release


def lfm_draft_config(target: dict, taps: list, rope_theta: float) -> dict:
    """A Liquid DSpark draft's config.json at tiny sizes (published: 5 layers
    of width 2048, 32 / 8 heads of 64, MLP 6144)."""
    return {
        "architectures": ["Lfm2DSparkDraftModel"], "model_type": "qwen3", "hidden_size": target["hidden_size"],
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "intermediate_size": 3 * target["hidden_size"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "vocab_size": target["vocab_size"], "rope_theta": rope_theta, "max_position_embeddings": 128000,
        "layer_types": ["full_attention"] * 2, "block_size": 9,
        "dflash_config": {"mask_token_id": target["vocab_size"] - 1, "target_layer_ids": taps,
                          "num_target_layers": target["num_hidden_layers"]},
        "markov_rank": 256, "rope_is_neox_style": False, "enable_confidence_head": True,
        "markov_head_type": "vanilla",
    }


def lfm_pair(moe: bool, rope_theta: float):
    def write(target_dir: Path, draft_dir: Path) -> None:
        config = lfm2_config(moe)
        target_dir.mkdir(parents=True, exist_ok=True)
        weights = bf16(lfm2_release_weights(random_model_weights(config, target_dir / "scratch", 15, 1.5, 0.4)))
        if moe:  # past 5 GB: sharded
            write_shards(target_dir, weights, shards=3)
        else:
            mx.save_safetensors(str(target_dir / "model.safetensors"), weights, metadata={"format": "pt"})
        (target_dir / "config.json").write_text(json.dumps(config, indent=2))
        lfm_tokenizer(target_dir)
        write_dflash_draft(draft_dir, lfm_draft_config(config, [0, 1, 2, 3, 4], rope_theta), seed=16)

    return write


# ---- Qwen3.8 (a multimodal Qwen3.5 release) and RadixArk's DSpark draft

QWEN3_5_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


def qwen3_8_text_config() -> dict:
    """Qwen/Qwen3.8-27B's ``text_config`` at tiny sizes (published: 64
    layers, every 4th attention with 24 / 4 heads of 256, a quarter rotated)."""
    return {
        "model_type": "qwen3_5_text", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 8,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2, "full_attention_interval": 4,
        "intermediate_size": 128, "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 32,
        "attn_output_gate": True, "attention_bias": False, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-06, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    }


def qwen3_8_config(text: dict) -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32, "num_heads": 2,
                          "intermediate_size": 64, "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2,
                          "spatial_merge_size": 2, "out_hidden_size": text["hidden_size"]},
        "image_token_id": 310, "video_token_id": 311, "vision_start_token_id": 312, "vision_end_token_id": 313,
        "tie_word_embeddings": False, "dtype": "bfloat16", "transformers_version": "5.2.0",
    }


def qwen3_8_release_weights(weights: dict, hidden: int) -> dict:
    """mlx-lm's Qwen3.5 tree as Qwen's releases store it, with the vision
    tower and the multi-token-prediction layer a text run leaves on disk."""
    release = {}
    for key, value in weights.items():
        if key.endswith("conv1d.weight"):
            value = value.swapaxes(1, 2)  # [C, K, 1] -> PyTorch's [C, 1, K]
        if key.endswith(QWEN3_5_NORMS):
            value = value - 1.0  # the release stores w of the (1 + w) norm
        name = key.replace("language_model.model.", "model.language_model.")
        release[name.replace("language_model.lm_head", "lm_head")] = value
    return release | {
        "model.visual.patch_embed.proj.weight": mx.ones((32, 3, 2, 16, 16)),  # PyTorch's NCDHW
        "model.visual.blocks.0.attn.qkv.weight": mx.ones((96, 32)),
        "model.visual.merger.linear_fc2.weight": mx.ones((hidden, 128)),
        "mtp.fc.weight": mx.ones((hidden, 2 * hidden)),
        "mtp.norm.weight": mx.zeros((hidden,)),
        "mtp.pre_fc_norm_hidden.weight": mx.zeros((hidden,)),
    }


def radixark_draft_config(target: dict, taps: list) -> dict:
    """RadixArk/Qwen3.8-27B-DSpark's config.json at tiny sizes (published: 5
    layers of width 5120, 40 / 8 heads of 128, MLP 10240)."""
    return {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "block_size": 7,
        "confidence_head_with_markov": True, "hidden_size": target["hidden_size"], "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 16,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": target["vocab_size"],
        "max_position_embeddings": 262144, "num_target_layers": target["num_hidden_layers"],
        "layer_types": ["full_attention"] * 2, "markov_rank": 256, "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000000, "factor": 32.0,
                            "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0},
        "dflash_config": {"projector_type": "dspark", "mask_token_id": target["vocab_size"] - 1,
                          "target_layer_ids": taps, "markov_rank": 256, "markov_head_type": "vanilla",
                          "enable_confidence_head": True, "confidence_head_with_markov": True},
    }


def qwen3_8_pair(target_dir: Path, draft_dir: Path) -> None:
    text = qwen3_8_text_config()
    config = qwen3_8_config(text)
    target_dir.mkdir(parents=True, exist_ok=True)
    weights = random_model_weights(config, target_dir / "scratch", seed=17, gain=2.0, spread=0.4)
    release = bf16(qwen3_8_release_weights(weights, text["hidden_size"]))
    write_shards(target_dir, release, shards=3, prefix="model.safetensors-")
    (target_dir / "config.json").write_text(json.dumps(config, indent=2))
    qwen_tokenizer(target_dir)
    write_dflash_draft(draft_dir, radixark_draft_config(text, [0, 1, 3, 4, 6]), seed=18)


ALIAS_STANDINS = {
    "qwen3-4b": qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5]),
    "qwen3-8b": qwen3_pair(tied=False, taps=[1, 2, 3, 4, 5]),
    "qwen3-14b": qwen3_pair(tied=False, taps=[1, 2, 4, 5, 6]),
    "gemma4-12b": gemma4_pair,
    "lfm2.5-1.2b": lfm_pair(moe=False, rope_theta=1000000.0),
    "lfm2.5-2.6b": lfm_pair(moe=False, rope_theta=10000000.0),
    "lfm2.5-8b-a1b": lfm_pair(moe=True, rope_theta=5000000.0),
    "qwen3.8-27b": qwen3_8_pair,
}


def populate_hub_cache(cache: Path, alias: str) -> dict:
    """Both repositories of ``alias`` laid out as huggingface-hub's cache
    holds them after a download; returns their snapshot directories."""
    pair = catalog.ALIASES[alias]
    snapshots = {}
    for role, repo_id in (("target", pair.target), ("draft", pair.draft)):
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshots[role] = repo / "snapshots" / SNAPSHOT
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
    ALIAS_STANDINS[alias](snapshots["target"], snapshots["draft"])
    return snapshots
