"""Distil a DSpark draft from its target (DeepSpec recipe, spec §2.4).

The pipeline, each stage a function over plain arrays:

1. ``target_corpus``: the target answers the prompts itself (greedy, batched);
   the same decode pass records, for every position, the tapped features and
   the target's top-K next-token distribution, so nothing is recomputed later.
2. ``training_forward``: with a fixed anchor ``a`` the training logits equal the
   inference path with the context cut to positions ``< a``, so training reuses
   the draft's own ``extend_context`` (whole sequence, once) and
   ``block_forward`` (one block per anchor, ``length = a``).
3. ``dspark_loss``: 0.1 CE + 0.9 L1(p_d, p_t) + 1.0 confidence BCE, weighted
   by ``exp(-k / 4)`` over the contiguous valid prefix of each block.
4. ``train``: AdamW with warmup + cosine decay and gradient clipping over the
   draft's own weights (embedding and head stay the target's), checkpoints in
   DeepSpec layout plus optimizer state so a run resumes where it stopped.
"""

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .checkpoints import SHARED_WITH_TARGET, draft_params_from_weights, read_safetensors, save_draft
from .drafts.heads import confidence_logit, markov_bias, markov_embedding
from .drafts.init import random_draft_weights
from .drafts.vocab import restrict_vocabulary
from .speculate import Params, generate

LOSS_DECAY = 4.0  # DeepSpec ``loss_decay_gamma``: slot k weighs exp(-k / 4)
CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
TOP_K = 16  # target distribution kept per position (greedy targets are peaked)
OPTIMIZER_FILE = "optimizer.npz"
STATE_FILE = "trainer_state.json"


# ----------------------------------------------------------------------------
# Draft configuration
# ----------------------------------------------------------------------------


def spread_taps(num_target_layers: int, count: int) -> list:
    """DeepSpec/DFlash default taps: from layer 1 to layer N-3, evenly spread."""
    if count == 1:
        return [1]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def draft_config_for(
    target_config: dict,
    layers: int = 1,
    taps: Sequence[int] | None = None,
    block_size: int = 5,
    markov_rank: int = 32,
    mask_token_id: int | None = None,
) -> dict:
    """A DeepSpec qwen3 draft config for ``target_config`` (a copy of the
    target's geometry plus the DSpark keys)."""
    depth = target_config["num_hidden_layers"]
    heads = target_config["num_attention_heads"]
    config = {
        key: target_config[key]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    }
    config.update(
        model_type="qwen3",
        architectures=["Qwen3DSparkModel"],
        num_key_value_heads=target_config.get("num_key_value_heads", heads),
        head_dim=target_config.get("head_dim") or target_config["hidden_size"] // heads,
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-6),
        rope_theta=target_config.get("rope_theta", 10000.0),
        rope_scaling=target_config.get("rope_scaling"),
        max_position_embeddings=target_config.get("max_position_embeddings", 4096),
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        num_hidden_layers=layers,
        layer_types=["full_attention"] * layers,
        num_target_layers=depth,
        target_layer_ids=list(taps) if taps else spread_taps(depth, 3),
        block_size=block_size,
        mask_token_id=target_config["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=markov_rank > 0,
    )
    return config


def initial_draft(arch, spec, target_spec, target_params: dict, seed: int = 0) -> dict:
    """Fresh draft parameters around the target's own embedding and output head."""
    weights = random_draft_weights(arch, spec, seed=seed)
    weights = {key: value for key, value in weights.items() if key not in SHARED_WITH_TARGET}
    return draft_params_from_weights(arch, spec, weights, target_params, target_spec)


# ----------------------------------------------------------------------------
# Corpus: target responses with their features and distributions
# ----------------------------------------------------------------------------


class Corpus(NamedTuple):
    """Prompt + target response per row, right-padded to one length ``S``.

    loss_mask marks response tokens (the target's own, up to and including a
    stop token); ``top_ids/top_probs`` at position ``t`` describe the target's
    distribution of the token at ``t + 1``.
    """

    tokens: mx.array  # [N, S] int32
    loss_mask: mx.array  # [N, S] bool
    features: mx.array  # [N, S, F] concatenated target taps
    top_ids: mx.array  # [N, S, K] int32
    top_probs: mx.array  # [N, S, K] float32


def _top_k(logits: mx.array, k: int):
    ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    probs = mx.take_along_axis(mx.softmax(logits, axis=-1), ids, axis=-1)
    return ids.astype(mx.int32), probs


@lru_cache(maxsize=None)
def _decode_kernel(adapter, spec, taps: tuple, k: int):
    """One target step over ``tokens [B, L]``: taps, top-K of the next token, argmax."""

    def step(params, kv, tokens, start):
        hidden, features, kv = adapter.forward(spec, params, kv, tokens, start, taps)
        logits = adapter.logits(spec, params, hidden)
        ids, probs = _top_k(logits, k)
        return features, ids, probs, mx.argmax(logits, axis=-1).astype(mx.int32), kv

    return mx.compile(step)


def _respond(adapter, spec, params, prompts, taps, max_new_tokens, stop_tokens, prompt_width, k):
    """Greedy responses for one batch of prompts (all rows padded to
    ``prompt_width``); returns numpy arrays in corpus layout."""
    batch = len(prompts)
    width = prompt_width + max_new_tokens
    lengths = np.array([len(p) for p in prompts])
    step = _decode_kernel(adapter, spec, tuple(taps), k)
    kv = adapter.init_kv(spec, batch, width)
    padded = mx.array([p + [0] * (prompt_width - len(p)) for p in prompts], mx.int32)
    features, ids, probs, choice, kv = step(params, kv, padded, mx.zeros((batch,), mx.int32))
    token = choice[mx.arange(batch), mx.array(lengths - 1)]
    tokens = np.zeros((batch, width), np.int32)
    tokens[:, :prompt_width] = np.array(padded)
    feats = np.zeros((batch, width, features.shape[-1]), np.float32)
    feats[:, :prompt_width] = np.array(features)
    top_ids = np.zeros((batch, width, k), np.int32)
    top_probs = np.zeros((batch, width, k), np.float32)
    top_ids[:, :prompt_width], top_probs[:, :prompt_width] = np.array(ids), np.array(probs)
    loss_mask = np.zeros((batch, width), bool)
    alive = np.ones(batch, bool)
    for i in range(max_new_tokens):
        at = lengths + i
        token_np = np.array(token)
        tokens[np.arange(batch), at] = token_np
        loss_mask[np.arange(batch), at] = alive
        alive &= ~np.isin(token_np, list(stop_tokens))
        if i == max_new_tokens - 1 or not alive.any():
            break
        features, ids, probs, choice, kv = step(params, kv, token[:, None], mx.array(at, mx.int32))
        feats[np.arange(batch), at] = np.array(features[:, 0])
        top_ids[np.arange(batch), at] = np.array(ids[:, 0])
        top_probs[np.arange(batch), at] = np.array(probs[:, 0])
        token = choice[:, 0]
    return tokens, loss_mask, feats, top_ids, top_probs


def target_corpus(
    adapter,
    spec,
    params: dict,
    prompts: Sequence[Sequence[int]],
    taps: Sequence[int],
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
    batch_size: int = 16,
    top_k: int = TOP_K,
    progress: Callable[[int, int], None] | None = None,
    prompt_width: int | None = None,
) -> Corpus:
    """The target answers every prompt greedily (``batch_size`` at a time);
    one decode pass yields tokens, taps and top-K next-token distributions.
    Rows are ``prompt_width`` (default: the longest prompt) + ``max_new_tokens`` long."""
    prompt_width = prompt_width or max(len(p) for p in prompts)
    parts = []
    for begin in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[begin : begin + batch_size]]
        chunk += [chunk[-1]] * (batch_size - len(chunk))  # fixed batch: one compile
        arrays = _respond(adapter, spec, params, chunk, taps, max_new_tokens, stop_tokens, prompt_width, top_k)
        keep = min(batch_size, len(prompts) - begin)
        parts.append([a[:keep] for a in arrays])
        if progress:
            progress(begin + keep, len(prompts))
    return Corpus(*(mx.array(np.concatenate(column)) for column in zip(*parts)))


def save_corpus(path, corpus: Corpus) -> None:
    mx.savez(str(path), **corpus._asdict())


def load_corpus(path) -> Corpus:
    arrays = mx.load(str(path))
    return Corpus(**{name: arrays[name] for name in Corpus._fields})


# ----------------------------------------------------------------------------
# Training forward and loss
# ----------------------------------------------------------------------------


class Batch(NamedTuple):
    tokens: mx.array  # [B, S]
    loss_mask: mx.array  # [B, S]
    features: mx.array  # [B, S, F]
    top_ids: mx.array  # [B, S, K]
    top_probs: mx.array  # [B, S, K]
    anchors: mx.array  # [B, N] anchor positions
    anchor_valid: mx.array  # [B, N] bool (False for padding anchors)


def training_forward(arch, spec, params: dict, features, tokens, anchors):
    """Draft logits for every anchor block of every sequence.

    ``features [B, S, F]``, ``tokens [B, S]``, ``anchors [B, N]``. The context
    is projected once per sequence, then each anchor's block attends to the
    context slots ``< a`` (``length = a``), as at inference.
    Returns Markov-corrected logits ``[B, N, G, V]`` and confidence logits
    ``[B, N, G]`` with teacher-forced previous tokens ``tok_{a+k}``.
    """
    batch, length = tokens.shape
    count = anchors.shape[1]
    block = spec.block_size
    state = arch.init_context(spec, batch, length)
    state = arch.extend_context(spec, params, state, features, mx.zeros((batch,), mx.int32))
    state = tree_map(lambda x: mx.repeat(x, count, axis=0), state)  # one copy per anchor
    flat_anchors = anchors.reshape(-1)
    anchor_tokens = mx.take_along_axis(tokens, anchors, axis=1).reshape(-1)
    masks = mx.full((batch * count, block - 1), spec.mask_token_id, mx.int32)
    block_ids = mx.concatenate([anchor_tokens[:, None].astype(mx.int32), masks], axis=1)
    base, hidden = arch.block_forward(spec, params, state, flat_anchors, block_ids)
    prev = _block_tokens(tokens, anchors, block, 0).reshape(batch * count, block)
    logits, confidence = teacher_forced_heads(spec, params, base, hidden, prev)
    shape = (batch, count, block)
    return logits.reshape(*shape, -1), confidence.reshape(shape)


def teacher_forced_heads(spec, params, base_logits, hidden, prev):
    """Markov correction and confidence logits with the given previous tokens
    (the ground truth in training) instead of the drafted ones."""
    if not spec.markov_rank:
        embedding = None
        logits = base_logits
    else:
        embedding = markov_embedding(params, prev)
        logits = base_logits + markov_bias(params, embedding)
    if spec.confidence_head:
        confidence = confidence_logit(spec, params, hidden, embedding)
    else:
        confidence = mx.zeros(prev.shape, mx.float32)
    return logits, confidence


def _block_tokens(values, anchors, block, offset):
    """``values[b, a + offset + k]`` for k < block, clipped to the sequence: ``[B, N, G, ...]``."""
    length = values.shape[1]
    index = mx.clip(anchors[..., None] + offset + mx.arange(block), 0, length - 1)
    flat = index.reshape(index.shape[0], -1)
    if values.ndim == 2:
        return mx.take_along_axis(values, flat, axis=1).reshape(index.shape)
    gathered = mx.take_along_axis(values, flat[..., None], axis=1)
    return gathered.reshape(*index.shape, values.shape[-1])


def slot_weights(batch: Batch, block: int) -> mx.array:
    """``exp(-k/4)`` on each block's contiguous prefix of valid labels, else 0."""
    length = batch.tokens.shape[1]
    label_index = batch.anchors[..., None] + 1 + mx.arange(block)
    in_sequence = label_index < length
    in_response = _block_tokens(batch.loss_mask, batch.anchors, block, 1) & in_sequence
    valid = mx.cumprod(in_response.astype(mx.float32), axis=-1) * batch.anchor_valid[..., None]
    return valid * mx.exp(-mx.arange(block) / LOSS_DECAY)


class Vocabulary(NamedTuple):
    """The tokens a corpus can be scored on, and each token's place among them."""

    ids: mx.array  # [V'] sorted token ids
    index: mx.array  # [V] place of each token in ``ids`` (0 for absent ones)


def corpus_vocabulary(corpus: Corpus, vocab_size: int) -> Vocabulary:
    """Response tokens and the target's top-K candidates after them: the
    only tokens with target mass to match. Scoring the draft's softmax over
    them instead of the whole vocabulary makes each step several times
    cheaper on a large vocabulary; the rest carried no target mass anyway."""
    mask = np.array(corpus.loss_mask)
    used = np.union1d(np.array(corpus.tokens)[mask], np.array(corpus.top_ids)[mask])
    index = np.zeros(vocab_size, np.int32)
    index[used] = np.arange(len(used))
    return Vocabulary(mx.array(used.astype(np.int32)), mx.array(index))


def dspark_loss(arch, spec, params: dict, batch: Batch, vocabulary: Vocabulary | None = None):
    """``0.1 CE + 0.9 L1 + 1.0 BCE`` (spec §2.4). ``p_t`` is the target's
    top-K; the L1 distance counts the draft's mass outside it as error.
    With a ``vocabulary`` the draft's softmax runs over those tokens only."""
    block = spec.block_size
    labels = _block_tokens(batch.tokens, batch.anchors, block, 1)
    top_ids = _block_tokens(batch.top_ids, batch.anchors, block, 0)
    if vocabulary is not None:
        params = restrict_vocabulary(params, vocabulary.ids)
        labels, top_ids = vocabulary.index[labels], vocabulary.index[top_ids]
    logits, confidence = training_forward(arch, spec, params, batch.features, batch.tokens, batch.anchors)
    weights = slot_weights(batch, block)
    top_probs = _block_tokens(batch.top_probs, batch.anchors, block, 0)
    log_p = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -mx.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]
    p_draft_top = mx.exp(mx.take_along_axis(log_p, top_ids, axis=-1))
    outside = mx.maximum(1.0 - p_draft_top.sum(-1), 0.0) - mx.maximum(1.0 - top_probs.sum(-1), 0.0)
    l1 = mx.abs(p_draft_top - top_probs).sum(-1) + mx.abs(outside)
    soft_label = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    bce = mx.logaddexp(0.0, confidence) - confidence * soft_label
    total = mx.maximum(weights.sum(), 1e-6)
    parts = {name: (x * weights).sum() / total for name, x in (("ce", ce), ("l1", l1), ("confidence", bce))}
    loss = CE_WEIGHT * parts["ce"] + L1_WEIGHT * parts["l1"] + CONFIDENCE_WEIGHT * parts["confidence"]
    return loss, parts


# ----------------------------------------------------------------------------
# Anchors and batches
# ----------------------------------------------------------------------------


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions ``a`` with ``loss_mask[a] = loss_mask[a + 1] = 1``."""
    ok = np.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return ok


def sample_batch(corpus: Corpus, candidates: np.ndarray, rows: np.ndarray, count: int, rng) -> Batch:
    """Up to ``count`` anchors per row, uniformly without replacement, sorted."""
    anchors = np.zeros((len(rows), count), np.int32)
    valid = np.zeros((len(rows), count), bool)
    for i, row in enumerate(rows):
        positions = np.flatnonzero(candidates[row])
        chosen = np.sort(rng.choice(positions, size=min(count, len(positions)), replace=False))
        anchors[i, : len(chosen)], valid[i, : len(chosen)] = chosen, True
    index = mx.array(rows)
    return Batch(
        corpus.tokens[index],
        corpus.loss_mask[index],
        corpus.features[index],
        corpus.top_ids[index],
        corpus.top_probs[index],
        mx.array(anchors),
        mx.array(valid),
    )


# ----------------------------------------------------------------------------
# Optimisation, checkpoints, evaluation
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    learning_rate: float = 6e-4
    warmup_fraction: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    sequences_per_step: int = 4
    anchors_per_sequence: int = 16
    seed: int = 0
    checkpoint_every: int = 100
    restrict_vocabulary: bool = True  # softmax over the corpus's tokens (see corpus_vocabulary)


def split_frozen(draft_params: dict) -> tuple[dict, dict]:
    """``(trainable, frozen)``: embedding and output head belong to the target."""
    frozen_roots = {key.split(".")[0] for key in SHARED_WITH_TARGET}
    trainable = {k: v for k, v in draft_params.items() if k not in frozen_roots}
    frozen = {k: v for k, v in draft_params.items() if k in frozen_roots}
    return trainable, frozen


def make_optimizer(config: TrainConfig) -> optim.Optimizer:
    warmup = max(1, round(config.warmup_fraction * config.steps))
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(0.0, config.learning_rate, warmup),
            optim.cosine_decay(config.learning_rate, max(1, config.steps - warmup), 0.1 * config.learning_rate),
        ],
        [warmup],
    )
    return optim.AdamW(schedule, weight_decay=config.weight_decay)


@lru_cache(maxsize=None)
def loss_and_grad(arch, spec):
    """Compiled ``(trainable, frozen, batch, vocabulary) -> ((loss, parts), grads)``, one
    trace per draft shape; the optimizer update stays outside (it is cheap)."""

    def loss_fn(trainable, frozen, batch, vocabulary):
        return dspark_loss(arch, spec, trainable | frozen, batch, vocabulary)

    return mx.compile(mx.value_and_grad(loss_fn))


def checkpoint_weights(arch, spec, trainable: dict, dtype=mx.float32) -> dict:
    """Trainable tensors under their checkpoint keys (shared tensors omitted)."""
    tree_key = {arch.key_map(key): key for key in arch.checkpoint_shapes(spec)}
    return {tree_key[name]: value.astype(dtype) for name, value in tree_flatten(trainable)}


def save_checkpoint(directory, arch, spec, config: dict, trainable, optimizer, step: int, dtype=mx.float32):
    """DeepSpec-format draft plus what ``train`` needs to resume."""
    directory = save_draft(directory, config, checkpoint_weights(arch, spec, trainable, dtype))
    mx.savez(str(directory / OPTIMIZER_FILE), **dict(tree_flatten(optimizer.state)))
    (directory / STATE_FILE).write_text(json.dumps({"step": step}))
    return directory


def resume_state(directory, optimizer: optim.Optimizer, trainable: dict) -> tuple[dict, int]:
    """Weights, optimizer state and step of a checkpoint written by ``save_checkpoint``."""
    directory = Path(directory)
    step = json.loads((directory / STATE_FILE).read_text())["step"]
    weights = read_safetensors(directory, "draft checkpoint")
    loaded = tree_unflatten(list(weights.items()))
    trainable = tree_map(lambda old, new: new.astype(old.dtype), trainable, {k: loaded[k] for k in trainable})
    optimizer.state = tree_unflatten(list(mx.load(str(directory / OPTIMIZER_FILE)).items()))
    return trainable, step


def held_out_tau(params: Params, prompts, max_new_tokens: int, stop_tokens=(), width=None) -> float:
    """Mean tokens per verify round (accepted drafts + 1) over greedy
    generations of ``prompts`` (decoded together as one batch)."""
    emitted, rounds = 0, 0
    for event in generate(params, [list(p) for p in prompts], max_new_tokens, width=width, stop_tokens=stop_tokens):
        if event.kind == "round":
            emitted, rounds = emitted + event.accepted + 1, rounds + 1
    return emitted / max(rounds, 1)


class Progress(NamedTuple):
    step: int
    loss: float
    parts: dict  # the unweighted ce / l1 / confidence terms
    steps_per_second: float
    tau: float | None
    draft_params: dict


def train(
    arch,
    spec,
    draft_params: dict,
    corpus: Corpus,
    config: TrainConfig,
    out_dir=None,
    draft_config: dict | None = None,
    resume: bool = False,
    evaluate: Callable[[dict], float] | None = None,
    save_dtype=mx.float32,
) -> Iterator[Progress]:
    """Train the draft on ``corpus``, yielding a ``Progress`` every
    ``checkpoint_every`` steps and at the end, after saving a checkpoint to
    ``out_dir`` (when given) and scoring ``evaluate(draft_params) -> tau``
    (when given). ``resume`` continues from the checkpoint in ``out_dir``."""
    trainable, frozen = split_frozen(draft_params)
    optimizer = make_optimizer(config)
    optimizer.init(trainable)
    start = 0
    if resume and out_dir and (Path(out_dir) / STATE_FILE).is_file():
        trainable, start = resume_state(out_dir, optimizer, trainable)
    gradients = loss_and_grad(arch, spec)
    vocabulary = corpus_vocabulary(corpus, spec.vocab_size) if config.restrict_vocabulary else None
    candidates = anchor_candidates(np.array(corpus.loss_mask))
    usable = np.flatnonzero(candidates.any(axis=1))
    if not len(usable):
        raise ValueError("the corpus has no response with two tokens: nothing to train on")
    tic, done_since = time.perf_counter(), 0
    for step in range(start, config.steps):
        rng = np.random.default_rng([config.seed, step])  # a resumed run draws the same batches
        rows = rng.choice(usable, size=config.sequences_per_step, replace=len(usable) < config.sequences_per_step)
        batch = sample_batch(corpus, candidates, rows, config.anchors_per_sequence, rng)
        (loss, parts), grads = gradients(trainable, frozen, batch, vocabulary)
        grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        trainable = optimizer.apply_gradients(grads, trainable)
        mx.eval(trainable, loss, parts, optimizer.state)
        done_since += 1
        finished = step + 1
        if finished % config.checkpoint_every == 0 or finished == config.steps:
            rate = done_since / (time.perf_counter() - tic)
            if out_dir is not None:
                save_checkpoint(out_dir, arch, spec, draft_config, trainable, optimizer, finished, save_dtype)
            tau = evaluate(trainable | frozen) if evaluate else None
            parts = {k: v.item() for k, v in parts.items()}
            yield Progress(finished, loss.item(), parts, rate, tau, trainable | frozen)
            tic, done_since = time.perf_counter(), 0


# ----------------------------------------------------------------------------
# End to end: target + prompts file -> trained draft directory
# ----------------------------------------------------------------------------

CORPUS_FILE = "corpus.npz"
DEFAULT_PROMPTS = Path(__file__).parent / "data" / "train_prompts.jsonl"


def load_training_target(source=None):
    """``(adapter, spec, params, config, tokenizer)`` of a target directory or
    a llama ``.gguf`` file; ``None`` is the embedded SmolLM2-135M-Instruct."""
    from . import gguf
    from .checkpoints import load_target, load_tokenizer
    from .targets import resolve_target

    if source is None or str(source).endswith(".gguf"):
        config, params, tokenizer = gguf.load_gguf_llama(source or gguf.find_smollm2_gguf())
        adapter = resolve_target(config)
        return adapter, adapter.spec_from_config(config), params, config, tokenizer
    adapter, spec, params, config = load_target(source)
    return adapter, spec, params, config, load_tokenizer(source)


@dataclass(frozen=True)
class DistilConfig:
    """What ``distil`` needs beyond the optimiser settings."""

    layers: int = 1
    taps: tuple | None = None  # default: spread_taps(target depth, 3)
    block_size: int = 5
    markov_rank: int = 32
    mask_token_id: int | None = None  # default: the last vocabulary row
    max_new_tokens: int = 160
    n_prompts: int | None = None  # training prompts used (default: all but the held-out)
    held_out: int = 8  # the file's last prompts, never trained on, score tau
    generation_batch: int = 16
    eval_new_tokens: int = 128
    save_dtype: str = "float16"


def distil(target_source, prompts_path, out_dir, setup: DistilConfig, config: TrainConfig, resume=False, log=print):
    """Train a DSpark draft for a target from a prompts ``.jsonl`` (``turns``
    or ``prompt`` per line) into ``out_dir`` (DeepSpec layout, resumable).
    The corpus is saved as ``out_dir/corpus.npz`` and reused when present.
    Returns the last ``Progress``."""
    from .checkpoints import check_draft_fits
    from .drafts import resolve_arch
    from .evaluate import chat_tokens, first_turns, stop_tokens
    from .speculate import PairSpec

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter, target_spec, target_params, target_config, tokenizer = load_training_target(target_source)
    if tokenizer is None:
        raise ValueError(f"target {target_source} has no tokenizer: cannot read text prompts")
    texts = first_turns(str(prompts_path))
    if len(texts) <= setup.held_out:
        raise ValueError(f"{prompts_path} has {len(texts)} prompts; need more than the {setup.held_out} held out")
    train_texts, held_texts = texts[: len(texts) - setup.held_out], texts[len(texts) - setup.held_out :]
    train_texts = train_texts[: setup.n_prompts]
    stops = stop_tokens(tokenizer)
    draft_config = draft_config_for(
        target_config, setup.layers, setup.taps, setup.block_size, setup.markov_rank, setup.mask_token_id
    )
    arch = resolve_arch(draft_config)
    spec = arch.spec_from_config(draft_config)
    check_draft_fits(spec, target_spec)

    corpus_path = out_dir / CORPUS_FILE
    if corpus_path.is_file():
        corpus = load_corpus(corpus_path)
        if corpus.features.shape[-1] != len(spec.target_layer_ids) * spec.hidden_size:
            raise ValueError(f"{corpus_path} holds features of other taps; delete it or use another --out")
        log(f"reusing {corpus_path}: {corpus.tokens.shape[0]} answers")
    else:
        tic = time.perf_counter()
        prompts = [chat_tokens(tokenizer, text) for text in train_texts]
        corpus = target_corpus(
            adapter, target_spec, target_params, prompts, spec.target_layer_ids, setup.max_new_tokens, stops,
            setup.generation_batch, progress=lambda done, total: log(f"answers {done}/{total}"),
        )
        save_corpus(corpus_path, corpus)
        tokens = int(np.array(corpus.loss_mask).sum())
        log(f"corpus: {tokens} response tokens in {time.perf_counter() - tic:.0f} s")

    params = Params(PairSpec(adapter, target_spec, arch, spec), target_params, None)
    held_out = [chat_tokens(tokenizer, text) for text in held_texts]

    def evaluate(draft_params):
        return held_out_tau(params._replace(draft=draft_params), held_out, setup.eval_new_tokens, stops)

    draft = initial_draft(arch, spec, target_spec, target_params, seed=config.seed)
    dtype = getattr(mx, setup.save_dtype)
    last = None
    for last in train(arch, spec, draft, corpus, config, out_dir, draft_config, resume, evaluate, dtype):
        parts = " ".join(f"{name} {value:.3f}" for name, value in last.parts.items())
        log(f"step {last.step}/{config.steps} loss {last.loss:.4f} ({parts}) "
            f"{last.steps_per_second:.2f} steps/s held-out tau {last.tau:.2f}")
    return last
