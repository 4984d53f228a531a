"""Reduced draft vocabularies: checkpoints round-trip, drafts stay in the subset, output stays lossless."""

import json

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.checkpoints import save_draft, shared_modules
from dspark_fn.drafts.vocab import frequent_tokens, reduced_checkpoint, widen_vocabulary
from dspark_fn.schedule import CostCurve
from helpers import (
    build_bigram_draft,
    build_draft,
    draft_config,
    build_target,
    damp_attention,
    mlx_lm_greedy,
    random_prompt,
    target_config,
)
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

CONFIG = target_config("qwen3", vocab=96, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
KEEP = 40  # draft vocabulary size


def reduce(directory, out, ids):
    config = json.loads((directory / "config.json").read_text())
    weights = mx.load(str(directory / "model.safetensors"))
    return save_draft(out, *reduced_checkpoint(config, weights, ids))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A damped target its bigram draft predicts often, and the same draft
    restricted to the target's most frequent greedy tokens."""
    root = tmp_path_factory.mktemp("vocab")
    model = damp_attention(root / "target", build_target(root / "target", CONFIG, seed=4, gain=2.0), 0.05)
    build_bigram_draft(root / "full", CONFIG, model, [1], layers=1, taps=(0, 1), block_size=4)
    rng = np.random.default_rng(0)
    answers = [mlx_lm_greedy(model, random_prompt(rng, 5, 96), 30) for _ in range(6)]
    ids = frequent_tokens(answers, KEEP, CONFIG["vocab_size"])
    reduce(root / "full", root / "reduced", ids)
    load = lambda name: dspark_fn.load(root / "target", root / name)  # noqa: E731
    return model, load("full"), load("reduced"), ids, root


def test_frequent_tokens_keeps_the_most_common_and_the_forced():
    ids = frequent_tokens([[5, 5, 5, 7, 7, 9], [7, 3]], 3, 20, always=[19])
    assert ids.tolist() == [5, 7, 19]
    assert frequent_tokens([[2]], 3, 20).tolist() == [0, 1, 2]


def test_reduced_checkpoint_round_trips(pairs):
    """The loaded draft's head and Markov rows are the full draft's rows of
    the subset; its logits are the full draft's at those columns and its
    drafts lie in it."""
    _, full, reduced, ids, _ = pairs
    assert reduced.spec.draft.draft_vocab_size == KEEP
    for name in ("lm_head", "markov_head"):
        whole = full.draft[name]["weight"] if name == "lm_head" else full.draft[name]["markov_w2"]["weight"]
        cut = reduced.draft[name]["weight"] if name == "lm_head" else reduced.draft[name]["markov_w2"]["weight"]
        assert mx.array_equal(cut, whole[mx.array(ids)]), name
    cache, tokens = dspark_fn.prefill(full, dspark_fn.init_cache(full, 1, 64), [3, 1, 4, 1, 5])
    whole = dspark_fn.draft_block(full, cache, tokens)
    cut = dspark_fn.draft_block(reduced, cache, tokens)
    assert_fp32_close(cut.logits, np.array(whole.logits)[..., ids], "logits", layers=4, reduction=96)
    assert set(np.array(cut.tokens).ravel().tolist()) <= set(ids.tolist())


def test_a_shared_head_is_cut_to_the_subset(pairs, tmp_path):
    """A draft without its own head reads the target's, rows of the subset only."""
    root, ids = pairs[-1], pairs[3]
    build_draft(tmp_path / "full", draft_config(CONFIG, layers=1, taps=(0, 1), block_size=4), seed=3)
    params = dspark_fn.load(root / "target", reduce(tmp_path / "full", tmp_path / "reduced", ids))
    head = params.target["model"]["embed_tokens"]["weight"]
    assert mx.array_equal(params.draft["lm_head"]["weight"], head[mx.array(ids)])


def test_a_widened_draft_keeps_its_tokens_rows_and_starts_the_new_ones_unbiased(pairs, tmp_path):
    """Widening a reduced draft to the whole vocabulary gives the full draft
    whose Markov output rows outside the old subset are zero: the same drafts
    and logits."""
    root, ids = pairs[-1], pairs[3]
    build_draft(tmp_path / "full", draft_config(CONFIG, layers=1, taps=(0, 1), block_size=4), seed=3)
    full = dspark_fn.load(root / "target", tmp_path / "full")
    reduced = dspark_fn.load(root / "target", reduce(tmp_path / "full", tmp_path / "reduced", ids))
    head = shared_modules(reduced.spec.target_adapter.layout, reduced.target)["lm_head.weight"]
    everything = np.arange(CONFIG["vocab_size"])
    widened = reduced._replace(draft=widen_vocabulary(reduced.draft, everything[::-1], head))  # any order
    markov = np.array(full.draft["markov_head"]["markov_w2"]["weight"])
    markov[np.setdiff1d(everything, ids)] = 0
    unbiased = full._replace(draft=dict(full.draft, markov_head=dict(full.draft["markov_head"],
                                                                     markov_w2={"weight": mx.array(markov)})))
    cache, tokens = dspark_fn.prefill(full, dspark_fn.init_cache(full, 1, 64), [3, 1, 4, 1, 5])
    expected = dspark_fn.draft_block(unbiased, cache, tokens)
    got = dspark_fn.draft_block(widened, cache, tokens)
    assert np.array(got.tokens).tolist() == np.array(expected.tokens).tolist()
    in_target_order = np.ascontiguousarray(np.array(got.logits)[..., ::-1])
    assert_fp32_close(in_target_order, expected.logits, "logits", layers=4, reduction=96)
    with pytest.raises(ValueError, match="keep the draft's own"):
        widen_vocabulary(reduced.draft, everything[:KEEP], head)
    bigram = pairs[2]  # a draft with an output head of its own
    with pytest.raises(ValueError, match="head of its own"):
        widen_vocabulary(bigram.draft, everything, head)


@pytest.mark.parametrize("width", ["auto", None, 3])
def test_reduced_vocabulary_greedy_equals_the_target(pairs, width):
    model, _, reduced, _, _ = pairs
    costs = CostCurve(0.05, {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08})
    for seed in range(3):
        prompt = random_prompt(np.random.default_rng(seed), 4 + 7 * seed, 96)
        events = list(dspark_fn.generate(reduced, prompt, 80, width=width, costs=costs))
        assert [t for e in events for t in e.emitted] == mlx_lm_greedy(model, prompt, 80)
        assert sum(e.accepted for e in events) > 0  # the subset's drafts are accepted


def test_a_vocabulary_outside_the_target_is_rejected(pairs, tmp_path):
    root = pairs[-1]
    with pytest.raises(ValueError, match="distinct token ids in 0..95"):
        reduced_checkpoint({"vocab_size": 96}, {}, np.array([3, 96]))
    config = json.loads((root / "full" / "config.json").read_text())
    config, weights = reduced_checkpoint(config, mx.load(str(root / "full" / "model.safetensors")), np.arange(KEEP))
    weights["draft_vocab_ids"] = mx.zeros((KEEP,), mx.int32)  # one id, repeated
    save_draft(tmp_path / "bad", config, weights)
    with pytest.raises(ValueError, match="distinct token ids"):
        dspark_fn.load(root / "target", tmp_path / "bad")
