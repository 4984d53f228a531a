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
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dspark_fn import models
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


def write_shards(directory: Path, weights: dict, shards: int) -> None:
    """``model-0000k-of-0000n.safetensors`` and the index mapping every key to its shard."""
    keys = sorted(weights)
    per_shard = -(-len(keys) // shards)
    weight_map = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: weights[key] for key in keys[index * per_shard : (index + 1) * per_shard]}
        mx.save_safetensors(str(directory / name), part, metadata={"format": "pt"})
        weight_map |= {key: name for key in part}
    total = sum(value.nbytes for value in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def random_model_weights(config: dict, scratch: Path, seed: int, gain: float) -> dict:
    model = build_target(scratch, config, seed=seed, gain=gain)
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
    from dspark_fn.drafts.init import random_draft_weights

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


ALIAS_STANDINS = {
    "qwen3-4b": qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5]),
    "qwen3-8b": qwen3_pair(tied=False, taps=[1, 2, 3, 4, 5]),
    "qwen3-14b": qwen3_pair(tied=False, taps=[1, 2, 4, 5, 6]),
    "gemma4-12b": gemma4_pair,
}


def populate_hub_cache(cache: Path, alias: str) -> dict:
    """Both repositories of ``alias`` laid out as huggingface-hub's cache
    holds them after a download; returns their snapshot directories."""
    pair = models.ALIASES[alias]
    snapshots = {}
    for role, repo_id in (("target", pair.target), ("draft", pair.draft)):
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshots[role] = repo / "snapshots" / SNAPSHOT
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
    ALIAS_STANDINS[alias](snapshots["target"], snapshots["draft"])
    return snapshots
