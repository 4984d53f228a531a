"""Builders shared by the tests: tiny random targets and drafts on disk, reference decoding."""

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

import dspark_fn
from dspark_fn.checkpoints import save_draft
from dspark_fn.drafts import resolve_arch
from dspark_fn.drafts.init import random_draft_weights

PARITY = Path(os.environ.get("DSPARK_PARITY_DIR", Path(__file__).resolve().parents[2] / "shared" / "parity"))


def target_config(model_type="qwen3", vocab=256, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, tied=True):
    return {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
        "attention_bias": model_type == "qwen2",
        "hidden_act": "silu",
    }


def build_target(directory: Path, config: dict, seed: int = 0, gain: float = 2.5):
    """A random mlx-lm model saved as an HF directory; weights scaled up so
    greedy argmax margins stay far above float32 noise."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    scaled = tree_map(lambda w: w * gain if w.ndim == 2 else w, model.parameters())
    model.update(scaled)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return model


def draft_config(target: dict, layers=2, taps=(1, 3), block_size=7, markov_rank=8, mask_token_id=None):
    config = dict(target)
    config.update(
        num_hidden_layers=layers,
        num_target_layers=target["num_hidden_layers"],
        target_layer_ids=list(taps),
        block_size=block_size,
        mask_token_id=target["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        tie_word_embeddings=False,
    )
    return config


def build_draft(directory: Path, config: dict, seed: int = 0, gain: float = 2.0, with_shared=False):
    arch = resolve_arch(config)
    weights = random_draft_weights(arch, arch.spec_from_config(config), seed=seed, gain=gain)
    if not with_shared:
        weights = {k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    return save_draft(directory, config, weights)


def mlx_lm_greedy(model, prompt, n):
    """The target alone, greedy, through mlx-lm's own decoding loop."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in steps]


def speculative_tokens(params, prompt, n, **kwargs):
    return [t for event in dspark_fn.generate(params, prompt, n, **kwargs) for t in event.emitted]


def random_prompt(rng: np.random.Generator, length: int, vocab: int):
    return rng.integers(0, vocab - 1, size=length).tolist()
