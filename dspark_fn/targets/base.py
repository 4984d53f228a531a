"""The pieces every target family's forward is built from: the decoder layer
loop (and its pipeline split), the tapped features, the spec's common fields."""

from typing import Callable

import mlx.core as mx
import numpy as np


def model_fields(config: dict, args: dict) -> dict:
    """The fields every target spec starts with, from its config and the model
    arguments mlx-lm reads from it."""
    return dict(model_type=config["model_type"], vocab_size=args["vocab_size"], hidden_size=args["hidden_size"],
                num_layers=args["num_hidden_layers"])


def pipeline_stages(count: int, size: int) -> list[range]:
    """The layers each of ``size`` ranks runs under a pipeline split: contiguous, as even as they go."""
    if count < size:
        raise ValueError(f"{size} ranks for {count} layers: a pipeline needs at least one layer a rank")
    bounds = [round(rank * count / size) for rank in range(size + 1)]
    return [range(bounds[rank], bounds[rank + 1]) for rank in range(size)]


def decoder_layers(h, layers: list, states: list, step: Callable, taps: tuple, tap: Callable = lambda h: h):
    """``h`` through every decoder layer: ``step(index, layer, state, h) -> (h, state)``.
    Returns ``(h, features [B, L, len(taps) * F], states)``; a tap is ``tap(h)``
    after its layer.

    Under a pipeline split a rank's tree holds ``{}`` for the layers other
    ranks run (``distributed.pipeline_share``): this rank runs its own, and at
    each boundary between stages every rank takes the finished stage's
    output; at the end the last layer's output and every tap come from their
    owners, so every rank returns the same values. Each hand-over is an
    ``all_sum`` (the owner's value, zeros elsewhere) computed after the
    rank's own ``h``: one chain of collectives, in the same order on every
    rank whatever layers it skips."""
    pipelined = not all(layers)
    if pipelined:
        owner = [rank for rank, stage in enumerate(pipeline_stages(len(layers), mx.distributed.init().size()))
                 for _ in stage]
    tapped, new_states = {}, []
    for index, (layer, state) in enumerate(zip(layers, states)):
        if pipelined and index and owner[index] != owner[index - 1]:
            h = _from_owner(h, bool(layers[index - 1]))
        if layer:
            h, state = step(index, layer, state, h)
            if index in taps:
                tapped[index] = tap(h)
        new_states.append(state)
    if not pipelined:
        return h, concat_taps(tapped, taps), new_states
    outputs = [h] + [tapped.get(index, tap(h)) for index in taps]
    owned = [bool(layers[-1])] + [index in tapped for index in taps]
    flat = mx.concatenate([o.reshape(*o.shape[:2], -1) for o in outputs], axis=-1)
    mine = mx.concatenate([mx.full((o.reshape(*o.shape[:2], -1).shape[-1],), m, mx.bool_)
                           for o, m in zip(outputs, owned)])
    summed = mx.distributed.all_sum(mx.where(mine, flat, 0))
    sizes = [o.reshape(*o.shape[:2], -1).shape[-1] for o in outputs]
    parts = mx.split(summed, list(np.cumsum(sizes[:-1])), axis=-1)
    h = parts[0].reshape(h.shape)
    return h, (mx.concatenate(parts[1:], axis=-1) if taps else None), new_states


def _from_owner(h, mine: bool):
    """``h`` of the rank that owns it, on every rank (an all_sum of it and zeros that follow each rank's own ``h``)."""
    return mx.distributed.all_sum(h if mine else mx.depends(mx.zeros_like(h), h))


def concat_taps(tapped: dict, taps: tuple):
    """``[B, L, F]``: the tapped layers' outputs in ``taps`` order (None without taps)."""
    return mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None


def stopping_at_prompt_end(forward: Callable) -> Callable:
    """The ``prompt_forward`` of a family with recurrent layers: its ``forward``
    with ``keep`` set to each row's prompt tokens in the chunk, so the padding
    past a prompt's end never advances a state (``images`` pass through)."""

    def prompt_forward(spec, params, kv, tokens, start, taps, first, end, **images):
        return forward(spec, params, kv, tokens, start, taps, keep=mx.clip(end - start, 0, tokens.shape[1]), **images)

    return prompt_forward
