"""Prompt scoring batched across queued requests: the scoring requests that
need no row (echo with ``max_tokens`` 0, or 1 with the first token) waiting
in one pass of the engine are prefilled as the rows of one ``score_prompt``
call, and each is answered as scoring it alone answers it: its prompt's
scores (within the fp32 bound), its own first token (greedy, or its own
seed's draw), its cache kept for a later turn, and an error if the prefill
fails.

One tiny target (``test_log_probs``'s pair) serves every test here, in an
engine driven in process; the requests of a test are submitted while the
test holds the engine's lock, so the engine takes them in at one pass.

Breaks tried (each in a copy of the tree), and the tests that catch them:
- the rows' scores and first tokens handed to the requests in reverse
  order (the prompts' lengths differ, so each gets another's):
  test_waiting_scoring_requests_share_one_prefill_and_score_as_alone and
  test_each_first_token_is_the_one_scoring_alone_gives;
- every request given the first row's scores and first token: the same
  two tests;
- the prefill cut to the first request (``_score(requests[:1])``, its
  answer given to all): the same two tests (one row prefilled, not all),
  and test_each_scored_prompt_is_kept_for_a_later_turn;
- each request prefilled alone again (``scoring_batches`` returning one
  batch per request): the count of prefills in the first two tests;
- every row drawing with the first request's seed
  (``row_seeds(requests[0].seed, 1)`` for each), or with the batch's seeds
  (``row_seeds(requests[0].seed, len(requests))``: row b draws from its
  place in the batch): test_each_first_token_is_the_one_scoring_alone_gives;
- every row drawing under the first request's sampling settings: the same test;
- each request's prompt kept with row 0's cache: the follow-up in
  test_each_scored_prompt_is_kept_for_a_later_turn answers another
  conversation's tokens; kept one token short
  (``row_cache(cache, row, len(prompt) - 1)``): the same test finds no
  entry under the whole prompt;
- a failed prefill ending only its first request with an error (the others
  never hear): test_a_failed_scoring_prefill_ends_each_of_its_requests;
- rowless requests past a pass's share given rows (``_admit`` taking any
  waiting request): test_scoring_requests_past_a_pass_wait_for_the_next_never_a_row;
- no prompt-cache lookup for scored prompts (``known`` not passed), or no
  scores kept with them: the hits counted in
  test_choices_after_one_context_score_it_once_and_later_ones_reuse_it.
"""

import queue
from typing import NamedTuple

import numpy as np
import pytest

import dspark_fn
from dspark_fn.buffers import capacity_for
from dspark_fn.driver import TOP_LOG_PROBS
from dspark_fn.prompt_cache.scoring import MIN_SHARED
from dspark_fn.sampling import GREEDY, Sampling
from dspark_fn.prompt_cache import scoring as prefix_scoring
from dspark_fn.serve.engine import Engine, Request
from helpers import mlx_lm_greedy, random_prompt
from numerics import assert_fp32_close
from test_log_probs import BUDGET, CONFIG, pair  # noqa: F401  the tiny pair, and its fp32 budget

VOCAB = CONFIG["vocab_size"]
TOP = 3  # alternatives each scored token lists
HOT = Sampling(temperature=1.5)  # a drawing request's settings: a flat distribution, so seeds draw apart
WAIT = 60  # seconds a test waits for an update (a request never answered fails here, not at the suite's limit)


class Answer(NamedTuple):
    """What a request heard, once it ended."""

    prompt_scores: list | None  # a TokenScore per prompt token after the first (the "prompt" update)
    tokens: list
    token_scores: list
    finish: str  # "length", "stop", "cancelled", or "error: <message>"


def answer(request: Request) -> Answer:
    prompt_scores, tokens, token_scores = None, [], []
    while True:
        kind, value, scores = request.events.get(timeout=WAIT)
        if kind == "prompt":
            prompt_scores = scores
        elif kind == "tokens":
            tokens += value
            token_scores += scores or []
        elif kind in ("done", "error"):
            return Answer(prompt_scores, tokens, token_scores, value if kind == "done" else f"error: {value}")
        else:
            pytest.fail(f"unexpected update {kind}: {value}")


def answered(requests: list) -> list[Answer]:
    """Each request's answer; an engine error fails the test."""
    answers = [answer(request) for request in requests]
    for got in answers:
        assert not got.finish.startswith("error"), got.finish
    return answers


def scoring(prompt: list, max_tokens: int = 0, sampling=GREEDY, seed: int = 0) -> Request:
    """lm-eval's request: echo with log-probabilities, ``max_tokens`` 0 or 1."""
    return Request(prompt, max_tokens, sampling=sampling, seed=seed, top_log_probs=TOP, score_prompt=True)


def submitted_together(engine: Engine, requests: list) -> list:
    """``requests`` submitted while this thread holds the engine's lock: the
    engine takes them all in at its next pass."""
    with engine.wake:
        return [engine.submit(request) for request in requests]


class Alone(NamedTuple):
    """``score_prompt`` of one prompt in a cache of its own (how the engine scored each request before batching)."""

    log_probs: np.ndarray  # [len(prompt) - 1]
    top_log_probs: np.ndarray  # [len(prompt) - 1, TOP]
    first: int
    first_log_prob: float


def scored_alone(params, prompt: list, sampling=GREEDY, seed: int = 0) -> Alone:
    cache = dspark_fn.init_cache(params, 1, capacity_for(1), seed=seed)
    _, first, first_scored, scored = dspark_fn.score_prompt(params, cache, [prompt], top=TOP_LOG_PROBS,
                                                            sampling=sampling, grow=True)
    count = len(prompt) - 1
    return Alone(np.array(scored.log_probs[0, :count]), np.array(scored.top_log_probs[0, :count, :TOP]),
                 int(first[0]), float(first_scored.log_probs[0]))


def check_prompt_scores(got: Answer, alone: Alone, what: str) -> None:
    assert got.prompt_scores is not None and len(got.prompt_scores) == len(alone.log_probs), what
    assert all(len(score.top) == TOP for score in got.prompt_scores), what
    assert_fp32_close([score.log_prob for score in got.prompt_scores], alone.log_probs, f"{what}: scores", **BUDGET)
    assert_fp32_close([[value for _, value in score.top] for score in got.prompt_scores], alone.top_log_probs,
                      f"{what}: top", **BUDGET)


@pytest.fixture(scope="module")
def engine(pair):  # noqa: F811
    engine = Engine(pair[1], max_batch=4, max_context=256, width=3)
    yield engine
    engine.close()


@pytest.fixture
def prefills(monkeypatch):
    """The rows of each scoring prefill the engine runs, call by call."""
    rows, score = [], prefix_scoring.score_prompt

    def counted(params, cache, prompts, **options):
        rows.append(len(prompts))
        return score(params, cache, prompts, **options)

    monkeypatch.setattr(prefix_scoring, "score_prompt", counted)
    return rows


def test_waiting_scoring_requests_share_one_prefill_and_score_as_alone(pair, engine, prefills):  # noqa: F811
    """Three prompts of different lengths (one chunk, two chunks) scored in
    one prefill, and an echo without scores beside them that needs none:
    each scored request's prompt scores are those of scoring it alone."""
    params = pair[1]
    rng = np.random.default_rng(21)
    prompts = [random_prompt(rng, length, VOCAB) for length in (9, 30, 75)]
    echoed = Request(random_prompt(rng, 12, VOCAB), 0)
    *answers, echo = answered(submitted_together(engine, [scoring(p) for p in prompts] + [echoed]))
    assert prefills == [len(prompts)]
    assert echo == Answer(None, [], [], "length")
    for index, (prompt, got) in enumerate(zip(prompts, answers)):
        assert got.tokens == [] and got.finish == "length"
        check_prompt_scores(got, scored_alone(params, prompt), f"request {index}")


def test_each_first_token_is_the_one_scoring_alone_gives(pair, engine, prefills):  # noqa: F811
    """``max_tokens`` 1: two greedy requests and two drawing ones (the same
    prompt, seeds that draw apart) in one prefill; each first token, and
    its score, is the one scoring its request alone gives: the greedy
    token, or its own seed's draw under its own settings."""
    params = pair[1]
    rng = np.random.default_rng(22)
    greedy = [random_prompt(rng, length, VOCAB) for length in (12, 41)]
    drawn, seeds = random_prompt(rng, 23, VOCAB), (3, 4)
    requests = [scoring(p, 1) for p in greedy] + [scoring(drawn, 1, HOT, seed) for seed in seeds]
    alone = [scored_alone(params, r.prompt, r.sampling, r.seed) for r in requests]
    assert alone[2].first != alone[3].first  # the two seeds draw apart: a row drawing with another's seed shows
    answers = answered(submitted_together(engine, requests))
    assert prefills == [len(requests)]
    for index, (got, expected) in enumerate(zip(answers, alone)):
        assert got.tokens == [expected.first] and got.finish == "length", f"request {index}"
        assert len(got.token_scores) == 1 and len(got.token_scores[0].top) == TOP
        assert_fp32_close([got.token_scores[0].log_prob], [expected.first_log_prob], f"request {index}: first",
                          **BUDGET)
        check_prompt_scores(got, expected, f"request {index}")


def test_each_scored_prompt_is_kept_for_a_later_turn(pair, engine):  # noqa: F811
    """After one scoring prefill of three prompts (each at least the prompt
    cache's 16 tokens), the cache holds each prompt under its own tokens,
    and a generation that continues one reuses all of it and answers as
    the target does."""
    model = pair[0]
    rng = np.random.default_rng(23)
    prompts = [random_prompt(rng, length, VOCAB) for length in (18, 33, 60)]
    answered(submitted_together(engine, [scoring(p) for p in prompts]))
    kept = engine.prompt_cache.entries
    for prompt in prompts:
        assert int(kept[("", tuple(prompt))][0].length[0]) == len(prompt)  # the engine's requests: scope ""
    for prompt in prompts:
        follow_up = prompt + random_prompt(rng, 3, VOCAB)
        request = engine.submit(Request(follow_up, 6))
        (got,) = answered([request])
        assert request.cached_tokens == len(prompt)
        assert got.tokens == mlx_lm_greedy(model, follow_up, 6)


def test_choices_after_one_context_score_it_once_and_later_ones_reuse_it(pair, engine, prefills):  # noqa: F811
    """An evaluation harness's question: four choices after one long
    context, in one pass. The context is scored once, first (one row), then
    the four choices (four rows), each as scoring it alone scores it; a
    fifth choice later reads the context from the prompt cache, with its
    scores, and scores only its own tokens."""
    params = pair[1]
    rng = np.random.default_rng(25)
    context = random_prompt(rng, MIN_SHARED + 30, VOCAB)
    prompts = [context + random_prompt(rng, n, VOCAB) for n in (2, 3, 5, 8)]
    answers = answered(submitted_together(engine, [scoring(p) for p in prompts]))
    assert prefills == [1, len(prompts)]
    for index, (prompt, got) in enumerate(zip(prompts, answers)):
        check_prompt_scores(got, scored_alone(params, prompt), f"choice {index}")
    hits = engine.prompt_cache.hits
    later = context + random_prompt(rng, 4, VOCAB)
    (got,) = answered(submitted_together(engine, [scoring(later)]))
    assert engine.prompt_cache.hits == hits + 1 and prefills == [1, len(prompts), 1]
    check_prompt_scores(got, scored_alone(params, later), "a later choice")


def test_scoring_requests_past_a_pass_wait_for_the_next_never_a_row(pair, engine, prefills, monkeypatch):  # noqa: F811
    """Six requests that need no row (``max_tokens`` 1) at once, with four
    a pass: four scored in one prefill, the other two in the next, none
    ever given a row of the batch (which would score it alone, then
    prefill its last token again); each first token as scoring it alone."""
    params = pair[1]
    rng = np.random.default_rng(26)
    prompts = [random_prompt(rng, length, VOCAB) for length in (7, 11, 19, 23, 29, 31)]
    inserted = []
    monkeypatch.setattr(engine.decoder, "insert", lambda *args, **options: inserted.append(args))
    answers = answered(submitted_together(engine, [scoring(p, 1) for p in prompts]))
    assert prefills == [engine.max_batch, len(prompts) - engine.max_batch] and inserted == []
    for index, (prompt, got) in enumerate(zip(prompts, answers)):
        assert got.tokens == [scored_alone(params, prompt).first], f"request {index}"


def test_a_failed_scoring_prefill_ends_each_of_its_requests(pair, engine, monkeypatch):  # noqa: F811
    """A scoring prefill that raises ends every request of it with the
    error (none is left waiting), and the engine, started again, scores
    the next ones."""
    rng = np.random.default_rng(24)
    prompts = [random_prompt(rng, length, VOCAB) for length in (10, 20, 30)]

    def failing(*args, **options):
        raise RuntimeError("the scoring prefill failed")

    monkeypatch.setattr(prefix_scoring, "score_prompt", failing)
    requests = submitted_together(engine, [scoring(p, max_tokens) for p, max_tokens in zip(prompts, (0, 1, 0))])
    try:
        finishes = [answer(request).finish for request in requests]
    except queue.Empty:
        pytest.fail(f"a request of the failed prefill was never answered ({WAIT} s)")
    assert finishes == ["error: RuntimeError: the scoring prefill failed"] * len(prompts)
    monkeypatch.undo()
    (got,) = answered(submitted_together(engine, [scoring(prompts[0])]))
    check_prompt_scores(got, scored_alone(pair[1], prompts[0]), "after the failure")
