"""Llama-family geometry shared by the llama target (llama, mistral, qwen2,
qwen3) and the qwen3 DSpark draft that serves it."""

from dataclasses import dataclass

from .. import ops


@dataclass(frozen=True)
class AttentionFields:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope: tuple  # sorted items of the RoPE parameters


def attention_fields(config: dict) -> dict:
    """Layers, heads, key/value heads, head dim, norm epsilon and RoPE of an HF config."""
    heads = config["num_attention_heads"]
    return dict(
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        eps=config.get("rms_norm_eps", 1e-6),
        rope=tuple(sorted(ops.rope_parameters(config).items())),
    )
