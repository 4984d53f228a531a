"""Log-probabilities of emitted tokens come from the target logits the verify
computed: each equals mlx-lm's log-softmax of the target's logits at that
position (after the row's temperature and top-p when it draws), whether
the token was an accepted draft, the target's correction or its bonus,
and whatever else runs in the batch; the top tokens are the distribution's
most likely, in order.

Breaks tried, and what caught them:
- the scores of position k taken from the logits at k + 1: every check;
- a drawing row scored under the untempered softmax: the sampled rows;
- the top tokens left in argpartition's order: the ordering checks.
"""

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.buffers import take_rows
from dspark_fn.driver import Decoder
from dspark_fn.prefilling import smallest_chunk
from dspark_fn.rounds import no_proposal
from dspark_fn.sampling import GREEDY, Sampling, batch_sampling, log_probs
from dspark_fn.types import Proposal, TokenScore
from helpers import PROPOSALS, build_draft, build_target, draft_config, mlx_lm_greedy, random_prompt, target_config
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

CONFIG = target_config("qwen3", vocab=128, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
TOP = 5
# fp32 budget: the target's layers, the widest sum its vocabulary (the softmax)
BUDGET = dict(layers=CONFIG["num_hidden_layers"], reduction=CONFIG["vocab_size"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("log_probs")
    model = build_target(root / "target", CONFIG, seed=11, gain=1.5)
    build_draft(root / "draft", draft_config(CONFIG, layers=1, taps=(0, 1), block_size=4), seed=2)
    return model, dspark_fn.load(root / "target", root / "draft")


def reference(model, prompt: list, emitted: list, sampling=GREEDY) -> np.ndarray:
    """mlx-lm's logits over prompt + emitted, as the row's distribution: ``[len(emitted), V]`` log-probabilities."""
    logits = model(mx.array([prompt + emitted]))[0, len(prompt) - 1 : len(prompt) + len(emitted) - 1]
    rows, mode = batch_sampling(sampling, len(emitted))
    return np.array(log_probs(logits.astype(mx.float32), rows, mode))


def check_scores(expected: np.ndarray, emitted: list, scores: list, what: str) -> None:
    chosen = np.array([score.log_prob for score in scores])
    assert_fp32_close(chosen, expected[np.arange(len(emitted)), emitted], f"{what}: chosen", **BUDGET)
    for position, score in enumerate(scores):
        ids, values = zip(*score.top)
        assert len(ids) == TOP and list(values) == sorted(values, reverse=True), f"{what}: top order"
        assert_fp32_close(np.array(values), np.ascontiguousarray(np.sort(expected[position])[::-1][:TOP]), f"{what}: top", **BUDGET)
        assert_fp32_close(np.array(values), expected[position][list(ids)], f"{what}: top ids", **BUDGET)


@pytest.mark.parametrize("kind", sorted(PROPOSALS))
def test_scores_equal_mlx_lm_whatever_the_round_accepted(pair, kind):
    """Rounds that accept every draft, none, or some: each emitted token
    scored from the verify's logits at its own position."""
    model, params = pair
    prompt = random_prompt(np.random.default_rng(1), 9, CONFIG["vocab_size"])
    width = params.spec.block_size + 1
    truth = mlx_lm_greedy(model, prompt, 64)
    cache, anchor, first = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), [prompt], top_log_probs=TOP)
    emitted = [int(anchor[0])]
    scores = [(float(first.log_probs[0]), list(zip(first.top_ids[0].tolist(), first.top_log_probs[0].tolist())))]
    for round_index in range(8):
        wanted = PROPOSALS[kind](truth[len(emitted) : len(emitted) + width - 1], round_index, CONFIG["vocab_size"])
        proposal = Proposal(tokens=mx.array([wanted], mx.int32), confidence_logits=mx.zeros((1, width - 1)),
                            log_probs=None)
        cache, result = dspark_fn.verify(params, cache, anchor, proposal, width, top_log_probs=TOP)
        count = int(result.count[0])
        emitted += result.emitted[0, :count].tolist()
        scored = result.scores
        scores += [(float(scored.log_probs[0, i]), list(zip(scored.top_ids[0, i].tolist(),
                                                            scored.top_log_probs[0, i].tolist())))
                   for i in range(count)]
        anchor = result.next_tokens
    assert emitted == truth[: len(emitted)]
    check_scores(reference(model, prompt, emitted), emitted, [TokenScore(*s) for s in scores], kind)


def test_a_round_without_drafts_scores_its_token(pair):
    model, params = pair
    prompt = [3, 1, 4, 1, 5]
    cache, anchor = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 128), [prompt])
    cache, result = dspark_fn.verify(params, cache, anchor, no_proposal(1), 1, top_log_probs=TOP)
    expected = reference(model, prompt, [int(anchor[0]), int(result.emitted[0, 0])])[1]
    assert_fp32_close(result.scores.log_probs[0, :1], expected[result.emitted[0, :1].tolist()], "plain step", **BUDGET)


SETTINGS = [GREEDY, Sampling(0.7), Sampling(1.3, top_p=0.8)]


def decode_scored(params, prompts, settings, seeds, rounds=6):
    """Rows decoded together by a Decoder, each scored: ``(tokens, scores)`` per row."""
    decoder = Decoder(params, len(prompts), width=4)
    streams, scored = [], []
    for prompt, setting, seed in zip(prompts, settings, seeds):
        step = decoder.insert([prompt], sampling=setting, seeds=[seed], top_log_probs=TOP)  # tagged 0, 1, ...
        ((token,),), ((score,),) = step.emitted, step.log_probs
        streams.append([token])
        scored.append([score])
    for _ in range(rounds):
        step = decoder.step()
        for i, tag in enumerate(step.tags):
            streams[tag] += step.emitted[i]
            scored[tag] += step.log_probs[i]
    return streams, scored


def test_sampled_rows_score_under_their_own_distribution_alone_and_in_a_batch(pair):
    model, params = pair
    rng = np.random.default_rng(4)
    prompts = [random_prompt(rng, length, CONFIG["vocab_size"]) for length in (4, 11, 7)]
    streams, scored = decode_scored(params, prompts, SETTINGS, seeds=[5, 6, 7])
    for prompt, setting, stream, scores in zip(prompts, SETTINGS, streams, scored):
        check_scores(reference(model, prompt, stream, setting), stream, scores, f"temperature {setting.temperature}")
    alone = decode_scored(params, prompts[1:2], SETTINGS[1:2], seeds=[6])
    assert alone[0][0] == streams[1]
    assert_fp32_close([s.log_prob for s in alone[1][0]], [s.log_prob for s in scored[1]], "alone vs batch", **BUDGET)


def test_rows_that_do_not_ask_get_no_scores(pair):
    _, params = pair
    decoder = Decoder(params, 2, width=3)
    decoder.insert([[1, 2, 3]])
    step = decoder.step()
    assert step.log_probs is None
    decoder.insert([[4, 5]], top_log_probs=2)
    step = decoder.step()
    assert step.log_probs[0] is None and all(len(s.top) == 2 for s in step.log_probs[1])


def row_scores(scored, row: int, count: int) -> list:
    """Row ``row``'s first ``count`` entries of a ``TokenLogProbs`` as ``TokenScore``s."""
    return [TokenScore(value, list(zip(ids, values))) for value, ids, values in zip(
        scored.log_probs[row, :count].tolist(), scored.top_ids[row, :count].tolist(),
        scored.top_log_probs[row, :count].tolist())]


def test_prompt_scores_are_the_targets_and_the_cache_goes_on(pair):
    """``score_prompt``: every given token after a row's first scored from the
    prefill's own logits (a row of two chunks beside a row of one, and a row
    continuing a cached prefix, scored from its first new token on), the top
    tokens in order; other lengths in the same buckets trace nothing new; the
    cache it leaves decodes on as mlx-lm greedy does."""
    model, params = pair
    rng = np.random.default_rng(9)
    prompts = [random_prompt(rng, length, CONFIG["vocab_size"]) for length in (300, 37)]
    cache, first, first_scores, scored = dspark_fn.score_prompt(
        params, dspark_fn.init_cache(params, 2, 128), prompts, top=TOP, grow=True)
    padded = -(-300 // smallest_chunk()) * smallest_chunk()  # 320 (304 on the bundled BLAS)
    assert scored.log_probs.shape[1] == padded - 1  # row b's first len(prompt) - 1 entries count
    for row, prompt in enumerate(prompts):
        check_scores(reference(model, prompt[:1], prompt[1:]), prompt[1:], row_scores(scored, row, len(prompt) - 1),
                     f"prompt row {row}")
        assert int(first[row]) == mlx_lm_greedy(model, prompt, 1)[0]
    expected_first = [float(reference(model, p, [int(t)])[0, int(t)]) for p, t in zip(prompts, first)]
    assert_fp32_close(first_scores.log_probs, expected_first, "first tokens", **BUDGET)

    traces = dspark_fn.TRACE_COUNTS["score"]
    others = [random_prompt(rng, length, CONFIG["vocab_size"]) for length in (290, 50)]
    dspark_fn.score_prompt(params, dspark_fn.init_cache(params, 2, 128), others, top=TOP, grow=True)
    assert dspark_fn.TRACE_COUNTS["score"] == traces

    prefix = take_rows(cache, [1], 1)._replace(length=mx.array([20], mx.int32))
    decoder = Decoder(params, 1, width=4)
    stream = decoder.insert([prompts[1]], prefix=prefix).emitted[0]
    while len(stream) < 12:
        stream += decoder.step().emitted[0]
    assert stream[:12] == mlx_lm_greedy(model, prompts[1], 12)
    tail = prompts[1][20:]
    *_, continued = dspark_fn.score_prompt(params, prefix, [tail], top=TOP)
    check_scores(reference(model, prompts[1][:21], tail[1:]), tail[1:], row_scores(continued, 0, len(tail) - 1),
                 "continued")
