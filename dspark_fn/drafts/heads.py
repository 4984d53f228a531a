"""The DSpark heads shared by every backbone: low-rank Markov bias and confidence.

The Markov chain is sequential over the block (slot k's bias depends on the
token drafted at slot k-1); with a fixed block size it unrolls into the
compiled round.
"""

from typing import Callable

import mlx.core as mx

from .base import DSparkFields


def frame_shapes(spec: DSparkFields) -> dict:
    """Tensors a DeepSpec-layout draft has around its layers: embedding and
    output head (copies of the target's), final norm, and the tap projection."""
    d = spec.hidden_size
    return {
        "embed_tokens.weight": (spec.vocab_size, d),
        "lm_head.weight": (spec.vocab_size, d),
        "norm.weight": (d,),
        "hidden_norm.weight": (d,),
        "fc.weight": (d, len(spec.target_layer_ids) * d),
    }


def decoder_layer_shapes(
    layer: str, d: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, value_projection: bool = True
) -> dict:
    """One pre-norm decoder layer with per-head q/k norms and a GLU MLP, as
    qwen3 and gemma4 drafts store it (gemma4 adds its sandwich norms)."""
    shapes = {
        layer + "self_attn.q_proj.weight": (heads * head_dim, d),
        layer + "self_attn.k_proj.weight": (kv_heads * head_dim, d),
        layer + "self_attn.o_proj.weight": (d, heads * head_dim),
        layer + "self_attn.q_norm.weight": (head_dim,),
        layer + "self_attn.k_norm.weight": (head_dim,),
        layer + "mlp.gate_proj.weight": (intermediate, d),
        layer + "mlp.up_proj.weight": (intermediate, d),
        layer + "mlp.down_proj.weight": (d, intermediate),
        layer + "input_layernorm.weight": (d,),
        layer + "post_attention_layernorm.weight": (d,),
    }
    if value_projection:
        shapes[layer + "self_attn.v_proj.weight"] = (kv_heads * head_dim, d)
    return shapes


def head_shapes(spec: DSparkFields) -> dict:
    """Checkpoint tensors of the Markov and confidence heads, and the draft
    vocabulary when the draft proposes from a subset (``draft_vocab_ids``:
    the target id of each draft-vocabulary entry; the Markov output rows are
    stored for those entries only)."""
    shapes = {}
    if spec.draft_vocab_size:
        shapes[DRAFT_VOCAB_KEY] = (spec.draft_vocab_size,)
    if spec.markov_rank:
        shapes["markov_head.markov_w1.weight"] = (spec.vocab_size, spec.markov_rank)
        shapes["markov_head.markov_w2.weight"] = (spec.draft_vocab_size or spec.vocab_size, spec.markov_rank)
    if spec.confidence_head:
        width = spec.hidden_size + (spec.markov_rank if spec.confidence_with_markov else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        if spec.confidence_bias:
            shapes["confidence_head.proj.bias"] = (1,)
    return shapes


DRAFT_VOCAB_KEY = "draft_vocab_ids"


def markov_embedding(params: dict, prev: mx.array) -> mx.array:
    """``markov_w1[prev]``: ``[..., r]``."""
    return params["markov_head"]["markov_w1"]["weight"][prev]


def markov_bias(params: dict, embedding: mx.array) -> mx.array:
    """The Markov bias ``[..., V']`` of a Markov embedding ``[..., r]``."""
    return embedding @ params["markov_head"]["markov_w2"]["weight"].T


def confidence_logit(spec: DSparkFields, params: dict, hidden: mx.array, embedding) -> mx.array:
    """The confidence logit ``[...]`` of ``[hidden ; embedding]`` (hidden alone without the Markov input)."""
    head = params["confidence_head"]["proj"]
    x = mx.concatenate([hidden, embedding], axis=-1) if spec.confidence_with_markov else hidden
    z = x @ head["weight"].T
    if "bias" in head:
        z = z + head["bias"]
    return z[..., 0]


def slot_heads(spec: DSparkFields, params: dict, base_logits: mx.array, head_hidden: mx.array, prev: mx.array):
    """The Markov-corrected logits and the confidence logit of draft slots
    whose previous token is ``prev`` (any leading shape: one slot while
    drafting, every slot at once when training with known tokens)."""
    embedding = markov_embedding(params, prev) if spec.markov_rank else None
    logits = base_logits + markov_bias(params, embedding) if spec.markov_rank else base_logits
    if spec.confidence_head:
        confidence = confidence_logit(spec, params, head_hidden, embedding)
    else:
        confidence = mx.zeros(prev.shape, mx.float32)
    return logits, confidence


def draft_chain(
    spec: DSparkFields,
    params: dict,
    base_logits: mx.array,
    head_hidden: mx.array,
    anchor: mx.array,
    choose: Callable[[mx.array, int], mx.array],
):
    """Run the Markov chain over the block.

    ``choose(logits [B, V], slot) -> tokens [B]`` picks each drafted token
    (argmax when greedy). Returns drafted tokens ``[B, G]``, corrected logits
    ``[B, G, V]`` and confidence logits ``[B, G]`` (zeros without a head).
    """
    prev = anchor
    tokens, logits, confidences = [], [], []
    for slot in range(base_logits.shape[1]):
        corrected, confidence = slot_heads(spec, params, base_logits[:, slot], head_hidden[:, slot], prev)
        prev = choose(corrected, slot)
        tokens.append(prev)
        logits.append(corrected)
        confidences.append(confidence)
    return mx.stack(tokens, 1), mx.stack(logits, 1), mx.stack(confidences, 1)
