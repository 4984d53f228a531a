"""Tiny random multimodal releases for the image tests, one per family that
takes images, written in the release's published layout and built from the
release's configs at small sizes (as mlx-vlm's own tests build theirs): the
text model under ``model.language_model.*``, the vision tower and projector
beside it under the release's names, a tokenizer whose special tokens are
the release's image tokens, a chat template that writes an image
placeholder per image part, and the processor configs the release ships.

mlx-vlm's own loader reads each back (strictly) for the references, and the
same weights serve ``dspark_fn`` through its loaders; a synthetic image
(random pixels, any size) goes to both.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn.checkpoints import load_tokenizer
from helpers import build_draft, draft_config, target_config
from published import write_tokenizer


def content_template(prefix: str, user: str, assistant: str, end: str, image: str) -> str:
    """A chat template over messages whose content is a string or a list of
    parts (``{"type": "image"}`` writes ``image``, text parts their text)."""
    return (
        prefix + "{% for message in messages %}"
        + "{{ '" + assistant + "' if message.role == 'assistant' else '" + user + "' }}"
        + "{% if message.content is string %}{{ message.content }}{% else %}"
        + "{% for part in message.content %}{% if part.type == 'image' %}" + image
        + "{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}" + end + "{% endfor %}"
        + "{% if add_generation_prompt %}" + assistant + "{% endif %}"
    )


VOCAB = 300


def gemma4_release() -> dict:
    """A Gemma 4 release (``Gemma4ForConditionalGeneration``): sliding and
    full attention, vision spans attending both ways in the prefill, a
    SigLIP-style tower pooling 2 x 2 patches into each soft token."""
    text = {
        "model_type": "gemma4_text", "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size": 64,
        "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16,
        "global_head_dim": 32, "num_key_value_heads": 2, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "sliding_window": 8,
        "final_logit_softcapping": 30.0, "use_bidirectional_attention": "vision", "use_double_wide_mlp": False,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096, "enable_moe_block": False,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    }
    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
              "patch_size": 4, "position_embedding_size": 64, "pooling_kernel_size": 2,
              "default_output_length": 16, "rms_norm_eps": 1e-6}
    tokens = {"image": "<|image|>", "boi": "<|image>", "eoi": "<image|>", "audio": "<|audio|>"}
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                tokens["boi"], tokens["image"], tokens["eoi"], tokens["audio"]]
    return {
        "config": {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
                   "vision_config": vision, "vocab_size": VOCAB, "image_token_id": 8, "boi_token_id": 7,
                   "eoi_token_id": 9, "audio_token_id": 10, "eos_token_id": [1, 6], "tie_word_embeddings": True},
        "specials": specials,
        "tokenizer": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                      "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": False,
                      "extra_special_tokens": {"image_token": tokens["image"], "boi_token": tokens["boi"],
                                               "eoi_token": tokens["eoi"], "audio_token": tokens["audio"]}},
        "template": content_template("{{ bos_token }}", "<start_of_turn>user\n", "<start_of_turn>model\n",
                                     "<end_of_turn>\n", tokens["image"]),
        "processor": {"processor_config.json": {"image_processor": {"patch_size": 4, "max_soft_tokens": 16,
                                                                    "pooling_kernel_size": 2}}},
        "stops": [1, 6],
        "seed": 6, "gain": 1.0,  # softcapped tied logits: larger matrices saturate into repeating one token
    }


def qwen3_5_release() -> dict:
    """A Qwen3.5 VL release (``Qwen3_5ForConditionalGeneration``): delta nets
    and gated attention under interleaved multimodal RoPE, a ViT merging
    2 x 2 patches into each image token."""
    text = {
        "model_type": "qwen3_5_text", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "attn_output_gate": True, "attention_bias": False, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    }
    vision = {"model_type": "qwen3_5", "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
              "in_channels": 3, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": []}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    image_config = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64,
                    "max_pixels": 4096}
    return {
        "config": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "text_config": text, "vision_config": vision, "image_token_id": 5, "video_token_id": 6,
                   "vision_start_token_id": 3, "vision_end_token_id": 4, "tie_word_embeddings": False,
                   "eos_token_id": 2},
        "specials": specials,
        "tokenizer": {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                      "pad_token": "<|endoftext|>", "bos_token": None,
                      "extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                               "vision_start_token": "<|vision_start|>",
                                               "vision_end_token": "<|vision_end|>"}},
        "template": content_template("", "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n",
                                     "<|vision_start|><|image_pad|><|vision_end|>"),
        "processor": {"preprocessor_config.json": image_config, "video_preprocessor_config.json": image_config,
                      "processor_config.json": {}},
        "stops": [2],
    }


def lfm2_vl_release() -> dict:
    """An LFM2-VL release (``Lfm2VlForConditionalGeneration``): short
    convolutions and attention, a SigLIP2 NaFlex tower, pixel unshuffle and a
    two-layer projector; tiles past 32 pixels, with a thumbnail."""
    text = {
        "model_type": "lfm2", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "norm_eps": 1e-5, "conv_bias": False,
        "conv_L_cache": 3, "intermediate_size": 128, "block_dim": 64, "block_ff_dim": 128, "conv_dim": 64,
        "conv_dim_out": 64, "block_multiple_of": 16, "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
    }
    vision = {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_channels": 3, "patch_size": 4,
              "num_patches": 64}
    tiles = [f"<|img_row_{row}_col_{col}|>" for row in range(1, 4) for col in range(1, 4)]
    specials = ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>",
                "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + tiles
    image_config = {"encoder_patch_size": 4, "downsample_factor": 2, "min_image_tokens": 4, "max_image_tokens": 16,
                    "tile_size": 32, "max_pixels_tolerance": 2.0}
    return {
        "config": {"architectures": ["Lfm2VlForConditionalGeneration"], "model_type": "lfm2-vl",
                   "text_config": text, "vision_config": vision, "image_token_id": 5, "downsample_factor": 2,
                   "encoder_patch_size": 4, "projector_hidden_size": 48, "max_image_tokens": 16,
                   "min_image_tokens": 4, "tile_size": 32, "eos_token_id": 4, "vision_feature_layer": -1},
        "specials": specials,
        "tokenizer": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                      "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
                      "extra_special_tokens": {"image_token": "<image>", "image_start_token": "<|image_start|>",
                                               "image_end_token": "<|image_end|>"}},
        "template": content_template("{{ bos_token }}", "<|im_start|>user\n", "<|im_start|>assistant\n",
                                     "<|im_end|>\n", "<image>"),
        "processor": {"preprocessor_config.json": image_config},
        "stops": [4],
    }


def gemma4_per_layer_release() -> dict:
    """A small Gemma 4 (E2B/E4B-like): per-layer token inputs, which read the pad token at image positions."""
    release = gemma4_release()
    release["config"]["text_config"] |= {"hidden_size_per_layer_input": 16}
    return release


def gemma4_unified_release() -> dict:
    """Gemma 4 as the 12B ships (``Gemma4UnifiedForConditionalGeneration``): no
    vision encoder, a patch embedder (48 x 48 pixel patches with 2-D position
    embeddings) and the projector. mlx-vlm builds this release's image
    processor with its defaults whatever the checkpoint says (up to 280
    soft tokens an image), so the patch geometry here is the release's."""
    release = gemma4_release()
    text = dict(release["config"]["text_config"], model_type="gemma4_unified_text")
    vision = {"model_type": "gemma4_unified_vision", "mm_embed_dim": 32, "mm_posemb_size": 64,
              "output_proj_dims": 32, "rms_norm_eps": 1e-6}
    release["config"] |= {"architectures": ["Gemma4UnifiedForConditionalGeneration"], "model_type": "gemma4_unified",
                          "text_config": text, "vision_config": vision}
    release["processor"] = {"processor_config.json": {}}
    return release


RELEASES = {"gemma4": gemma4_release, "gemma4-per-layer": gemma4_per_layer_release,
            "gemma4_unified": gemma4_unified_release, "qwen3_5": qwen3_5_release, "lfm2-vl": lfm2_vl_release}


def published_name(family: str, key: str, value: mx.array) -> tuple[str, mx.array]:
    """An mlx-vlm parameter's name and layout in the published release."""
    if key.startswith("language_model.model."):
        key = "model.language_model." + key.removeprefix("language_model.model.")
        if family == "qwen3_5" and key.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight",
                                                 "language_model.norm.weight", ".q_norm.weight", ".k_norm.weight")):
            value = value - 1.0  # Qwen stores w of its (1 + w) norms
        if key.endswith("conv1d.weight") or key.endswith("conv.conv.weight"):
            value = value.swapaxes(1, 2)  # [C, K, 1] -> PyTorch's [C, 1, K]
        return key, value
    if key.startswith("language_model."):  # an untied head
        return key.removeprefix("language_model."), value
    if family == "qwen3_5":
        key = key.replace("vision_tower.", "model.visual.", 1)
        if key.endswith("patch_embed.proj.weight"):
            value = value.transpose(0, 4, 1, 2, 3)  # MLX's NDHWC -> PyTorch's NCDHW
        return key, value
    if family == "lfm2-vl" and key.startswith("vision_tower."):
        return "model.vision_tower.vision_model." + key.removeprefix("vision_tower."), value
    return "model." + key, value


def write_release(directory: Path, family: str) -> dict:
    """A random release of ``family`` (a ``RELEASES`` key) in ``directory``;
    returns its description. The text model's matrices are scaled by the
    release's ``gain`` (default 2) and its vectors spread around 1, so greedy
    margins stand far above float32 noise, the text varies, and code that
    ignores a norm fails."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    release = RELEASES[family]()
    config, seed, gain = release["config"], release.get("seed", 0), release.get("gain", 2.0)
    module, _ = get_model_and_args(dict(config))
    model_config = update_module_configs(module.ModelConfig.from_dict(config), module, config, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    rng = np.random.default_rng(seed)

    def randomised(path: str, w: mx.array) -> mx.array:
        if not path.startswith("language_model.") or w.ndim not in (1, 2):
            return w
        if w.ndim == 2:
            return w * gain
        return w * mx.array(rng.uniform(0.6, 1.4, w.shape).astype(np.float32))

    flat = {key: randomised(key, value) for key, value in tree_flatten(model.parameters())}
    weights = dict(published_name(family, key, value) for key, value in flat.items())
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name, contents in release["processor"].items():
        (directory / name).write_text(json.dumps(contents))
    write_tokenizer(directory, VOCAB, release["specials"], release["tokenizer"], release["template"])
    return release


def write_pair(root: Path, family: str, **draft) -> dict:
    """A release in ``root/target`` and a random qwen3 DSpark draft for its
    text model in ``root/draft`` (taps on the first layers)."""
    release = write_release(root / "target", family)
    text = release["config"]["text_config"]
    base = target_config("qwen3", vocab=text["vocab_size"], hidden=text["hidden_size"],
                         layers=text["num_hidden_layers"], heads=4, kv_heads=2, head_dim=16)
    build_draft(root / "draft", draft_config(base, **({"layers": 1, "taps": (0, 1), "block_size": 4} | draft)),
                seed=1)
    return release


def synthetic_image(height: int, width: int, seed: int = 0):
    """A PIL image of random pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def chat_text(tokenizer, text: str, images: int) -> str:
    """One user turn of ``images`` images then ``text``, as the template lays it out."""
    parts = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)


class Release:
    """A tiny release on disk, loaded by dspark_fn and by mlx-vlm."""

    def __init__(self, root, family: str):
        from mlx_vlm import load

        self.family, self.root = family, root
        self.described = write_pair(root, family)
        self.params = dspark_fn.load(root / "target", root / "draft")
        self.tokenizer = load_tokenizer(root / "target")
        self.model, self.processor = load(str(root / "target"))
        self.processor.tokenizer.stopping_criteria = lambda token: False  # every reference runs its whole budget

    def text(self, words: str, images: int) -> str:
        return chat_text(self.tokenizer, words, images)

    def inputs(self, text: str, images: list) -> dict:
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        add = should_add_special_tokens(self.model.config.model_type, self.processor)
        return dict(prepare_inputs(self.processor, images=images or None, prompts=[text], add_special_tokens=add))

    def reference(self, text: str, images: list, taps: tuple = (), then: tuple = ()):
        """mlx-vlm's logits ``[L, V]`` and tapped layer outputs ``[L, F]`` over
        the whole prompt (and the tokens ``then`` after it), as its
        ``generate`` prefills it (one call)."""
        from mlx_vlm.models.cache import make_prompt_cache

        inputs = self.inputs(text, images)
        ids, pixels, mask = inputs.pop("input_ids"), inputs.pop("pixel_values", None), inputs.pop("attention_mask")
        if then:
            ids = mx.concatenate([mx.array(ids), mx.array([list(then)], mx.int32).astype(mx.array(ids).dtype)], axis=1)
            mask = mx.ones(ids.shape, mx.int32)
            inputs = {key: mx.concatenate([mx.array(value), mx.zeros((1, len(then)), mx.array(value).dtype)], axis=1)
                      if key in ("mm_token_type_ids", "token_type_ids") else value for key, value in inputs.items()}
        embedded = self.model.get_input_embeddings(ids, pixels, mask=mask, **inputs)
        extra = {k: v for k, v in embedded.to_dict().items() if k != "inputs_embeds" and v is not None}
        cache = make_prompt_cache(self.model.language_model)
        out = self.model.language_model(ids, inputs_embeds=embedded.inputs_embeds, cache=cache,
                                        capture_layer_ids=list(taps), **inputs, **extra)
        features = np.concatenate([np.array(h[0]) for h in out.hidden_states], axis=-1) if taps else None
        return np.array(out.logits[0]), features

    def greedy(self, text: str, images: list, tokens: int) -> list:
        """mlx-vlm's ``generate``, greedy, without speculation."""
        from mlx_vlm.generate import stream_generate

        results = list(stream_generate(self.model, self.processor, text, image=images or None, max_tokens=tokens,
                                       temperature=0.0))
        return results[-1].token_ids

    def budget(self) -> dict:
        text = self.described["config"]["text_config"]
        return dict(layers=text["num_hidden_layers"], reduction=2 * text["intermediate_size"])
