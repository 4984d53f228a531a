"""Hybrid targets through the whole engine: every family in ``hybrids.HYBRID_SHAPES``
(recurrent layers beside attention) decodes exactly as mlx-lm's own model.

Breaks tried, and the tests that catch them:
- no rollback (``cache.settle_entry`` keeps the state after all W tokens):
  test_verify_keeps_exactly_the_right_prefix[partly-right / always-wrong],
  test_rows_accepting_unevenly_decode_as_alone, test_generate_equals_target_greedy;
- the convolution window shifted by one (``PendingWindow`` read from ``count + 1``): the same;
- the state restored one position late (``PendingStates`` read at ``count + 1``): the same;
- prompt padding entering the state (``prompt_forward`` without ``keep``):
  test_generate_equals_target_greedy, test_a_stored_state_is_reused_only_at_its_length;
- the prompt cache reusing a state at a shorter length (no length check in
  ``PromptCache.lookup``): test_a_stored_state_is_reused_only_at_its_length;
- an idle row's recurrent state settled as if it had committed (``settle``
  given ``accepted + 1`` for every row in ``rounds.verify_and_commit``):
  test_idle_rows_commit_nothing_recurrent_states_included;
- prompts sharing a context scored through a cut of it (``score_prompts``
  taking no account of recurrent states):
  test_prompts_sharing_a_context_are_scored_whole.
"""

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.prompt_cache import scoring as prefix_scoring
from dspark_fn.buffers import capacity_for
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.serve.engine import PromptCache
from helpers import (
    PROPOSALS, build_draft, build_target, drive_proposals, mlx_lm_greedy, random_prompt, speculative_tokens, wrong_token,
)
from hybrids import HYBRID_SHAPES, hybrid_draft_config
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

NEW_TOKENS = 200


@pytest.fixture(scope="module", params=sorted(HYBRID_SHAPES))
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    config = HYBRID_SHAPES[request.param]
    model = build_target(root / "target", config, seed=3, vector_spread=0.4)
    last = config["num_hidden_layers"] - 1
    build_draft(root / "draft", hybrid_draft_config(config, taps=(0, last - 1), block_size=5), seed=1)
    return model, dspark_fn.load(root / "target", root / "draft"), config["vocab_size"]


def test_the_target_does_not_repeat_itself(pair):
    """The tiny targets must write varied text, or greedy equality proves little."""
    model, _, vocab = pair
    stream = mlx_lm_greedy(model, random_prompt(np.random.default_rng(0), 13, vocab), NEW_TOKENS)
    assert len(set(stream)) >= 20


@pytest.mark.parametrize("prompt_length, width", [(13, None), (300, None), (40, "auto")])
def test_generate_equals_target_greedy(pair, prompt_length, width):
    """300 tokens prefill in a 256-token chunk then a padded 64-token one, growing the cache."""
    model, params, vocab = pair
    prompt = random_prompt(np.random.default_rng(prompt_length), prompt_length, vocab)
    assert speculative_tokens(params, prompt, NEW_TOKENS, width=width) == mlx_lm_greedy(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("kind", sorted(PROPOSALS))
def test_verify_keeps_exactly_the_right_prefix(pair, kind):
    """Every accepted count 0..W-1 (partly-right cycles through them), W, and none."""
    model, params, vocab = pair
    drive_proposals(model, params, vocab, [random_prompt(np.random.default_rng(11), 17, vocab)], kind, NEW_TOKENS)


def test_rows_accepting_unevenly_decode_as_alone(pair):
    """Three rows in one verify, each right for a different number of slots every round."""
    model, params, vocab = pair
    rng = np.random.default_rng(12)
    prompts = [random_prompt(rng, n, vocab) for n in (5, 17, 9)]
    drive_proposals(model, params, vocab, prompts, "partly-right", 60, shift=2)


def test_idle_rows_commit_nothing_recurrent_states_included(pair):
    """Rows passed ``active=False`` commit nothing, their recurrent states
    included: two rows, each idle on alternate rounds, each decode the
    target's greedy stream."""
    model, params, vocab = pair
    rng = np.random.default_rng(6)
    prompts = [random_prompt(rng, n, vocab) for n in (11, 6)]
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 2, 256), prompts)
    streams = [[token] for token in tokens.tolist()]
    for round_index in range(24):
        active = [round_index % 2 == 0, round_index % 2 == 1]
        before = cache.length.tolist()
        cache, result = dspark_fn.speculate(params, cache, tokens, active=mx.array(active))
        for row, (moving, count, length) in enumerate(zip(active, result.count.tolist(), cache.length.tolist())):
            if moving:
                streams[row] += result.emitted[row, :count].tolist()
            else:
                assert count == 0 and length == before[row]
        tokens = result.next_tokens
    for prompt, stream in zip(prompts, streams):
        assert len(stream) > 12 and stream == mlx_lm_greedy(model, prompt, len(stream))


def traces_during(fn):
    before = TRACE_COUNTS.copy()
    fn()
    return {k: TRACE_COUNTS[k] - before[k] for k in TRACE_COUNTS if TRACE_COUNTS[k] != before[k]}


def test_one_trace_per_kernel_per_bucket(pair):
    model, params, vocab = pair
    rng = np.random.default_rng(2)
    run = lambda n: speculative_tokens(params, random_prompt(rng, n, vocab), 150, width=None, capacity=512)  # noqa: E731
    first = traces_during(lambda: run(21))  # earlier tests may have traced some kernels of this pair already
    assert set(first) <= {"prefill", "draft", "verify"} and max(first.values(), default=1) == 1, first
    assert traces_during(lambda: run(30)) == {}


def test_inserted_and_resized_rows_decode_as_alone(pair):
    """Rows join a running batch, leave it, and move into a smaller one."""
    model, params, vocab = pair
    rng = np.random.default_rng(4)
    prompts = [random_prompt(rng, n, vocab) for n in (7, 19, 4)]
    decoder = dspark_fn.Decoder(params, 4, width=None)
    streams = {}

    def take(step):
        for tag, emitted in zip(step.tags, step.emitted):
            streams[tag] = streams.get(tag, []) + emitted

    take(decoder.insert(prompts[:1]))
    take(decoder.insert(prompts[1:2]))
    for _ in range(3):
        take(decoder.step())
    take(decoder.insert(prompts[2:]))
    for _ in range(3):
        take(decoder.step())
    decoder.release(0)
    decoder.resize(2)  # sequences 1 and 2 move from rows 1 and 2 to rows 0 and 1
    for _ in range(4):
        take(decoder.step())
    for tag, prompt in enumerate(prompts):
        assert streams[tag] == mlx_lm_greedy(model, prompt, len(streams[tag])), f"sequence {tag}"


def test_a_stored_state_is_reused_only_at_its_length(pair):
    """A finished conversation's cache serves a prompt that extends all of
    it, and only such a prompt: its recurrent state is that of its last token."""
    model, params, vocab = pair
    rng = np.random.default_rng(5)
    decoder = dspark_fn.Decoder(params, 1, width=None)
    first = random_prompt(rng, 20, vocab)
    step = decoder.insert([first], max_new_tokens=20, keep_cache=True)
    while not step.ended:
        step = decoder.step()
    (ended,) = step.ended
    tokens, committed = ended.context, int(ended.cache.length[0])
    assert committed <= len(tokens) and ended.cache.capacity == capacity_for(committed)
    store = PromptCache(budget_bytes=1 << 30, min_tokens=4)
    store.store(tokens, ended.cache)

    diverging = tokens[: committed - 3] + [wrong_token(t, vocab) for t in tokens[committed - 3 : committed]]
    assert store.lookup(diverging) is None  # shares all but the last 3
    follow_up = tokens[:committed] + random_prompt(rng, 6, vocab)
    prefix = store.lookup(follow_up)
    assert prefix is not None and prefix.length.tolist() == [committed]

    fresh = dspark_fn.Decoder(params, 1, width=None)
    resumed = fresh.insert([follow_up], prefix=prefix).emitted[0]
    while len(resumed) < 30:
        resumed += fresh.step().emitted[0]
    assert resumed == mlx_lm_greedy(model, follow_up, len(resumed))


def test_prompt_scores_equal_mlx_lm(pair):
    """``score_prompt`` on a recurrent target: a prompt over two chunks (the
    second padded past its end) scored as mlx-lm's log-softmax of its logits."""
    model, params, vocab = pair
    prompt = random_prompt(np.random.default_rng(5), 100, vocab)
    _, _, _, scored = dspark_fn.score_prompt(params, dspark_fn.init_cache(params, 1, 128), [prompt], top=3)
    logits = model(mx.array([prompt]))[0, :-1].astype(mx.float32)
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    deepest = max(shape["num_hidden_layers"] for shape in HYBRID_SHAPES.values())
    assert_fp32_close(scored.log_probs[0, : len(prompt) - 1], expected[np.arange(len(prompt) - 1), prompt[1:]],
                      "prompt scores", layers=deepest, reduction=vocab)


def test_prompts_sharing_a_context_are_scored_whole(pair, monkeypatch):
    """``prompt_cache.scoring.score_prompts`` on a recurrent target: two prompts
    after one long context are each scored whole, in one prefill (no state
    resumes short of its end), ``known`` is never asked, and their scores
    are mlx-lm's."""
    model, params, vocab = pair
    rng = np.random.default_rng(8)
    context = random_prompt(rng, prefix_scoring.MIN_SHARED + 8, vocab)
    prompts = [context + random_prompt(rng, n, vocab) for n in (4, 7)]
    calls, score = [], prefix_scoring.score_prompt

    def counted(params, cache, rows, **options):
        calls.append([len(row) for row in rows])
        return score(params, cache, rows, **options)

    monkeypatch.setattr(prefix_scoring, "score_prompt", counted)
    rows = prefix_scoring.score_prompts(params, prompts, top=3, known=lambda tokens: pytest.fail("asked for a prefix"))
    assert calls == [[len(p) for p in prompts]]
    deepest = max(shape["num_hidden_layers"] for shape in HYBRID_SHAPES.values())
    for index, (prompt, row) in enumerate(zip(prompts, rows)):
        logits = model(mx.array([prompt]))[0, :-1].astype(mx.float32)
        expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        assert_fp32_close(row.scores.log_probs[0], expected[np.arange(len(prompt) - 1), prompt[1:]],
                          f"prompt {index}", layers=deepest, reduction=vocab)
