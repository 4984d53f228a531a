"""The DeepSeek-V4 family (mlx-vlm ``deepseek_v4``) as a pure target forward:
embedded hyper-connection streams through hyper-connected blocks of sink
attention over one shared latent and a mixture of experts
(``layers/deepseek_v4.py``), then the collapsed streams' norm.

Every layer kind runs: sliding-window layers (``compress_ratios`` entry 0)
and compressed layers (ratio 128, and ratio 4 with its sparse indexer; see
``layers/deepseek_v4_pooling.py`` for the pooled rows and their rollback).
Compressed layers rotate at ``compress_rope_theta`` with the config's rope
scaling. Released FP8 / FP4 weights stay quantized (``load_params``).

Taps are the plain mean over the hyper-connection streams of the tapped
blocks' outputs, as in the reference and mlx-vlm; the last block may be
tapped (V4-Flash's drafter reads layers 40, 41, 42 of 43).

Parameters are mlx-vlm's ``language_model`` sub-tree. The block math lives in
``layers/deepseek_v4.py``, shared with the deepseek_v4 DSpark draft.
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .. import microscaling, ops
from ..cache import causal_mask, positions_from, write_rows
from ..files import read_config, read_safetensors
from ..interfaces import TargetAdapter
from ..layers import deepseek_v4_pooling as pooling
from ..layers import mhc
from ..layers.deepseek_v4 import (
    BlockSpec,
    attend,
    attention_output,
    block,
    block_spec,
    embedded_streams,
    latents,
    model_args,
    queries,
    query_heads,
    query_residual,
    rope_inv_freq,
)
from ..optional import require_vlm
from .base import decoder_layers, model_fields


@dataclass(frozen=True)
class DeepseekV4Spec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    block: BlockSpec
    window: int
    num_hash_layers: int
    tied: bool
    ratios: tuple  # compress ratio per layer: 0 (sliding window only), 4 (indexed) or 128
    compress_rope: tuple  # rope dict items of the compressed layers
    index_heads: int
    index_head_dim: int
    index_topk: int


def spec_from_config(config: dict) -> DeepseekV4Spec:
    """The target spec (mlx-vlm's config defaults; vision layers are refused)."""
    args = model_args(config)
    if args["vision_n_layers"]:
        raise ValueError("unsupported deepseek_v4 target: vision layers (vision_n_layers > 0)")
    return DeepseekV4Spec(
        **model_fields(config, args),
        block=block_spec(args),
        window=args["sliding_window"],
        num_hash_layers=args["num_hash_layers"],
        tied=args["tie_word_embeddings"],
        ratios=tuple(args["compress_ratios"]),
        compress_rope=tuple(sorted({**(args["rope_scaling"] or {}), "rope_theta": args["compress_rope_theta"]}.items())),
        index_heads=args["index_n_heads"],
        index_head_dim=args["index_head_dim"],
        index_topk=args["index_topk"],
    )


def load_params(directory) -> dict:
    """The ``language_model`` tree of a checkpoint directory.

    A release (official tensor names, FP8/FP4 with ``.scale`` companions)
    is read here: its quantized projections stay quantized as MLX mxfp8 /
    mxfp4 (``microscaling.py``), the ``mtp.*`` draft stages are left out,
    and mlx-vlm's ``sanitize`` maps the names. A checkpoint mlx-vlm wrote
    (``language_model.*`` keys) goes through mlx-vlm's own loader.
    """
    require_vlm("a deepseek_v4 target")
    from mlx_vlm.models.deepseek_v4.config import ModelConfig
    from mlx_vlm.models.deepseek_v4.language import LanguageModel
    from mlx_vlm.utils import load_model


    directory = Path(directory)
    weights = {key: value for key, value in read_safetensors(directory, "target").items() if not key.startswith("mtp.")}
    if any(key.startswith("language_model.") for key in weights):
        return tree_unflatten(tree_flatten(load_model(directory, lazy=False).language_model.parameters()))
    config = read_config(directory, "target")
    if microscaling.scaled_weights(weights):
        block = (config.get("quantization_config") or {}).get("weight_block_size", [128])[0]
        weights = microscaling.to_mlx(weights, block)
    language = LanguageModel(ModelConfig.from_dict(config))  # its arrays stay lazy: only its names are used
    return tree_unflatten(list(language.sanitize(weights).items()))


def init_kv(spec: DeepseekV4Spec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per layer a tuple: the latent buffer ``[B, 1, capacity, head_dim]`` (keys
    are the values); compressed layers add their pool's buffers, ratio-4
    layers then the indexer's pool's (``pooling.pool_buffers``)."""
    dim = spec.block.head_dim

    def layer(ratio: int) -> tuple:
        latent = (mx.zeros((batch, 1, capacity, dim), dtype),)
        if ratio == 0:
            return latent
        if ratio != 4:
            return latent + pooling.pool_buffers(batch, capacity, dim, dim, dtype)
        index = pooling.pool_buffers(batch, capacity, 2 * spec.index_head_dim, spec.index_head_dim, dtype)
        return latent + pooling.pool_buffers(batch, capacity, 2 * dim, dim, dtype) + index

    return [layer(ratio) for ratio in spec.ratios]


def tap(streams: mx.array) -> mx.array:
    """A block's tapped feature: the mean over its hyper-connection streams."""
    return streams.mean(axis=-2)


# ---- the target forward


def window_attention(spec: DeepseekV4Spec, attn: dict, state: tuple, start, positions, mask, inv_freq):
    """A sliding-window layer's attention: ``x -> (y, (latents,))``."""

    def attention(x):
        written = write_rows(state[0], latents(spec.block, attn, x, positions, inv_freq), start)
        q = queries(spec.block, attn, x, positions, inv_freq)
        return attend(spec.block, attn, q, written, mask, positions, inv_freq), (written,)

    return attention


def compressed_attention(spec: DeepseekV4Spec, attn: dict, state: tuple, ratio: int, start, positions, mask,
                         prompt_first):
    """A compressed layer's attention: ``x -> (y, state)``; with an indexer
    (ratio 4) each query attends to its top-k pooled rows, without (ratio 128)
    to all of them."""
    geometry, inv_freq = spec.block, rope_inv_freq(spec.block, dict(spec.compress_rope))
    capacity = state[0].shape[2]
    count = capacity // ratio  # pooled slots any position can see
    visible = pooling.visible_windows(positions, ratio, count)

    def pool(params, buffers, x):
        return pooling.compress(params, buffers, x, start, prompt_first, ratio, geometry.eps, inv_freq)

    def attention(x):
        written = write_rows(state[0], latents(geometry, attn, x, positions, inv_freq), start)
        residual = query_residual(geometry, attn, x)
        q = query_heads(geometry, attn, residual, positions, inv_freq)
        main = pool(attn["compressor"], state[1:4], x)
        pooled = main[2][:, :, :count]
        if "indexer" not in attn:
            keys, keys_mask = mx.concatenate([written, pooled], axis=2), mx.concatenate([mask, visible], axis=-1)
            return attend(geometry, attn, q, keys, keys_mask, positions, inv_freq), (written, *main)
        index = pool(attn["indexer"]["compressor"], state[4:7], x)
        chosen = pooling.top_windows(attn["indexer"], x, residual, index[2][:, :, :count], visible, positions,
                                     inv_freq, spec.index_heads, spec.index_topk)
        out = pooling.sparse_attention(q, written, mask, pooled, chosen, visible, attn["attn_sink"].astype(q.dtype),
                                       geometry.head_dim**-0.5)
        return attention_output(geometry, attn, out, positions, inv_freq), (written, *main, *index)

    return attention


def forward(spec: DeepseekV4Spec, params: dict, kv: list, tokens, start, taps: tuple, prompt_first=None):
    """Run ``tokens [B, L]`` at positions ``start[b] + i``: ``(final-normed hidden [B, L, d], taps [B, L, F], kv)``.

    ``prompt_first [B]`` is set while a prompt is prefilled (``prompt_forward``):
    the position its overlapping pools count from.
    """
    model, geometry = params["model"], spec.block
    positions = positions_from(start, tokens.shape[1])
    mask = causal_mask(positions, kv[0][0].shape[2], spec.window)
    inv_freq = rope_inv_freq(geometry)

    def attention(index: int, attn: dict, state: tuple):
        ratio = spec.ratios[index]
        if ratio == 0:
            return window_attention(spec, attn, state, start, positions, mask, inv_freq)
        return compressed_attention(spec, attn, state, ratio, start, positions, mask, prompt_first)

    streams = embedded_streams(geometry, model["embed_tokens"], tokens)

    def step(index, layer, state, streams):
        hashed = tokens if index < spec.num_hash_layers else None
        return block(geometry, layer, streams, attention(index, layer["attn"], state), hashed)

    streams, features, new_kv = decoder_layers(streams, model["layers"], kv, step, taps, tap)
    hidden = ops.rms_norm(mhc.head(model["hc_head"], streams, geometry.hyper), model["norm"]["weight"], spec.block.eps)
    return hidden, features, new_kv


def prompt_forward(spec: DeepseekV4Spec, params: dict, kv: list, tokens, start, taps: tuple, first, end):
    """``forward`` for a chunk of prompts that span positions ``first[b] .. end[b] - 1``."""
    return forward(spec, params, kv, tokens, start, taps, pooling.prompt_overlap_start(first, end))


ADAPTER = TargetAdapter(
    model_types=("deepseek_v4",), spec_from_config=spec_from_config, init_kv=init_kv, forward=forward,
    load_params=load_params, prompt_forward=prompt_forward, last_layer_tappable=True,
)
