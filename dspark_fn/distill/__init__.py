"""Distil a DSpark draft from its target (DeepSpec recipe, spec §2.4), in stages
that each keep their progress on disk, so a run resumes and grows:

1. ``prompts``: training prompts from the bundled file, ShareGPT and
   templates, with every evaluation prompt's exact and near duplicates dropped;
2. ``answers``: the target answers them (greedy) through the library's own
   continuous batching, into ``answers.jsonl`` (token ids);
3. ``corpus``: batched teacher-forced target passes turn the answers of the
   prompts' prefix that holds the token target into on-disk shards of
   features and top-K distributions;
4. ``objective`` + ``trainer``: the DeepSpec loss over anchor blocks, AdamW,
   checkpoints that resume exactly, the draft exported in DeepSpec format.

Every file a stage writes appears whole or not at all, so a run killed at
any moment and started again ends as one never killed. ``config`` builds
the draft's configuration and first weights.
"""

import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ..checkpoints import check_draft_fits, load_draft, shared_modules
from ..drafts import resolve_arch
from ..drafts.heads import DRAFT_VOCAB_KEY
from ..drafts.vocab import frequent_tokens, widen_vocabulary
from ..targets import resolve_target
from ..types import PairSpec, Params
from .answers import answer_prompts, prefix_answers, read_answers, single_stream_speed
from .config import draft_config_for, initial_draft
from .corpus import build_shards, read_index, shard_schedule
from .workers import build_shards_parallel
from .prompts import BUNDLED, Prompt, read_jsonl_prompts, training_prompts
from .trainer import TrainConfig, held_out_tau, saved_step, train

ANSWERS_FILE = "answers.jsonl"
FEATURES_DIR = "features"
DRAFT_DIR = "draft"


@dataclass(frozen=True)
class DistillConfig:
    """What ``distill`` needs beyond the optimiser settings."""

    layers: int = 1
    taps: tuple | None = None  # default: spread_taps(target depth, 3)
    feature_taps: tuple | None = None  # taps the feature shards store (default: the draft's); a superset serves drafts of other taps
    block_size: int = 5
    markov_rank: int = 32
    draft_vocab: int = 0  # propose from the answers' most frequent tokens (0: all; a warm restart: its own)
    mask_token_id: int | None = None  # default: the last vocabulary row
    answer_tokens: int = 1_000_000  # answer tokens to collect before training
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256
    sources: tuple = ("bundled", "sharegpt", "math", "code")
    prompts_file: str | None = None  # a .jsonl of extra prompts, used first
    answer_batch: int = 16
    shard_rows: int = 64  # answers per feature shard (one shard is in memory at a time)
    feature_workers: int = 1  # processes of the features pass (each holds the target)
    held_out: int = 8  # the bundled file's last prompts, never trained on, score tau
    held_out_file: str | None = None  # a .jsonl of prompts never trained on that score tau instead
    eval_new_tokens: int = 128
    save_dtype: str = "float16"
    dtype: str | None = "float32"  # the target's compute dtype while distilling (None: as stored)
    init_draft: str | None = None  # start from this draft's weights, fresh optimizer (a warm restart)


def prompt_ids(setup: DistillConfig, tokenizer, held_out: set) -> list[tuple[str, list]]:
    """Chat-templated token ids of the training prompts, none held out, none too long."""
    from ..chat import chat_tokens

    extra = [Prompt("file", text) for text in read_jsonl_prompts(setup.prompts_file)] if setup.prompts_file else []
    count = max(1000, setup.answer_tokens // 60)  # answers average well over 60 tokens
    ids = []
    for prompt in extra + training_prompts(count, sources=setup.sources):
        if prompt.text in held_out:
            continue
        tokens = chat_tokens(tokenizer, prompt.text)
        if len(tokens) <= setup.max_prompt_tokens:
            ids.append((prompt.source, tokens))
    return ids


def check_widening(own: int, size: int) -> None:
    """Refuse a warm restart's ``--draft-vocab`` that would narrow its draft's own ``own`` tokens (0: all)."""
    if size and size != own and (not own or size < own):
        have = f"proposes from {own} tokens" if own else "proposes from the whole vocabulary"
        raise ValueError(f"--draft-vocab {size}: the warm restart's draft {have}, and a warm restart can only "
                         "widen a reduced vocabulary (leave --draft-vocab out to keep it)")


def widened(params: Params, draft_config: dict, size: int, answers, stops) -> tuple:
    """``(draft_config, spec, params)`` of a warm restart's draft proposing
    from ``size`` tokens: its own and then the answers' most frequent."""
    target_spec = params.spec.target
    keep = np.array(params.draft[DRAFT_VOCAB_KEY]).tolist()
    ids = frequent_tokens([a.answer for a in answers], size, target_spec.vocab_size, always=[*keep, *stops])
    head = shared_modules(params.spec.target_adapter.layout, params.target)["lm_head.weight"]
    draft_config = {**draft_config, "draft_vocab_size": len(ids)}
    spec = params.spec.draft_arch.spec_from_config(draft_config)
    draft = widen_vocabulary(params.draft, ids, head)
    return draft_config, spec, params._replace(spec=replace(params.spec, draft=spec), draft=draft)


def distill(target_source, out_dir, setup: DistillConfig, config: TrainConfig,
           log: Callable[[str], None] = print, progress=None) -> object:
    """Train a DSpark draft for a target into ``out_dir/draft`` (DeepSpec
    layout), every stage resuming from what ``out_dir`` holds. ``progress``
    (``tqdm``-like factory: ``progress(total, label, done)``) shows each stage with
    its ETA. Returns the last ``Progress`` (None when the checkpoint already
    holds every step)."""
    from ..catalog import load_target_named
    from ..chat import chat_tokens, stop_tokens

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_config, target_params, tokenizer = load_target_named(
        target_source, dtype=getattr(mx, setup.dtype) if setup.dtype else None
    )
    if tokenizer is None:
        raise ValueError(f"target {target_source} has no tokenizer: cannot read text prompts")
    adapter = resolve_target(target_config)
    target_spec = adapter.spec_from_config(target_config)
    stops = stop_tokens(tokenizer)
    bundled = read_jsonl_prompts(BUNDLED)
    held_texts = bundled[len(bundled) - setup.held_out :]
    scored_texts = read_jsonl_prompts(setup.held_out_file) if setup.held_out_file else held_texts

    def draft_for(vocab_ids):
        draft_config = draft_config_for(
            target_config, setup.layers, setup.taps, setup.block_size, setup.markov_rank, setup.mask_token_id,
            draft_vocab=len(vocab_ids) if vocab_ids is not None else 0,
        )
        arch = resolve_arch(draft_config)
        spec = arch.spec_from_config(draft_config)
        check_draft_fits(spec, target_spec)
        draft = initial_draft(arch, spec, target_spec, target_params, seed=config.seed, vocab_ids=vocab_ids)
        return draft_config, arch, spec, Params(PairSpec(adapter, target_spec, arch, spec), target_params, draft)

    # 1-2: the target's own answers (plain target steps; the fresh draft only keeps its context)
    if setup.init_draft:
        arch, spec, draft = load_draft(setup.init_draft, target_spec, target_params)
        draft_config = json.loads((Path(setup.init_draft) / "config.json").read_text())
        check_widening(spec.draft_vocab_size, setup.draft_vocab)  # before hours of answering, not after
        params = Params(PairSpec(adapter, target_spec, arch, spec), target_params, draft)
    else:
        _, _, spec, params = draft_for(None)
    prompts = prompt_ids(setup, tokenizer, set(held_texts) | set(scored_texts))
    answered = prefix_answers(prompts, read_answers(out / ANSWERS_FILE), setup.answer_tokens)
    have = sum(len(a.answer) for a in answered)
    if have < setup.answer_tokens and len(answered) < len(prompts):
        log(f"answering: a single stream decodes {single_stream_speed(params, prompts[0][1], 32, stops):.1f} tokens/s")
        bar = progress(setup.answer_tokens, "answer tokens", have) if progress else None

        def on_answer(count, tokens):
            if bar is not None:
                bar.update(tokens - bar.n)
                bar.set_postfix(answers=count)

        answer_prompts(params, prompts, out / ANSWERS_FILE, target_tokens=setup.answer_tokens,
                       max_new_tokens=setup.max_new_tokens, stop_tokens=stops, batch_size=setup.answer_batch,
                       on_answer=on_answer)
        if bar is not None:
            bar.close()
    answers = prefix_answers(prompts, read_answers(out / ANSWERS_FILE), setup.answer_tokens)
    log(f"answers: {len(answers)}, {sum(len(a.answer) for a in answers)} tokens")

    # 3: features on disk
    bar = progress(len(answers), "features", read_index(out / FEATURES_DIR)["answers"]) if progress else None
    stored_taps = setup.feature_taps or spec.target_layer_ids
    build = (build_shards if setup.feature_workers <= 1 else
             partial(build_shards_parallel, setup.feature_workers,
                     None if target_source is None else str(target_source), setup.dtype, log=log))
    index = build(adapter, target_spec, target_params, stored_taps, answers, out / FEATURES_DIR,
                  setup.max_prompt_tokens + setup.max_new_tokens,
                  on_shard=lambda done, total: bar.update(done - bar.n) if bar else None,
                  rows=setup.shard_rows)
    if bar is not None:
        bar.close()
    if not index["shards"]:
        raise ValueError("not enough answers for one corpus shard yet: answer more prompts first")

    # 4: the draft (its vocabulary from the answers, or a warm restart's own, widened by the answers when asked),
    # trained over the shards
    if not setup.init_draft:
        vocab_ids = None
        if setup.draft_vocab:
            vocab_ids = frequent_tokens([a.answer for a in answers], setup.draft_vocab, target_spec.vocab_size, stops)
        draft_config, arch, spec, params = draft_for(vocab_ids)
    elif setup.draft_vocab and setup.draft_vocab != spec.draft_vocab_size:
        draft_config, spec, params = widened(params, draft_config, setup.draft_vocab, answers, stops)
    held_out = [chat_tokens(tokenizer, text) for text in scored_texts]

    def evaluate(draft_params):
        return held_out_tau(params._replace(draft=draft_params), held_out, setup.eval_new_tokens, stops)

    corpus = {"corpus": {"answers": index["answers"], "shards": len(index["shards"])}, "init_draft": setup.init_draft}
    bar = progress(config.steps, "train steps", saved_step(out / DRAFT_DIR)) if progress else None
    on_step = (lambda done: bar.update(done - bar.n)) if bar is not None else None
    last = None
    shards = shard_schedule(out / FEATURES_DIR, index, config.seed, spec.target_layer_ids)
    for last in train(arch, spec, params.draft, shards, config, out_dir=out / DRAFT_DIR, draft_config=draft_config, evaluate=evaluate,
                      save_dtype=getattr(mx, setup.save_dtype), on_step=on_step, depends_on=corpus):
        parts = " ".join(f"{name} {value:.3f}" for name, value in last.parts.items())
        log(f"step {last.step}/{config.steps} loss {last.loss:.4f} ({parts}) "
            f"{last.steps_per_second:.2f} steps/s held-out tau {last.tau:.2f}")
    if bar is not None:
        bar.close()
    return last
