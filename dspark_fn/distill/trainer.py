"""Optimising a draft: AdamW with warmup and cosine decay, gradient clipping,
checkpoints in DeepSpec layout with the optimizer state, resume.

The draft's own weights train; the embedding and output head stay the
target's. Batches come from a stream of corpus shards (``corpus.py``), a few
steps per shard, so the corpus never has to fit in memory.
"""

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..checkpoints import SHARED_WITH_TARGET, read_safetensors, save_draft
from ..drafts.heads import DRAFT_VOCAB_KEY
from ..driver import generate
from ..types import Params
from .corpus import Corpus
from .objective import anchor_candidates, corpus_vocabulary, dspark_loss, sample_batch, vocabulary_of

OPTIMIZER_FILE = "optimizer.npz"
STATE_FILE = "trainer_state.json"


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
    steps_per_shard: int = 25  # consecutive steps drawn from one shard before the next is read
    restrict_vocabulary: bool = True  # a full-vocabulary draft's softmax over each shard's tokens


def split_frozen(draft_params: dict) -> tuple[dict, dict]:
    """``(trainable, frozen)``: embedding, output head and draft vocabulary belong to the target."""
    frozen_roots = {key.split(".")[0] for key in SHARED_WITH_TARGET} | {DRAFT_VOCAB_KEY}
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


def checkpoint_weights(arch, spec, trainable: dict, frozen: dict, dtype=mx.float32) -> dict:
    """Trainable tensors (and the draft vocabulary) under their checkpoint keys."""
    tree_key = {arch.key_map(key): key for key in arch.checkpoint_shapes(spec)}
    weights = {tree_key[name]: value.astype(dtype) for name, value in tree_flatten(trainable)}
    if DRAFT_VOCAB_KEY in frozen:
        weights[tree_key[DRAFT_VOCAB_KEY]] = frozen[DRAFT_VOCAB_KEY]
    return weights


def save_checkpoint(directory, arch, spec, config: dict, trainable, frozen, optimizer, step: int, dtype=mx.float32):
    """DeepSpec-format draft plus what ``train`` needs to resume."""
    directory = save_draft(directory, config, checkpoint_weights(arch, spec, trainable, frozen, dtype))
    mx.savez(str(directory / OPTIMIZER_FILE), **dict(tree_flatten(optimizer.state)))
    (directory / STATE_FILE).write_text(json.dumps({"step": step}))
    return directory


def saved_step(directory) -> int:
    """The step of the checkpoint in ``directory`` (0 when there is none)."""
    state = Path(directory) / STATE_FILE
    return json.loads(state.read_text())["step"] if state.is_file() else 0


def resume_state(directory, optimizer: optim.Optimizer, trainable: dict) -> tuple[dict, int]:
    """Weights, optimizer state and step of a checkpoint written by ``save_checkpoint``."""
    directory = Path(directory)
    step = saved_step(directory)
    weights = read_safetensors(directory, "draft checkpoint")
    loaded = tree_unflatten([(key, value) for key, value in weights.items() if key != DRAFT_VOCAB_KEY])
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
    shards: Iterator[Corpus],
    config: TrainConfig,
    out_dir=None,
    draft_config: dict | None = None,
    resume: bool = False,
    evaluate: Callable[[dict], float] | None = None,
    save_dtype=mx.float32,
    on_step: Callable[[int], None] | None = None,
) -> Iterator[Progress]:
    """Train the draft on batches drawn from ``shards`` (``steps_per_shard``
    steps each), yielding a ``Progress`` every ``checkpoint_every`` steps and
    at the end, after saving a checkpoint to ``out_dir`` (when given) and
    scoring ``evaluate(draft_params) -> tau`` (when given). ``resume``
    continues from the checkpoint in ``out_dir``; ``on_step(steps_done)``
    follows every step."""
    trainable, frozen = split_frozen(draft_params)
    optimizer = make_optimizer(config)
    optimizer.init(trainable)
    start = 0
    if resume and out_dir and (Path(out_dir) / STATE_FILE).is_file():
        trainable, start = resume_state(out_dir, optimizer, trainable)
    gradients = loss_and_grad(arch, spec)
    draft_vocabulary = (
        vocabulary_of(np.array(frozen[DRAFT_VOCAB_KEY]), spec.vocab_size) if DRAFT_VOCAB_KEY in frozen else None
    )
    for _ in range(start // config.steps_per_shard):  # a resumed run reads the shards it would have read
        next(shards)
    tic, done_since = time.perf_counter(), 0
    for step in range(start, config.steps):
        if step % config.steps_per_shard == 0 or step == start:
            corpus = next(shards)
            candidates = anchor_candidates(np.array(corpus.loss_mask))
            usable = np.flatnonzero(candidates.any(axis=1))
            if not len(usable):
                raise ValueError("a corpus shard has no response with two tokens: nothing to train on")
            vocabulary = draft_vocabulary or (corpus_vocabulary(corpus, spec.vocab_size) if config.restrict_vocabulary else None)
        rng = np.random.default_rng([config.seed, step])  # a resumed run draws the same batches
        rows = rng.choice(usable, size=config.sequences_per_step, replace=len(usable) < config.sequences_per_step)
        batch = sample_batch(corpus, candidates, rows, config.anchors_per_sequence, rng)
        (loss, parts), grads = gradients(trainable, frozen, batch, vocabulary)
        grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        trainable = optimizer.apply_gradients(grads, trainable)
        mx.eval(trainable, loss, parts, optimizer.state)
        done_since += 1
        finished = step + 1
        if on_step is not None:
            on_step(finished)
        if finished % config.checkpoint_every == 0 or finished == config.steps:
            rate = done_since / (time.perf_counter() - tic)
            if out_dir is not None:
                save_checkpoint(out_dir, arch, spec, draft_config, trainable, frozen, optimizer, finished, save_dtype)
            tau = evaluate(trainable | frozen) if evaluate else None
            parts = {k: v.item() for k, v in parts.items()}
            yield Progress(finished, loss.item(), parts, rate, tau, trainable | frozen)
            tic, done_since = time.perf_counter(), 0
