"""Draft distillation at scale, on tiny models: prompts without evaluation
look-alikes, answers from continuous batching (resumable), feature shards
on disk, the training forward, the loss going down, checkpoints and resume.
The whole ``distill`` pipeline also runs on hybrid targets (recurrent layers
beside attention).

Breaks tried, and the tests that catch them:
- shards left-padded instead of right-padded (``sequence_arrays`` writes each
  row at its end): test_distil_end_to_end_writes_a_draft_that_decodes_losslessly[*]
  (a row no longer starts with its sequence);
- the features pass freezing the recurrent states half-way through the
  padded length (``forward(..., keep=length // 2)`` in ``_taps_kernel``):
  test_distil_end_to_end...[qwen3_5] (rows' features differ from their own
  unpadded forward; lfm2's convolution outputs do not depend on ``keep``);
- ``draft_config_for`` reading ``intermediate_size`` unconditionally (LFM2
  configs name it ``block_ff_dim``): test_distil_end_to_end...[lfm2].
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import build_target, mlx_lm_greedy, target_config
from hybrids import HYBRID_SHAPES
from mlx.utils import tree_flatten
from numerics import assert_fp32_close, fp32_bound

from dspark_fn import draft_block, generate
from dspark_fn.cache import Cache
from dspark_fn.checkpoints import load_draft, load_target, save_draft
from dspark_fn.distill import answers as answering
from dspark_fn.distill import config as draft_setup
from dspark_fn.distill import corpus as shards
from dspark_fn.distill import objective, prompts, trainer
from dspark_fn.distill.workers import build_shards_parallel
from dspark_fn.drafts import resolve_arch
from dspark_fn.drafts.vocab import frequent_tokens
from dspark_fn.rng import row_seeds
from dspark_fn.types import PairSpec, Params

PROMPTS, NEW_TOKENS, HELD_OUT, SHARD_ROWS = 24, 40, 4, 8
# fp32 budget (tests/numerics.py): the 6 target layers and the draft layer;
# the widest sum is the MLP (2 * d) or a context of prompt + answer.
BUDGET = dict(layers=7, reduction=128)


def bigram_target(directory, config):
    """A random target with its attention output switched off: each next
    token is a function of the current one, so its answers are learnable."""
    model = build_target(directory, config, gain=3.0)
    weights = mx.load(str(directory / "model.safetensors"))
    weights = {k: v * 0 if "o_proj" in k else v for k, v in weights.items()}
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    model.load_weights(list(weights.items()))
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, its own greedy answers to random prompts (continuous
    batching, 3 rows), their feature shards, a fresh 1-layer draft."""
    root = tmp_path_factory.mktemp("train")
    config = target_config(vocab=128)
    model = bigram_target(root / "target", config)
    adapter, target_spec, target_params, _ = load_target(root / "target")
    draft_config = draft_setup.draft_config_for(config, layers=1, block_size=4, markov_rank=8)
    arch = resolve_arch(draft_config)
    spec = arch.spec_from_config(draft_config)
    draft = draft_setup.initial_draft(arch, spec, target_spec, target_params, seed=1)
    params = Params(PairSpec(adapter, target_spec, arch, spec), target_params, draft)
    rng = np.random.default_rng(0)
    prompt_ids = [rng.integers(0, 120, size=int(rng.integers(3, 10))).tolist() for _ in range(PROMPTS + HELD_OUT)]
    pairs = [("test", p) for p in prompt_ids[:PROMPTS]]
    answers = answering.answer_prompts(params, pairs, root / "answers.jsonl", target_tokens=10**9,
                                       max_new_tokens=NEW_TOKENS, batch_size=3)
    index = shards.build_shards(adapter, target_spec, target_params, spec.target_layer_ids, answers, root / "features",
                                rows=SHARD_ROWS)
    corpus = shards.load_shard(root / "features", index["shards"][0])
    return dict(root=root, model=model, config=draft_config, params=params, answers=answers, index=index,
                corpus=corpus, held_out=prompt_ids[PROMPTS:], pairs=pairs)


def stream(setup):
    return shards.shard_schedule(setup["root"] / "features", setup["index"], seed=0)


def tau(params, prompts):
    return trainer.held_out_tau(params, prompts, NEW_TOKENS)


# ---- prompts


def test_truncated_json_yields_its_complete_objects():
    text = '[{"a": 1}, {"b": [2, 3]},\n {"c": "x'
    assert list(prompts.complete_json_objects(text)) == [{"a": 1}, {"b": [2, 3]}]


def test_evaluation_prompts_and_their_near_copies_are_dropped():
    index = prompts.EvalIndex.bundled()
    gsm8k = prompts.read_jsonl_prompts(prompts.EVAL_DIR / "gsm8k.jsonl")[3]
    question = gsm8k.replace(prompts.MATH_SUFFIX, "")
    assert index.resembles(gsm8k)  # exact
    assert index.resembles(question)  # without the protocol suffix
    assert index.resembles("Hi! " + question.replace(".", " .").upper() + " Thanks.")  # reworded around it
    assert not index.resembles("Write a haiku about autumn leaves falling on a quiet pond at dusk.")
    chosen = prompts.training_prompts(300, sources=("bundled", "math", "code"))
    assert len({p.text for p in chosen}) == len(chosen) == 300
    assert not any(index.resembles(p.text) for p in chosen)
    assert {p.source for p in chosen} == {"bundled", "math", "code"}


# ---- answers


def test_answers_are_the_targets_greedy_continuations(setup):
    """Continuous batching (3 rows refilled as answers end) gives each prompt
    what the target alone writes."""
    assert [a.prompt for a in setup["answers"]] == [p for _, p in setup["pairs"]]
    for answer in setup["answers"][:6]:
        assert answer.answer == mlx_lm_greedy(setup["model"], answer.prompt, NEW_TOKENS)


def test_answers_end_at_a_stop_token_kept_or_at_their_budget(setup, tmp_path):
    """With stop tokens each answer is the target's greedy continuation cut
    after its first stop token (kept), else at the budget: the rule rows of
    the decoder own, which ``generate`` and the server read too."""
    params, pairs, model = setup["params"], setup["pairs"][:9], setup["model"]
    truths = [mlx_lm_greedy(model, prompt, NEW_TOKENS) for _, prompt in pairs]
    stops = {truths[0][3], truths[1][5]}  # tokens two answers write early
    answers = answering.answer_prompts(params, pairs, tmp_path / "answers.jsonl", target_tokens=10**9,
                                       max_new_tokens=NEW_TOKENS, stop_tokens=stops, batch_size=3)
    by_prompt = {tuple(a.prompt): a.answer for a in answers}
    cut = [next((t[: i + 1] for i, token in enumerate(t) if token in stops), t) for t in truths]
    assert [by_prompt[tuple(prompt)] for _, prompt in pairs] == cut
    assert sum(len(c) < NEW_TOKENS for c in cut) >= 2


def test_answering_resumes_after_an_interruption_and_extends(setup, tmp_path):
    """Stopped after some answers, with a torn last line, then run again: the
    file ends as a straight run's; a larger token target extends it."""
    params, pairs = setup["params"], setup["pairs"]
    path = tmp_path / "answers.jsonl"
    answering.answer_prompts(params, pairs, path, target_tokens=5 * NEW_TOKENS, max_new_tokens=NEW_TOKENS, batch_size=3)
    partial = path.read_text().splitlines()
    assert NEW_TOKENS * 5 <= sum(len(json.loads(line)["answer"]) for line in partial) < NEW_TOKENS * 12
    path.write_text("\n".join(partial) + '\n{"source": "test", "prompt": [1, 2')  # torn by Ctrl-C
    resumed = answering.answer_prompts(params, pairs, path, target_tokens=10**9, max_new_tokens=NEW_TOKENS,
                                       batch_size=3)
    assert sorted(map(tuple, (a.prompt for a in resumed))) == sorted(map(tuple, (p for _, p in pairs)))
    by_prompt = {tuple(a.prompt): a.answer for a in setup["answers"]}
    assert all(a.answer == by_prompt[tuple(a.prompt)] for a in resumed)


def test_answering_completes_the_prompts_prefix_whatever_else_the_file_holds(setup, tmp_path):
    """A file already holding answers to later prompts (rows in flight when an
    earlier run stopped): answering still answers every prompt of the
    prefix that holds the token target, which is what the corpus reads."""
    params, pairs = setup["params"], setup["pairs"]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(a._asdict()) + "\n" for a in setup["answers"][12:18]))
    target = 5 * NEW_TOKENS
    answering.answer_prompts(params, pairs, path, target_tokens=target, max_new_tokens=NEW_TOKENS, batch_size=3)
    chosen = answering.prefix_answers(pairs, answering.read_answers(path), target)
    assert [a.prompt for a in chosen] == [p for _, p in pairs[: len(chosen)]]
    assert sum(len(a.answer) for a in chosen) >= target


# ---- corpus shards


@pytest.mark.numerics
def test_shards_hold_teacher_forced_features_and_distributions(setup):
    corpus, params = setup["corpus"], setup["params"]
    spec = params.spec
    mask = np.array(corpus.loss_mask)
    assert mask.sum() == sum(len(a.answer) for a in setup["answers"][:SHARD_ROWS])
    tokens = corpus.tokens
    kv = spec.target_adapter.init_kv(spec.target, tokens.shape[0], tokens.shape[1])
    hidden, features, _ = spec.target_adapter.forward(
        spec.target, params.target, kv, tokens, mx.zeros((tokens.shape[0],), mx.int32), spec.taps
    )
    stored = np.array(corpus.features.astype(mx.float32))[mask]
    expected = np.array(features)[mask]
    assert np.abs(stored - expected).max() <= 1e-3 * np.abs(expected).max()  # stored as float16
    greedy = np.array(mx.argmax(spec.target_adapter.logits(spec.target, params.target, hidden), -1))
    probs = np.array(corpus.top_probs.astype(mx.float32))
    best = np.take_along_axis(np.array(corpus.top_ids), probs.argmax(-1)[..., None], -1)[..., 0]
    assert (best[mask] == greedy[mask]).all()  # the most likely of the top-K is the target's argmax
    assert ((probs.sum(-1)[mask] > 0) & (probs.sum(-1)[mask] <= 1 + 1e-2)).all()


def test_shards_resume_and_refuse_other_taps(setup, tmp_path):
    params, answers = setup["params"], setup["answers"]
    spec = params.spec
    build = lambda answers, taps=spec.taps: shards.build_shards(  # noqa: E731
        spec.target_adapter, spec.target, params.target, taps, answers, tmp_path, rows=SHARD_ROWS
    )
    first = build(answers[:8])
    assert [s["file"] for s in first["shards"]] == ["shard-00000.npz"]
    more = build(answers)
    assert len(more["shards"]) == len(answers) // SHARD_ROWS and more["answers"] == len(more["shards"]) * SHARD_ROWS
    with pytest.raises(ValueError, match="features of taps"):
        build(answers, taps=(0,))


def test_feature_workers_write_what_one_process_writes(setup, tmp_path):
    """Two processes over interleaved windows (the second loading the target
    from its directory) leave the index and every shard of one process; a
    stale shard on disk past the index (other answers) is rebuilt, not adopted."""
    params, answers = setup["params"], setup["answers"]
    spec = params.spec
    args = (spec.target_adapter, spec.target, params.target, spec.taps, answers)
    alone = shards.build_shards(*args, tmp_path / "alone", rows=SHARD_ROWS)
    shards.build_shards(*args[:-1], answers[SHARD_ROWS:], tmp_path / "stale", rows=SHARD_ROWS)
    (tmp_path / "pair").mkdir()
    (tmp_path / "stale" / "shard-00001.npz").rename(tmp_path / "pair" / "shard-00001.npz")
    failures = []
    pair = build_shards_parallel(2, str(setup["root"] / "target"), None, *args, tmp_path / "pair",
                                 max_length=512, rows=SHARD_ROWS, log=failures.append)
    assert not failures
    assert pair == alone and len(alone["shards"]) == len(answers) // SHARD_ROWS >= 3
    for entry in alone["shards"]:
        one, two = np.load(tmp_path / "alone" / entry["file"]), np.load(tmp_path / "pair" / entry["file"])
        assert one.files == two.files
        for name in one.files:
            assert np.array_equal(one[name], two[name]), (entry["file"], name)
    assert sorted(path.name for path in (tmp_path / "pair").iterdir()) == sorted(
        [entry["file"] for entry in alone["shards"]] + [shards.INDEX])


def test_shards_of_more_taps_serve_a_draft_its_own(setup, tmp_path):
    """Shards storing extra tapped layers give a draft exactly the features
    of its own taps, in its order; taps they lack are refused."""
    params, answers = setup["params"], setup["answers"][:SHARD_ROWS]
    spec = params.spec
    stored = sorted(set(spec.taps) | {0, spec.target.num_layers - 1}, reverse=True)
    wide = shards.build_shards(spec.target_adapter, spec.target, params.target, stored, answers, tmp_path / "wide",
                               rows=SHARD_ROWS)
    cut = shards.shard_schedule(tmp_path / "wide", wide, seed=0, taps=spec.taps)(0)
    assert mx.array_equal(cut.features, setup["corpus"].features)  # the same first shard, built with the draft's taps
    with pytest.raises(ValueError, match="store taps"):
        shards.shard_schedule(tmp_path / "wide", wide, seed=0, taps=(spec.target.num_layers + 3,))


# ---- the objective and the optimiser


@pytest.mark.numerics
def test_training_forward_equals_inference_with_context_cut_at_anchor(setup):
    params, corpus = setup["params"], setup["corpus"]
    spec, arch = params.spec.draft, params.spec.draft_arch
    features, tokens = corpus.features[:1].astype(mx.float32), np.array(corpus.tokens[:1])
    length = tokens.shape[1]
    anchors = [15, 27]
    for anchor in anchors:
        # inference: context = features of positions < a, the anchor token pending
        state = arch.init_context(spec, 1, length)
        state = arch.extend_context(spec, params.draft, state, features[:, :anchor], mx.zeros((1,), mx.int32))
        cache = Cache(None, state, mx.array([anchor], mx.int32), row_seeds(0, 1), history=None)
        proposal = draft_block(params, cache, mx.array(tokens[:, anchor]))
        # teacher forcing with the drafted tokens makes both chains identical
        tokens[0, anchor + 1 : anchor + spec.block_size] = np.array(proposal.tokens[0, :-1])
        logits, confidence = objective.training_forward(
            arch, spec, params.draft, features, mx.array(tokens), mx.array([anchors], mx.int32)
        )
        slot = anchors.index(anchor)
        assert_fp32_close(logits[0, slot], proposal.logits[0], "logits", **BUDGET)
        assert_fp32_close(confidence[0, slot], proposal.confidence_logits[0], "confidence logits", **BUDGET)


def fixed_batch(corpus, count=8, seed=0):
    rng = np.random.default_rng(seed)
    candidates = objective.anchor_candidates(np.array(corpus.loss_mask))
    return objective.sample_batch(corpus, candidates, np.arange(4), count, rng)


def test_loss_falls_and_held_out_tau_rises(setup):
    params, corpus = setup["params"], setup["corpus"]
    spec = params.spec.draft
    batch = fixed_batch(corpus)
    loss_before, _ = objective.dspark_loss(params.spec.draft_arch, spec, params.draft, batch)
    tau_before = tau(params, setup["held_out"])
    config = trainer.TrainConfig(steps=60, learning_rate=3e-3, checkpoint_every=60, anchors_per_sequence=8)
    (last,) = trainer.train(params.spec.draft_arch, spec, params.draft, stream(setup), config)
    loss_after, _ = objective.dspark_loss(params.spec.draft_arch, spec, last.draft_params, batch)
    tau_after = tau(params._replace(draft=last.draft_params), setup["held_out"])
    assert loss_after.item() < 0.6 * loss_before.item()
    assert tau_after > tau_before + 1.5


def test_the_loss_mix_is_the_one_asked_for(setup):
    """``loss_weights`` reaches the compiled loss: one term alone is the loss."""
    params = setup["params"]
    for weights, term in (((1.0, 0.0, 0.0), "ce"), ((0.0, 0.0, 1.0), "confidence")):
        config = trainer.TrainConfig(steps=1, checkpoint_every=1, anchors_per_sequence=4, loss_weights=weights)
        (last,) = trainer.train(params.spec.draft_arch, params.spec.draft, params.draft, stream(setup), config)
        assert last.loss == last.parts[term]


def test_a_reduced_vocabulary_draft_trains_and_stays_lossless(setup, tmp_path):
    """A draft proposing from the answers' 48 most frequent tokens: it
    learns, its checkpoint keeps the vocabulary, and greedy output is the
    target's."""
    params, answers = setup["params"], setup["answers"]
    target_spec = params.spec.target
    ids = frequent_tokens([a.answer for a in answers], 48, target_spec.vocab_size)
    config = dict(setup["config"], draft_vocab_size=48)
    arch = resolve_arch(config)
    spec = arch.spec_from_config(config)
    draft = draft_setup.initial_draft(arch, spec, target_spec, params.target, seed=1, vocab_ids=ids)
    pair = params._replace(spec=PairSpec(params.spec.target_adapter, target_spec, arch, spec), draft=draft)
    settings = trainer.TrainConfig(steps=60, learning_rate=3e-3, checkpoint_every=60, anchors_per_sequence=8)
    (last,) = trainer.train(arch, spec, draft, stream(setup), settings, out_dir=tmp_path, draft_config=config)
    _, _, reloaded = load_draft(tmp_path, target_spec, params.target)
    trained = pair._replace(draft=reloaded)
    assert tau(trained, setup["held_out"]) > tau(pair, setup["held_out"]) + 1.0
    for prompt in setup["held_out"][:2]:
        events = generate(trained, prompt, NEW_TOKENS)
        assert [t for e in events for t in e.emitted] == mlx_lm_greedy(setup["model"], prompt, NEW_TOKENS)


def drafted(params, draft, prompt_length=12):
    cache_len = 32
    spec, arch = params.spec.draft, params.spec.draft_arch
    features = mx.random.normal((1, prompt_length, len(spec.target_layer_ids) * spec.hidden_size), key=mx.random.key(3))
    state = arch.extend_context(spec, draft, arch.init_context(spec, 1, cache_len), features, mx.zeros((1,), mx.int32))
    cache = Cache(None, state, mx.array([prompt_length], mx.int32), row_seeds(0, 1), history=None)
    return draft_block(params._replace(draft=draft), cache, mx.array([5], mx.int32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_exported_draft_reloads_to_the_same_drafts(setup, tmp_path, dtype):
    params = setup["params"]
    arch, spec = params.spec.draft_arch, params.spec.draft
    trainable, frozen = trainer.split_frozen(params.draft)
    out = save_draft(tmp_path, setup["config"], trainer.checkpoint_weights(arch, spec, trainable, frozen, dtype))
    stored = mx.load(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    assert {v.dtype for v in stored.values()} == {dtype}
    _, _, reloaded = load_draft(out, params.spec.target, params.target)
    assert {v.dtype for _, v in tree_flatten(reloaded)} == {mx.float32}
    before, after = drafted(params, params.draft), drafted(params, reloaded)
    assert after.tokens.tolist() == before.tokens.tolist()
    tolerance = 0 if dtype == mx.float32 else 5e-2
    np.testing.assert_allclose(np.array(after.logits), np.array(before.logits), atol=tolerance, rtol=tolerance)


def test_resume_continues_exactly_from_the_saved_step(setup, tmp_path):
    """Stopped after its first checkpoint and started again, a run ends with
    the weights of a run never stopped, bit for bit, though it exports a
    float16 draft; a checkpoint of other settings is refused."""
    params = setup["params"]
    arch, spec = params.spec.draft_arch, params.spec.draft
    config = trainer.TrainConfig(steps=6, learning_rate=3e-3, checkpoint_every=3, anchors_per_sequence=8,
                                 steps_per_shard=2)
    run = dict(draft_config=setup["config"], save_dtype=mx.float16)
    straight = list(trainer.train(arch, spec, params.draft, stream(setup), config, out_dir=tmp_path / "a", **run))
    out = tmp_path / "run"
    interrupted = trainer.train(arch, spec, params.draft, stream(setup), config, out_dir=out, **run)
    assert next(interrupted).step == 3  # stop after the first checkpoint
    assert trainer.saved_step(out) == 3 and trainer.saved_step(tmp_path / "none") == 0
    followed = []
    resumed = list(trainer.train(arch, spec, params.draft, stream(setup), config, out_dir=out, on_step=followed.append,
                                 **run))
    assert [p.step for p in resumed] == [6]
    assert followed == [4, 5, 6]
    assert [f.name for f in (out / trainer.CHECKPOINTS).iterdir()] == ["step-00000006"]  # older ones removed
    final, expected = dict(tree_flatten(resumed[-1].draft_params)), dict(tree_flatten(straight[-1].draft_params))
    for name, value in expected.items():
        assert mx.array_equal(final[name], value), name
    other = trainer.TrainConfig(**dict(config.__dict__, learning_rate=1e-3))
    with pytest.raises(ValueError, match="other settings .*learning_rate"):
        next(trainer.train(arch, spec, params.draft, stream(setup), other, out_dir=out, **run))


def test_default_taps_follow_deepspec():
    assert draft_setup.spread_taps(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-4B/8B releases
    assert draft_setup.spread_taps(40, 5) == [1, 10, 19, 28, 37]  # Qwen3-14B
    assert draft_setup.spread_taps(30, 3) == [1, 14, 27]  # SmolLM2's default draft


def write_qwen3_release(directory):
    from published import qwen3_pair

    qwen3_pair(tied=True, taps=[1, 2, 3])(directory, directory.parent / "unused")


def hybrid_release(name: str):
    """A tiny hybrid target with a chat tokenizer, as ``distill`` reads a release."""

    def write(directory):
        from published import qwen_tokenizer

        build_target(directory, dict(HYBRID_SHAPES[name], vocab_size=320), seed=3, vector_spread=0.4)
        qwen_tokenizer(directory)

    return write


RELEASES = {"qwen3": write_qwen3_release, "lfm2": hybrid_release("lfm2"), "qwen3_5": hybrid_release("qwen3_5")}


def check_shard_rows_as_alone(target_source, features_dir, answers):
    """Each row of the first shard is one answered sequence, right-padded,
    marked for loss over its answer, with the features the sequence has
    when run alone (float16-rounded): padding reaches no kept row."""
    from dspark_fn.catalog import load_target_named
    from dspark_fn.targets import resolve_target

    config, target_params, _ = load_target_named(target_source, dtype=mx.float32)
    adapter = resolve_target(config)
    spec = adapter.spec_from_config(config)
    index = shards.read_index(features_dir)
    corpus = shards.load_shard(features_dir, index["shards"][0])
    tokens, masks = np.array(corpus.tokens), np.array(corpus.loss_mask)
    stored = np.array(corpus.features.astype(mx.float32))
    # the widest sums: the MLP (2 d) or the padded sequence
    noise = fp32_bound(stored, layers=spec.num_layers, reduction=max(tokens.shape[1], 2 * spec.hidden_size))
    half_ulp = np.finfo(np.float16).eps / 2
    for row in range(tokens.shape[0]):
        (answer,) = [a for a in answers if tokens[row, : len(a.prompt) + len(a.answer)].tolist() == a.prompt + a.answer]
        length = len(answer.prompt) + len(answer.answer)
        assert np.flatnonzero(masks[row]).tolist() == list(range(len(answer.prompt), length)), f"row {row} mask"
        _, alone, _ = adapter.forward(spec, target_params, adapter.init_kv(spec, 1, length),
                                      mx.array(tokens[row : row + 1, :length]), mx.zeros((1,), mx.int32),
                                      tuple(index["taps"]))
        expected = np.array(alone[0])
        bound = half_ulp * np.abs(expected) + (1 + half_ulp) * noise  # float16 of a value within fp32 noise
        assert (np.abs(stored[row, :length] - expected) <= bound).all(), f"row {row} features"


@pytest.mark.parametrize("family", sorted(RELEASES))
def test_distil_end_to_end_writes_a_draft_that_decodes_losslessly(family, tmp_path):
    """``distill`` from nothing: prompts, answers (the target's greedy ones),
    shards, a reduced-vocabulary draft; run again, every stage resumes and
    nothing is redone. The trained draft decodes as the target alone."""
    from mlx_lm.utils import load_model

    from dspark_fn import distill
    from dspark_fn.catalog import load_named

    RELEASES[family](tmp_path / "target")
    setup = distill.DistillConfig(taps=(1, 3), block_size=4, markov_rank=8, draft_vocab=64, answer_tokens=600,
                                 max_new_tokens=48, sources=("bundled",), answer_batch=4, shard_rows=4, held_out=2,
                                 eval_new_tokens=24)
    config = trainer.TrainConfig(steps=4, checkpoint_every=4, anchors_per_sequence=4, sequences_per_step=2)
    bars = {}

    class Bar:  # records what each stage's progress bar was told
        def __init__(self, total, label, done=0):
            self.total, self.start, self.n, self.updates = total, done, done, []
            bars[label] = self

        def update(self, count):
            self.n += count
            self.updates.append(count)

        def set_postfix(self, **_):
            pass

        def close(self):
            pass

    last = distill.distill(str(tmp_path / "target"), tmp_path / "run", setup, config, log=lambda line: None,
                          progress=Bar)
    assert last.step == 4 and last.tau >= 1
    assert bars["train steps"].updates == [1, 1, 1, 1]  # the training bar follows every step
    answers = answering.read_answers(tmp_path / "run" / "answers.jsonl")
    assert sum(len(a.answer) for a in answers) >= 600
    covered = bars["features"].n
    bars.clear()
    again = distill.distill(str(tmp_path / "target"), tmp_path / "run", setup, config,
                           log=lambda line: None, progress=Bar)
    assert again is None  # the checkpoint already holds every step
    # resumed stages start their bars at the work already done, none redone
    assert "answer tokens" not in bars
    assert (bars["features"].start, bars["features"].updates) == (covered, [])
    assert (bars["train steps"].start, bars["train steps"].updates) == (4, [])
    assert answering.read_answers(tmp_path / "run" / "answers.jsonl") == answers
    params, _, _ = load_named(str(tmp_path / "target"), str(tmp_path / "run" / "draft"), dtype=mx.float32)
    assert params.spec.draft.draft_vocab_size == 64
    model, _ = load_model(tmp_path / "target")
    model.set_dtype(mx.float32)
    for answer in answers[:3]:
        assert answer.answer == mlx_lm_greedy(model, answer.prompt, len(answer.answer))
    check_shard_rows_as_alone(str(tmp_path / "target"), tmp_path / "run" / "features", answers)
    prompt = answers[0].prompt
    assert [t for e in generate(params, prompt, 24) for t in e.emitted] == mlx_lm_greedy(model, prompt, 24)


def test_a_warm_restart_widens_the_drafts_vocabulary_and_stays_lossless(tmp_path):
    """``--init-draft`` with a larger ``--draft-vocab``: the draft keeps its
    own tokens, adds the answers' most frequent, trains on and decodes as the
    target alone; a smaller vocabulary is refused by name."""
    from mlx_lm.utils import load_model

    from dspark_fn import distill
    from dspark_fn.catalog import load_named

    write_qwen3_release(tmp_path / "target")
    common = dict(taps=(1, 3), block_size=4, markov_rank=8, answer_tokens=600, max_new_tokens=48,
                  sources=("bundled",), answer_batch=4, shard_rows=4, held_out=2, eval_new_tokens=24)
    config = trainer.TrainConfig(steps=2, checkpoint_every=2, anchors_per_sequence=4, sequences_per_step=2)
    quiet = dict(log=lambda line: None)
    distill.distill(str(tmp_path / "target"), tmp_path / "first", distill.DistillConfig(draft_vocab=48, **common),
                    config, **quiet)
    (tmp_path / "warm").mkdir()
    for item in ("answers.jsonl", "features"):  # the first run's corpus, as a later run on the same answers reads it
        (tmp_path / "warm" / item).symlink_to(tmp_path / "first" / item)
    warm = distill.DistillConfig(draft_vocab=80, init_draft=str(tmp_path / "first" / "draft"), **common)
    last = distill.distill(str(tmp_path / "target"), tmp_path / "warm", warm, config, **quiet)
    assert last.step == 2
    before, _, _ = load_named(str(tmp_path / "target"), str(tmp_path / "first" / "draft"), dtype=mx.float32)
    params, _, _ = load_named(str(tmp_path / "target"), str(tmp_path / "warm" / "draft"), dtype=mx.float32)
    own, widened = (np.array(p.draft["draft_vocab_ids"]).tolist() for p in (before, params))
    assert len(widened) == 80 and set(own) < set(widened)
    model, _ = load_model(tmp_path / "target")
    model.set_dtype(mx.float32)
    prompt = answering.read_answers(tmp_path / "first" / "answers.jsonl")[0].prompt
    assert [t for e in generate(params, prompt, 24) for t in e.emitted] == mlx_lm_greedy(model, prompt, 24)
    narrower = distill.DistillConfig(draft_vocab=32, init_draft=str(tmp_path / "first" / "draft"), **common)
    with pytest.raises(ValueError, match="--draft-vocab 32: .* proposes from 48 tokens"):
        distill.distill(str(tmp_path / "target"), tmp_path / "narrow", narrower, config, **quiet)
