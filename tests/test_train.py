"""Draft distillation: the training forward, the loss going down, checkpoints and resume."""

import numpy as np
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dspark_fn import train
from dspark_fn.cache import Cache
from dspark_fn.noise import row_seeds
from dspark_fn.checkpoints import load_draft, load_target
from dspark_fn.drafts import resolve_arch
from dspark_fn.speculate import PairSpec, Params, draft_block
from helpers import build_target, target_config
from numerics import assert_fp32_close

PROMPTS, NEW_TOKENS, HELD_OUT = 24, 40, 4
# fp32 budget (tests/numerics.py): the 6 target layers and the draft layer;
# the widest sum is the MLP (2 * d) or a context of prompt + answer.
BUDGET = dict(layers=7, reduction=128)


def bigram_target(directory, config):
    """A random target with its attention output switched off: each next
    token is a function of the current one, so its answers are learnable."""
    build_target(directory, config, gain=3.0)
    weights = mx.load(str(directory / "model.safetensors"))
    weights = {k: v * 0 if "o_proj" in k else v for k, v in weights.items()}
    mx.save_safetensors(str(directory / "model.safetensors"), weights)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, its own greedy answers to random prompts, a fresh 1-layer draft."""
    root = tmp_path_factory.mktemp("train")
    config = target_config(vocab=128)
    bigram_target(root / "target", config)
    adapter, target_spec, target_params, _ = load_target(root / "target")
    draft_config = train.draft_config_for(config, layers=1, block_size=4, markov_rank=8)
    arch = resolve_arch(draft_config)
    spec = arch.spec_from_config(draft_config)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 120, size=int(rng.integers(3, 10))).tolist() for _ in range(PROMPTS + HELD_OUT)]
    corpus = train.target_corpus(
        adapter, target_spec, target_params, prompts[:PROMPTS], spec.target_layer_ids, NEW_TOKENS, batch_size=8
    )
    draft = train.initial_draft(arch, spec, target_spec, target_params, seed=1)
    params = Params(PairSpec(adapter, target_spec, arch, spec), target_params, draft)
    return dict(root=root, config=draft_config, params=params, corpus=corpus, held_out=prompts[PROMPTS:])


def fixed_batch(corpus, count=8, seed=0):
    rng = np.random.default_rng(seed)
    candidates = train.anchor_candidates(np.array(corpus.loss_mask))
    return train.sample_batch(corpus, candidates, np.arange(4), count, rng)


def tau(params, prompts):
    return train.held_out_tau(params, prompts, NEW_TOKENS)


@pytest.mark.numerics
def test_corpus_holds_the_targets_greedy_answers(setup):
    corpus, params = setup["corpus"], setup["params"]
    spec = params.spec
    mask = np.array(corpus.loss_mask)
    assert (mask.sum(axis=1) == NEW_TOKENS).all()  # no stop token: every answer runs to the budget
    # one teacher-forced target pass over the recorded sequences gives the same taps and argmax
    tokens = corpus.tokens
    kv = spec.target_adapter.init_kv(spec.target, tokens.shape[0], tokens.shape[1])
    hidden, features, _ = spec.target_adapter.forward(
        spec.target, params.target, kv, tokens, mx.zeros((tokens.shape[0],), mx.int32), spec.taps
    )
    greedy = np.array(mx.argmax(spec.target_adapter.logits(spec.target, params.target, hidden), -1))
    answer = mask[:, 1:]  # positions whose next token is part of the answer
    assert (greedy[:, :-1][answer] == np.array(tokens)[:, 1:][answer]).all()
    recorded = mask.copy()
    last_answer_token = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    recorded[np.arange(len(mask)), last_answer_token] = False  # never fed back to the target
    assert_fp32_close(np.array(corpus.features)[recorded], np.array(features)[recorded], "taps", **BUDGET)
    top_mass = np.array(corpus.top_probs).sum(-1)[:, :-1][answer]
    assert ((top_mass > 0) & (top_mass <= 1 + 1e-5)).all()


@pytest.mark.numerics
def test_training_forward_equals_inference_with_context_cut_at_anchor(setup):
    params, corpus = setup["params"], setup["corpus"]
    spec, arch = params.spec.draft, params.spec.draft_arch
    features, tokens = corpus.features[:1], np.array(corpus.tokens[:1])
    length = tokens.shape[1]
    anchors = [15, 27]
    for anchor in anchors:
        # inference: context = features of positions < a, the anchor token pending
        state = arch.init_context(spec, 1, length)
        state = arch.extend_context(spec, params.draft, state, features[:, :anchor], mx.zeros((1,), mx.int32))
        cache = Cache(None, state, mx.array([anchor], mx.int32), row_seeds(0, 1))
        proposal = draft_block(params, cache, mx.array(tokens[:, anchor]))
        # teacher forcing with the drafted tokens makes both chains identical
        tokens[0, anchor + 1 : anchor + spec.block_size] = np.array(proposal.tokens[0, :-1])
        logits, confidence = train.training_forward(
            arch, spec, params.draft, features, mx.array(tokens), mx.array([anchors], mx.int32)
        )
        slot = anchors.index(anchor)
        assert_fp32_close(logits[0, slot], proposal.logits[0], "logits", **BUDGET)
        assert_fp32_close(confidence[0, slot], proposal.confidence_logits[0], "confidence logits", **BUDGET)


def test_loss_falls_and_held_out_tau_rises(setup):
    params, corpus = setup["params"], setup["corpus"]
    spec = params.spec.draft
    batch = fixed_batch(corpus)
    loss_before, _ = train.dspark_loss(params.spec.draft_arch, spec, params.draft, batch)
    tau_before = tau(params, setup["held_out"])
    config = train.TrainConfig(steps=60, learning_rate=3e-3, checkpoint_every=60, anchors_per_sequence=8)
    (last,) = train.train(params.spec.draft_arch, spec, params.draft, corpus, config)
    loss_after, _ = train.dspark_loss(params.spec.draft_arch, spec, last.draft_params, batch)
    tau_after = tau(params._replace(draft=last.draft_params), setup["held_out"])
    assert loss_after.item() < 0.6 * loss_before.item()
    assert tau_after > tau_before + 1.5


def drafted(params, draft, prompt_length=12):
    cache_len = 32
    spec, arch = params.spec.draft, params.spec.draft_arch
    features = mx.random.normal((1, prompt_length, len(spec.target_layer_ids) * spec.hidden_size), key=mx.random.key(3))
    state = arch.extend_context(spec, draft, arch.init_context(spec, 1, cache_len), features, mx.zeros((1,), mx.int32))
    cache = Cache(None, state, mx.array([prompt_length], mx.int32), row_seeds(0, 1))
    return draft_block(params._replace(draft=draft), cache, mx.array([5], mx.int32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_saved_checkpoint_reloads_to_the_same_drafts(setup, tmp_path, dtype):
    params = setup["params"]
    arch, spec = params.spec.draft_arch, params.spec.draft
    trainable, _ = train.split_frozen(params.draft)
    optimizer = train.make_optimizer(train.TrainConfig())
    optimizer.init(trainable)
    out = train.save_checkpoint(tmp_path, arch, spec, setup["config"], trainable, optimizer, 0, dtype)
    stored = mx.load(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    assert {v.dtype for v in stored.values()} == {dtype}
    _, _, reloaded = load_draft(out, params.spec.target, params.target)
    assert {v.dtype for _, v in tree_flatten(reloaded)} == {mx.float32}
    before, after = drafted(params, params.draft), drafted(params, reloaded)
    assert after.tokens.tolist() == before.tokens.tolist()
    tolerance = 0 if dtype == mx.float32 else 5e-2
    np.testing.assert_allclose(np.array(after.logits), np.array(before.logits), atol=tolerance, rtol=tolerance)


def test_resume_continues_from_the_saved_step(setup, tmp_path):
    params, corpus = setup["params"], setup["corpus"]
    arch, spec = params.spec.draft_arch, params.spec.draft
    config = train.TrainConfig(steps=6, learning_rate=3e-3, checkpoint_every=3, anchors_per_sequence=8)
    straight = list(train.train(arch, spec, params.draft, corpus, config))
    out = tmp_path / "run"
    interrupted = train.train(arch, spec, params.draft, corpus, config, out, setup["config"])
    assert next(interrupted).step == 3  # stop after the first checkpoint
    resumed = list(train.train(arch, spec, params.draft, corpus, config, out, setup["config"], resume=True))
    assert [p.step for p in resumed] == [6]
    final, expected = dict(tree_flatten(resumed[-1].draft_params)), dict(tree_flatten(straight[-1].draft_params))
    for name, value in expected.items():
        np.testing.assert_allclose(np.array(final[name]), np.array(value), atol=1e-5, err_msg=name)


def test_default_taps_follow_deepspec():
    assert train.spread_taps(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-4B/8B releases
    assert train.spread_taps(40, 5) == [1, 10, 19, 28, 37]  # Qwen3-14B
    assert train.spread_taps(30, 3) == [1, 14, 27]  # SmolLM2's default draft
