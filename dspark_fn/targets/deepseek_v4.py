"""The DeepSeek-V4 family (mlx-vlm ``deepseek_v4``) as a pure target forward:
embedded hyper-connection streams through hyper-connected blocks of sink
attention over one shared latent and a mixture of experts
(``layers/deepseek_v4.py``), then the collapsed streams' norm.

Supported: sliding-window layers (``compress_ratios`` entry 0) with score or
hash routing. Compressed layers (ratio 4 with the sparse indexer, ratio 128)
are rejected: their pooled keys summarise whole windows of committed tokens,
which needs a second, window-indexed buffer per layer and a rollback rule for
partly written windows that this module does not implement. Quantized (FP8 /
FP4) weights must be dequantized first.

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

from .. import mhc, ops
from ..cache import causal_mask, positions_from, write_rows
from ..layers.deepseek_v4 import (
    BlockSpec,
    attend,
    block,
    block_spec,
    embedded_streams,
    latents,
    model_args,
    queries,
    rope_inv_freq,
)
from .base import TargetAdapter, concat_taps, output_head


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
    last_layer_tappable: bool = True


def spec_from_config(config: dict) -> DeepseekV4Spec:
    """The target spec; compressed-attention layers are refused with the reason."""
    args = model_args(config)
    compressed = [i for i, ratio in enumerate(args["compress_ratios"]) if ratio]
    if compressed:
        raise ValueError(
            f"unsupported deepseek_v4 target: layers {compressed} are compressed-attention layers "
            f"(compress_ratios {args['compress_ratios']}); only sliding-window layers (ratio 0) are supported"
        )
    if args["vision_n_layers"]:
        raise ValueError("unsupported deepseek_v4 target: vision layers (vision_n_layers > 0)")
    return DeepseekV4Spec(
        model_type=config["model_type"],
        vocab_size=args["vocab_size"],
        hidden_size=args["hidden_size"],
        num_layers=args["num_hidden_layers"],
        block=block_spec(args),
        window=args["sliding_window"],
        num_hash_layers=args["num_hash_layers"],
        tied=args["tie_word_embeddings"],
    )


def load_params(directory) -> dict:
    """The ``language_model`` tree through mlx-vlm's loader, which knows the checkpoint layout."""
    from mlx_vlm.utils import load_model

    model = load_model(Path(directory), lazy=False)
    return tree_unflatten(tree_flatten(model.language_model.parameters()))


def init_kv(spec: DeepseekV4Spec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per layer one latent buffer ``[B, 1, capacity, head_dim]`` (keys are the values)."""
    return [(mx.zeros((batch, 1, capacity, spec.block.head_dim), dtype),) for _ in range(spec.num_layers)]


def tap(streams: mx.array) -> mx.array:
    """A block's tapped feature: the mean over its hyper-connection streams."""
    return streams.mean(axis=-2)


# ---- the target forward


def forward(spec: DeepseekV4Spec, params: dict, kv: list, tokens, start, taps: tuple):
    """Run ``tokens [B, L]`` at positions ``start[b] + i``: ``(final-normed hidden [B, L, d], taps [B, L, F], kv)``."""
    model, geometry = params["model"], spec.block
    positions = positions_from(start, tokens.shape[1])
    mask = causal_mask(positions, kv[0][0].shape[2], spec.window)
    inv_freq = rope_inv_freq(geometry)

    def self_attention(layer, buffer):
        def attention(x):
            attn = layer["attn"]
            written = write_rows(buffer, latents(geometry, attn, x, positions, inv_freq), start)
            q = queries(geometry, attn, x, positions, inv_freq)
            return attend(geometry, attn, q, written, mask, positions, inv_freq), written

        return attention

    streams = embedded_streams(geometry, model["embed_tokens"], tokens)
    new_kv, tapped = [], {}
    for index, (layer, (buffer,)) in enumerate(zip(model["layers"], kv)):
        hashed = tokens if index < spec.num_hash_layers else None
        streams, buffer = block(geometry, layer, streams, self_attention(layer, buffer), hashed)
        new_kv.append((buffer,))
        if index in taps:
            tapped[index] = tap(streams)
    features = concat_taps(tapped, taps)
    hidden = ops.rms_norm(mhc.head(model["hc_head"], streams, geometry.hyper), model["norm"]["weight"], spec.block.eps)
    return hidden, features, new_kv


def logits(spec: DeepseekV4Spec, params: dict, hidden: mx.array) -> mx.array:
    """Output logits ``[..., V]`` of final-normed ``hidden``."""
    return ops.linear(output_head(params, spec.tied), hidden)


ADAPTER = TargetAdapter(
    spec_from_config=spec_from_config, init_kv=init_kv, forward=forward, logits=logits, load_params=load_params
)
