"""Distillation rates on the embedded target (SmolLM2-135M, float32), the
three stages of ``dspark train`` that take the hours:

- answers: answer tokens per second of the target answering training
  prompts through the library's continuous batching, at several batch sizes
  (the same prompts each time);
- decode: where answering's time goes at each batch size: prefill tokens/s
  and one plain decode step (a token a row) beside mlx-lm's own batched
  decode step over the same prompts;
- features: sequence tokens per second of the teacher-forced feature pass
  (``distill.corpus.build_shard``) beside mlx-lm's own forward over the same
  padded batches, with its output head at every position and without it;
- training: anchor blocks per second of one optimizer step, and where a
  step's time goes (data, context projection, block forward, heads, loss,
  backward, optimizer), each part compiled and timed alone; beside it the
  previous design of the block forward, one copy of the sequence's context
  per anchor block (``length [B * N]``), forward and backward.

    python bench/distill_rates.py                  # every section
    SECTIONS=train ANCHORS=16,64 python bench/distill_rates.py
    SECTIONS=decode BATCHES=16,32,64 python bench/distill_rates.py
    BATCHES=16,32,64 ANSWER_PROMPTS=96 ANSWER_TOKENS=96 SECTIONS=answers python bench/distill_rates.py

Sequences come from the committed corpus (``corpus/*.jsonl.gz``); times are
medians of ``REPEATS`` runs after a warm-up.
"""

import gzip
import json
import os
import time
from pathlib import Path

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from dspark_fn.distill import answers as answering
from dspark_fn.distill import corpus as shards
from dspark_fn.distill import objective, trainer
from dspark_fn.distill.config import draft_config_for, initial_draft
from dspark_fn.drafts import resolve_arch
from dspark_fn.drafts.heads import slot_heads
from dspark_fn.drafts.vocab import frequent_tokens
from dspark_fn.catalog import load_target_named
from dspark_fn.checkpoints import mlx_lm_model
from dspark_fn.targets import resolve_target
from dspark_fn.types import PairSpec, Params
from workloads import median_seconds

CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "smollm2-135m-answers.jsonl.gz"
SECTIONS = os.environ.get("SECTIONS", "answers,decode,features,train").split(",")
BATCHES = [int(b) for b in os.environ.get("BATCHES", "16,32,64").split(",")]
ANSWER_PROMPTS = int(os.environ.get("ANSWER_PROMPTS", "96"))
ANSWER_TOKENS = int(os.environ.get("ANSWER_TOKENS", "96"))
DECODE_PROMPT = int(os.environ.get("DECODE_PROMPT", "128"))  # prompt tokens a row in the decode section
DECODE_STEPS = int(os.environ.get("DECODE_STEPS", "20"))
FEATURE_ROWS = int(os.environ.get("FEATURE_ROWS", "64"))
ANCHORS = [int(a) for a in os.environ.get("ANCHORS", "16,64").split(",")]
SEQUENCES = int(os.environ.get("SEQUENCES", "8"))
LAYERS = int(os.environ.get("LAYERS", "2"))
REPEATS = int(os.environ.get("REPEATS", "5"))
TAPS = (1, 14, 27)
MAX_LENGTH = 512


def warm_median_seconds(fn, repeats: int = REPEATS) -> float:
    """Median over ``repeats`` timed calls after one untimed call (compilation, first allocation)."""
    return median_seconds(fn, repeats, warmups=1)


def corpus_answers(count: int) -> list:
    with gzip.open(CORPUS, "rt") as lines:
        return [answering.Answer(**json.loads(line)) for line, _ in zip(lines, range(count))]


def target():
    config, params, tokenizer = load_target_named(None, dtype=mx.float32)
    adapter = resolve_target(config)
    return config, adapter, adapter.spec_from_config(config), params


def answering_pair(config, adapter, spec, params) -> Params:
    """The target with a fresh one-layer draft, as ``dspark train`` answers (plain target steps)."""
    draft_config = draft_config_for(config, 1)
    arch = resolve_arch(draft_config)
    draft_spec = arch.spec_from_config(draft_config)
    return Params(PairSpec(adapter, spec, arch, draft_spec), params, initial_draft(arch, draft_spec, spec, params))


def answers_section(config, adapter, spec, params) -> None:
    from dspark_fn.chat import stop_tokens
    from dspark_fn.catalog import load_target_named as load

    _, _, tokenizer = load(None)
    pair = answering_pair(config, adapter, spec, params)
    prompts = [("corpus", a.prompt) for a in corpus_answers(ANSWER_PROMPTS)]
    print(f"\nanswers: {len(prompts)} prompts, up to {ANSWER_TOKENS} tokens each")
    print(f"{'batch':>6} {'answer tokens':>14} {'seconds':>8} {'tokens/s':>9}")
    for batch in BATCHES:
        answering.answer_prompts(pair, prompts[:batch], Path(f"/tmp/dspark-bench-warm-{batch}.jsonl"),
                                 target_tokens=10**9, max_new_tokens=8, stop_tokens=stop_tokens(tokenizer),
                                 batch_size=batch)  # compiles this batch's kernels
        path = Path(f"/tmp/dspark-bench-answers-{batch}.jsonl")
        path.unlink(missing_ok=True)
        start = time.perf_counter()
        done = answering.answer_prompts(pair, prompts, path, target_tokens=10**9, max_new_tokens=ANSWER_TOKENS,
                                        stop_tokens=stop_tokens(tokenizer), batch_size=batch)
        seconds = time.perf_counter() - start
        tokens = sum(len(a.answer) for a in done)
        print(f"{batch:>6} {tokens:>14} {seconds:>8.1f} {tokens / seconds:>9.1f}")


def decode_section(config, adapter, spec, params) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from dspark_fn.driver import Decoder

    pair = answering_pair(config, adapter, spec, params)
    model = mlx_lm_model(config, params)
    texts = [a.prompt + a.answer for a in corpus_answers(max(BATCHES) * 2)]
    prompts = [text[:DECODE_PROMPT] for text in texts if len(text) >= DECODE_PROMPT]
    print(f"\ndecode: prompts of {DECODE_PROMPT} corpus tokens, then {DECODE_STEPS} steps of a token a row")
    print(f"{'batch':>6} {'prefill tokens/s':>17} {'decode tokens/s':>16} {'mlx-lm decode tokens/s':>23}")
    for batch in BATCHES:
        rows = prompts[:batch]
        decoder = Decoder(pair, batch, width=1)
        decoder.insert(rows, max_new_tokens=10**6)  # compiles this batch's prefill
        decoder = Decoder(pair, batch, width=1)
        start = time.perf_counter()
        decoder.insert(rows, max_new_tokens=10**6)
        prefill = batch * DECODE_PROMPT / (time.perf_counter() - start)
        ours = warm_median_seconds(decoder.step, DECODE_STEPS)
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(rows), cache=cache))
        last = [mx.zeros((batch, 1), mx.int32)]

        def mlx_lm_step():
            last[0] = mx.argmax(model(last[0], cache=cache)[:, -1:], axis=-1)
            mx.eval(last[0])

        theirs = warm_median_seconds(mlx_lm_step, DECODE_STEPS)
        print(f"{batch:>6} {prefill:>17.1f} {batch / ours:>16.1f} {batch / theirs:>23.1f}")


def features_section(config, adapter, spec, params) -> None:
    rows = sorted(corpus_answers(FEATURE_ROWS), key=lambda a: len(a.prompt) + len(a.answer))
    tokens, _ = shards.sequence_arrays(rows, MAX_LENGTH)
    real = sum(min(MAX_LENGTH, len(a.prompt) + len(a.answer)) for a in rows)
    model = mlx_lm_model(config, params)
    lengths = [min(MAX_LENGTH, len(a.prompt) + len(a.answer)) for a in rows]
    batches = []
    for begin in range(0, len(rows), shards.PASS_ROWS):  # the same padded batches as the feature pass
        used = -(-max(lengths[begin : begin + shards.PASS_ROWS]) // shards.LENGTH_STEP) * shards.LENGTH_STEP
        batches.append(mx.array(tokens[begin : begin + shards.PASS_ROWS, :used]))
    ours = warm_median_seconds(lambda: shards.build_shard(adapter, spec, params, TAPS, rows, MAX_LENGTH), 1)
    with_head = warm_median_seconds(lambda: [mx.eval(model(batch)) for batch in batches], 1)
    backbone = warm_median_seconds(lambda: [mx.eval(model.model(batch)) for batch in batches], 1)
    print(f"\nfeatures: {len(rows)} sequences, {real} tokens (passes of {shards.PASS_ROWS}, each padded to its longest)")
    for name, seconds in (("feature pass (taps + top-16 where the loss reads it)", ours),
                          ("mlx-lm forward, head at every position", with_head),
                          ("mlx-lm forward, no head", backbone)):
        print(f"  {name:<55} {real / seconds:8.1f} tokens/s")


def train_section(config, adapter, spec, params) -> None:
    rows = corpus_answers(shards.SHARD_ROWS)
    corpus = shards.Corpus(**{k: mx.array(v) for k, v in
                              shards.build_shard(adapter, spec, params, TAPS, rows, MAX_LENGTH).items()})
    vocab_ids = frequent_tokens([a.answer for a in corpus_answers(1000)], 4096, spec.vocab_size)
    draft_config = draft_config_for(config, LAYERS, TAPS, 5, 32, draft_vocab=len(vocab_ids))
    arch = resolve_arch(draft_config)
    draft_spec = arch.spec_from_config(draft_config)
    trainable, frozen = trainer.split_frozen(initial_draft(arch, draft_spec, spec, params, vocab_ids=vocab_ids))
    vocabulary = objective.vocabulary_of(np.asarray(vocab_ids), spec.vocab_size)
    candidates = objective.anchor_candidates(np.array(corpus.loss_mask))
    usable = np.flatnonzero(candidates.any(axis=1))
    gradients = trainer.loss_and_grad(arch, draft_spec)
    optimizer = trainer.make_optimizer(trainer.TrainConfig())
    optimizer.init(trainable)
    print(f"\ntraining: {LAYERS}-layer draft, block 5, {SEQUENCES} sequences a step, 4096-token vocabulary")
    for count in ANCHORS:
        rng = np.random.default_rng(0)

        def batch():
            chosen = rng.choice(usable, size=SEQUENCES, replace=False)
            return objective.sample_batch(corpus, candidates, chosen, count, rng)

        fixed = batch()

        def context(tr, fr, b):
            state = arch.init_context(draft_spec, SEQUENCES, b.tokens.shape[1])
            return arch.extend_context(draft_spec, tr | fr, state, b.features, mx.zeros((SEQUENCES,), mx.int32))

        def blocks(tr, fr, b, state):
            anchor_tokens = mx.take_along_axis(b.tokens, b.anchors, axis=1).astype(mx.int32)
            masks = mx.full((SEQUENCES, count, 4), draft_spec.mask_token_id, mx.int32)
            block_ids = mx.concatenate([anchor_tokens[..., None], masks], axis=2).reshape(SEQUENCES, -1)
            return arch.block_forward(draft_spec, tr | fr, state, b.anchors, block_ids)

        context, blocks = mx.compile(context), mx.compile(blocks)
        state = context(trainable, frozen, fixed)
        base, hidden = blocks(trainable, frozen, fixed, state)
        flat = (SEQUENCES * count, 5)
        prev = objective._block_tokens(fixed.tokens, fixed.anchors, 5, 0).reshape(flat)
        forward = mx.compile(lambda tr, fr, b, v: objective.dspark_loss(arch, draft_spec, tr | fr, b, v)[0])
        heads = mx.compile(lambda tr, fr, base, hidden: slot_heads(draft_spec, tr | fr, base.reshape(*flat, -1),
                                                                   hidden.reshape(*flat, -1), prev))
        (_, _), grads = gradients(trainable, frozen, fixed, vocabulary)

        def copied_context_blocks(tr, fr, b):  # the previous design: a context copy per block
            state = [tuple(mx.repeat(x, count, axis=0) for x in layer) for layer in context(tr, fr, b)]
            anchor_tokens = mx.take_along_axis(b.tokens, b.anchors, axis=1).reshape(-1).astype(mx.int32)
            masks = mx.full((SEQUENCES * count, 4), draft_spec.mask_token_id, mx.int32)
            block_ids = mx.concatenate([anchor_tokens[:, None], masks], axis=1)
            return arch.block_forward(draft_spec, tr | fr, state, b.anchors.reshape(-1), block_ids)[0].sum()

        copied = mx.compile(mx.value_and_grad(copied_context_blocks))
        shared = mx.compile(mx.value_and_grad(lambda tr, fr, b: blocks(tr, fr, b, context(tr, fr, b))[0].sum()))

        def update():
            clipped, _ = optim.clip_grad_norm(grads, 1.0)
            mx.eval(optimizer.apply_gradients(clipped, trainable), optimizer.state)

        def step():
            b = batch()
            (loss, _), step_grads = gradients(trainable, frozen, b, vocabulary)
            clipped, _ = optim.clip_grad_norm(step_grads, 1.0)
            mx.eval(optimizer.apply_gradients(clipped, trainable), optimizer.state, loss)

        parts = {
            "data (sample_batch)": warm_median_seconds(lambda: mx.eval(*batch())),
            "context projection": warm_median_seconds(lambda: mx.eval(context(trainable, frozen, fixed))),
            "block forward": warm_median_seconds(lambda: mx.eval(blocks(trainable, frozen, fixed, state))),
            "Markov and confidence heads": warm_median_seconds(lambda: mx.eval(heads(trainable, frozen, base, hidden))),
            "whole loss, forward": warm_median_seconds(lambda: mx.eval(forward(trainable, frozen, fixed, vocabulary))),
            "forward + backward": warm_median_seconds(lambda: mx.eval(gradients(trainable, frozen, fixed, vocabulary))),
            "clip + AdamW": warm_median_seconds(update),
            "blocks, forward + backward": warm_median_seconds(lambda: mx.eval(shared(trainable, frozen, fixed))),
            "  the same, a context copy per block": warm_median_seconds(lambda: mx.eval(copied(trainable, frozen, fixed))),
        }
        whole = warm_median_seconds(step)
        print(f"  {count} anchors a sequence ({SEQUENCES * count} blocks a step): {whole * 1000:.0f} ms a step, "
              f"{SEQUENCES * count / whole:.0f} blocks/s")
        for name, seconds in parts.items():
            print(f"    {name:<30} {seconds * 1000:8.1f} ms")


def main() -> None:
    loaded = target()
    sections = {"answers": answers_section, "decode": decode_section, "features": features_section,
                "train": train_section}
    for name in SECTIONS:
        sections[name](*loaded)


if __name__ == "__main__":
    main()
