"""The llama family (llama, mistral, qwen2, qwen3) as a pure target forward.

Covers the variants by what the parameter tree holds: q/k/v biases (qwen2)
and per-head q/k RMSNorm (qwen3) are applied when present.
"""

from dataclasses import dataclass, replace

import mlx.core as mx

from .. import ops
from ..cache import causal_mask, kv_buffers, positions_from, write_rows
from ..interfaces import TargetAdapter
from ..layers.llama import AttentionFields, attention_fields
from ..sharding import Ranks, input_columns, output_rows, vocabulary_rows
from .base import decoder_layers


@dataclass(frozen=True)
class LlamaSpec(AttentionFields):
    model_type: str
    vocab_size: int
    hidden_size: int
    tied: bool
    activation: str


def spec_from_config(config: dict) -> LlamaSpec:
    """The target spec of an HF llama/mistral/qwen2/qwen3 config."""
    return LlamaSpec(
        model_type=config["model_type"],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        tied=config.get("tie_word_embeddings", False),
        activation=config.get("hidden_act", "silu"),
        **attention_fields(config),
    )


def init_kv(spec: LlamaSpec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per layer, K/V buffers ``[B, H_kv, C, D]``."""
    return [
        kv_buffers(batch, spec.num_kv_heads, capacity, spec.head_dim, dtype)
        for _ in range(spec.num_layers)
    ]


def attention_block(spec, p, x, keys, values, start, positions, mask, inv_freq):
    """Self-attention writing this step's K/V into the fixed buffers first."""
    q = ops.split_heads(ops.linear(p["q_proj"], x), spec.num_heads)
    k = ops.split_heads(ops.linear(p["k_proj"], x), spec.num_kv_heads)
    v = ops.split_heads(ops.linear(p["v_proj"], x), spec.num_kv_heads)
    if "q_norm" in p:
        q = ops.rms_norm(q, p["q_norm"]["weight"], spec.eps)
        k = ops.rms_norm(k, p["k_norm"]["weight"], spec.eps)
    q = ops.apply_rope(q, positions, inv_freq)
    k = ops.apply_rope(k, positions, inv_freq)
    keys = write_rows(keys, k, start)
    values = write_rows(values, v, start)
    out = ops.attention(q, keys, values, mask, spec.head_dim**-0.5)
    return ops.linear(p["o_proj"], ops.merge_heads(out)), keys, values


def forward(spec: LlamaSpec, params: dict, kv: list, tokens, start, taps: tuple):
    """Run ``tokens [B, L]`` at positions ``start[b] + i``: ``(final-normed hidden [B, L, d], taps [B, L, F], kv)``."""
    model = params["model"]
    positions = positions_from(start, tokens.shape[1])
    mask = causal_mask(positions, kv[0][0].shape[2])
    inv_freq = ops.rope_inv_freq(spec.head_dim, dict(spec.rope))
    h = ops.embed(model["embed_tokens"], tokens, spec.hidden_size)

    def step(index, layer, state, h):
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        attn, keys, values = attention_block(spec, layer["self_attn"], x, *state, start, positions, mask, inv_freq)
        h = h + attn
        x = ops.rms_norm(h, layer["post_attention_layernorm"]["weight"], spec.eps)
        return h + ops.glu_mlp(layer["mlp"], x, spec.activation), (keys, values)

    h, features, new_kv = decoder_layers(h, model["layers"], kv, step, taps)
    return ops.rms_norm(h, model["norm"]["weight"], spec.eps), features, new_kv


def shard_tensor(spec: LlamaSpec, params: dict, ranks: Ranks) -> tuple[LlamaSpec, dict]:
    """This rank's share (``sharding.py``): whole query and key/value heads,
    its MLP columns, its stretch of the vocabulary."""
    def layer(p: dict) -> dict:
        attn, mlp = p["self_attn"], p["mlp"]
        attn = dict(
            attn,
            q_proj=output_rows(attn["q_proj"], ranks, "query heads", spec.head_dim),
            k_proj=output_rows(attn["k_proj"], ranks, "key/value heads", spec.head_dim),
            v_proj=output_rows(attn["v_proj"], ranks, "key/value heads", spec.head_dim),
            o_proj=input_columns(attn["o_proj"], ranks, "attention output columns"),
        )
        mlp = dict(
            mlp,
            gate_proj=output_rows(mlp["gate_proj"], ranks, "MLP columns"),
            up_proj=output_rows(mlp["up_proj"], ranks, "MLP columns"),
            down_proj=input_columns(mlp["down_proj"], ranks, "MLP columns"),
        )
        return dict(p, self_attn=attn, mlp=mlp)

    model = params["model"]
    model = dict(model, layers=[layer(p) for p in model["layers"]],
                 embed_tokens=vocabulary_rows(model["embed_tokens"], ranks))
    sharded = dict(params, model=model)
    if not spec.tied:
        sharded["lm_head"] = vocabulary_rows(params["lm_head"], ranks)
    return replace(spec, num_heads=spec.num_heads // ranks.size, num_kv_heads=spec.num_kv_heads // ranks.size), sharded


def tensor_splits(config: dict) -> dict:
    """What ``shard_tensor`` divides by the number of ranks, read from the config alone."""
    fields = attention_fields(config)
    return {"query heads": fields["num_heads"], "key/value heads": fields["num_kv_heads"],
            "MLP columns": config["intermediate_size"], "vocabulary rows": config["vocab_size"]}


ADAPTER = TargetAdapter(model_types=("llama", "mistral", "qwen2", "qwen3"), spec_from_config=spec_from_config,
                        init_kv=init_kv, forward=forward, shard_tensor=shard_tensor, tensor_splits=tensor_splits)
