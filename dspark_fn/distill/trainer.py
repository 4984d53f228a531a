"""Optimising a draft: AdamW with warmup and cosine decay, gradient clipping,
checkpoints that resume exactly.

The draft's own weights train; the embedding and output head stay the
target's. Batches come from corpus shards (``corpus.py``), a few steps per
shard, so the corpus never has to fit in memory. Everything random is a
function of the seed and the step (the shard of each group of steps, the
rows and anchors of each batch), so a checkpoint needs no random state.

A checkpoint is one folder, ``checkpoints/step-N``, holding the float32
weights, the optimizer state and the step with the run's settings; it
appears whole in one rename, and the previous one is removed only after.
A run killed at any moment and started again continues from the newest
complete checkpoint and ends with the weights of a run never killed. Beside
the checkpoints the draft itself is exported in DeepSpec layout (in
``save_dtype``) at every checkpoint.
"""

import json
import shutil
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .. import atomic
from ..checkpoints import SHARED_WITH_TARGET, save_draft, write_safetensors
from ..drafts.heads import DRAFT_VOCAB_KEY
from ..driver import generate
from ..types import Params
from .corpus import Corpus
from .objective import LOSS_WEIGHTS, anchor_candidates, corpus_vocabulary, dspark_loss, sample_batch, vocabulary_of

CHECKPOINTS = "checkpoints"
WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE = "weights.safetensors", "optimizer.safetensors", "state.json"


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
    loss_weights: tuple = LOSS_WEIGHTS  # CE, L1, confidence BCE


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
def loss_and_grad(arch, spec, weights: tuple = LOSS_WEIGHTS):
    """Compiled ``(trainable, frozen, batch, vocabulary) -> ((loss, parts), grads)``, one
    trace per draft shape and loss mix; the optimizer update stays outside (it is cheap)."""

    def loss_fn(trainable, frozen, batch, vocabulary):
        return dspark_loss(arch, spec, trainable | frozen, batch, vocabulary, weights)

    return mx.compile(mx.value_and_grad(loss_fn))


def checkpoint_weights(arch, spec, trainable: dict, frozen: dict, dtype=mx.float32) -> dict:
    """Trainable tensors (and the draft vocabulary) under their checkpoint keys."""
    tree_key = {arch.key_map(key): key for key in arch.checkpoint_shapes(spec)}
    weights = {tree_key[name]: value.astype(dtype) for name, value in tree_flatten(trainable)}
    if DRAFT_VOCAB_KEY in frozen:
        weights[tree_key[DRAFT_VOCAB_KEY]] = frozen[DRAFT_VOCAB_KEY]
    return weights


def latest_checkpoint(out_dir) -> Path | None:
    """The newest complete checkpoint folder under ``out_dir`` (None when there is none)."""
    folders = sorted((Path(out_dir) / CHECKPOINTS).glob("step-*"))
    complete = [folder for folder in folders if not folder.name.endswith(atomic.TEMPORARY)]
    return complete[-1] if complete else None


def saved_step(out_dir) -> int:
    """The step of the newest checkpoint under ``out_dir`` (0 when there is none)."""
    latest = latest_checkpoint(out_dir)
    return json.loads((latest / STATE_FILE).read_text())["step"] if latest else 0


def save_checkpoint(out_dir, settings: dict, trainable: dict, optimizer: optim.Optimizer, step: int) -> Path:
    """The folder ``checkpoints/step-N`` (whole or not at all), then the older ones removed."""
    def fill(folder: Path) -> None:
        write_safetensors(folder / WEIGHTS_FILE, dict(tree_flatten(trainable)))
        write_safetensors(folder / OPTIMIZER_FILE, dict(tree_flatten(optimizer.state)))
        atomic.write_text(folder / STATE_FILE, json.dumps({"step": step, "settings": settings}))

    folder = atomic.write_folder(Path(out_dir) / CHECKPOINTS / f"step-{step:08d}", fill)
    for old in folder.parent.glob("step-*"):  # older checkpoints, and folders a kill left half written
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _dotted(tree, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {key: value for name, child in tree.items()
            for key, value in _dotted(child, f"{prefix}.{name}" if prefix else name).items()}


def resume_state(folder: Path, settings: dict, optimizer: optim.Optimizer, trainable: dict) -> tuple[dict, int]:
    """Weights, optimizer state and step of a checkpoint of a run with these ``settings``."""
    state = json.loads((folder / STATE_FILE).read_text())
    if state["settings"] != settings:
        saved, given = _dotted(state["settings"]), _dotted(settings)
        changed = sorted(key for key in set(saved) | set(given) if saved.get(key) != given.get(key))
        raise ValueError(
            f"{folder.parent} holds a training run with other settings ({', '.join(changed)} differ): "
            f"give the same settings to continue it, or another output folder to start a new run"
        )
    loaded = tree_unflatten(list(mx.load(str(folder / WEIGHTS_FILE)).items()))
    trainable = tree_map(lambda old, new: new, trainable, {k: loaded[k] for k in trainable})
    optimizer.state = tree_unflatten(list(mx.load(str(folder / OPTIMIZER_FILE)).items()))
    return trainable, state["step"]


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
    shards: Callable[[int], Corpus],
    config: TrainConfig,
    *,
    out_dir=None,
    draft_config: dict | None = None,
    evaluate: Callable[[dict], float] | None = None,
    save_dtype=mx.float32,
    on_step: Callable[[int], None] | None = None,
    depends_on: dict | None = None,
) -> Iterator[Progress]:
    """Train the draft on batches drawn from ``shards(n)`` (the corpus shard
    of the n-th group of ``steps_per_shard`` steps), yielding a ``Progress``
    every ``checkpoint_every`` steps and at the end, after checkpointing to
    ``out_dir`` (when given: the draft is exported there, resumable state in
    ``out_dir/checkpoints``) and scoring ``evaluate(draft_params) -> tau``
    (when given). A checkpoint in ``out_dir`` is continued, exactly, when
    it was written with the same settings, draft config and ``depends_on``
    (what else the run reads, such as the corpus); ``on_step(steps_done)``
    follows every step."""
    trainable, frozen = split_frozen(draft_params)
    optimizer = make_optimizer(config)
    optimizer.init(trainable)
    settings = json.loads(json.dumps({"train": asdict(config), "draft": draft_config, **(depends_on or {})}))  # as a checkpoint reads back
    start = 0
    latest = latest_checkpoint(out_dir) if out_dir is not None else None
    if latest is not None:
        trainable, start = resume_state(latest, settings, optimizer, trainable)
    gradients = loss_and_grad(arch, spec, tuple(config.loss_weights))
    draft_vocabulary = (
        vocabulary_of(np.array(frozen[DRAFT_VOCAB_KEY]), spec.vocab_size) if DRAFT_VOCAB_KEY in frozen else None
    )
    tic, done_since = time.perf_counter(), 0
    for step in range(start, config.steps):
        if step % config.steps_per_shard == 0 or step == start:
            corpus = shards(step // config.steps_per_shard)
            candidates = anchor_candidates(np.array(corpus.loss_mask))
            usable = np.flatnonzero(candidates.any(axis=1))
            if not len(usable):
                raise ValueError("a corpus shard has no response with two tokens: nothing to train on")
            vocabulary = draft_vocabulary or (corpus_vocabulary(corpus, spec.vocab_size) if config.restrict_vocabulary else None)
        rng = np.random.default_rng([config.seed, step])
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
            if out_dir is not None:  # the draft first: a kill between the two redoes steps that export the same (test_train_kills)
                save_draft(out_dir, draft_config, checkpoint_weights(arch, spec, trainable, frozen, save_dtype))
                save_checkpoint(out_dir, settings, trainable, optimizer, finished)
            tau = evaluate(trainable | frozen) if evaluate else None
            parts = {k: v.item() for k, v in parts.items()}
            yield Progress(step=finished, loss=loss.item(), parts=parts, steps_per_second=rate, tau=tau,
                           draft_params=trainable | frozen)
            tic, done_since = time.perf_counter(), 0
