"""Prompts scored together with each shared beginning prefilled once
(``prompt_cache.scoring.score_prompts``): every prompt's scores are mlx-lm's
log-probabilities of its tokens (within the fp32 bound) and its first
token the one scoring it alone gives, whether its beginning came from a
kept scored prompt, from a beginning it shares with the prompts beside it,
or from nothing (a hybrid target, whose prefixes cannot resume:
``test_hybrid.py``).

Breaks tried (each in a copy of the tree), and the tests that catch them:
- the scores of a reused prefix cut one short (``cut_scores(scores, shared - 2)``):
  every equality test here (a prompt's scores come out one short);
- the prefix's cache cut at the shared length (its last position not run
  again, so the first token past it is scored from the prefix's own next
  token): the equality tests (the scores there are another token's);
- shared beginnings never scored first (``worth`` empty): the rows and
  keeps counted in test_a_shared_beginning_is_scored_once_first;
- ``known`` not consulted: the rows counted in
  test_a_kept_scored_prompt_gives_its_beginning;
- a beginning taken from a prompt that holds all of the one cut (the
  ``< len(prompt)`` test dropped): test_shared_beginnings_are_the_longest_with_another_prompt;
- a recurrent target's prompts cut like the others:
  test_hybrid.py::test_prompts_sharing_a_context_are_scored_whole (its
  cut would resume a state that holds after all of the context).
"""

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.prompt_cache import scoring as prefix_scoring
from dspark_fn.buffers import capacity_for
from dspark_fn.prompt_cache.scoring import MIN_SHARED, score_prompts, shared_beginnings
from dspark_fn.sampling import GREEDY, Sampling
from dspark_fn.prompt_cache.memory import PromptCache
from helpers import random_prompt
from numerics import assert_fp32_close
from test_log_probs import BUDGET, CONFIG, pair  # noqa: F401  the tiny pair, and its fp32 budget

VOCAB = CONFIG["vocab_size"]
TOP = 4


def mlx_lm_scores(model, prompt: list) -> np.ndarray:
    """mlx-lm's log-probability of each prompt token after the first."""
    logits = model(mx.array([prompt]))[0, :-1].astype(mx.float32)
    log_probs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return log_probs[np.arange(len(prompt) - 1), prompt[1:]]


def alone(params, prompt: list, sampling=GREEDY, seed: int = 0) -> int:
    """The first token scoring ``prompt`` alone, in a cache of its own, gives."""
    cache = dspark_fn.init_cache(params, 1, capacity_for(1), seed=seed)
    _, first, _, _ = dspark_fn.score_prompt(params, cache, [prompt], top=TOP, sampling=sampling, grow=True)
    return int(first[0])


def check_rows(model, params, prompts, rows, sampling=GREEDY, seeds=None) -> None:
    for index, (prompt, row) in enumerate(zip(prompts, rows)):
        assert row.scores.log_probs.shape == (1, len(prompt) - 1), f"prompt {index}"
        assert row.scores.top_ids.shape == (1, len(prompt) - 1, TOP), f"prompt {index}"
        assert_fp32_close(row.scores.log_probs[0], mlx_lm_scores(model, prompt), f"prompt {index}", **BUDGET)
        top_best = np.array(row.scores.top_log_probs[0, :, 0])
        assert (np.array(row.scores.log_probs[0]) <= top_best + 1e-5).all(), f"prompt {index}: top is the most likely"
        assert int(row.cache.length[0]) == len(prompt)
        seed = seeds[index] if seeds else 0
        assert row.first == alone(params, prompt, sampling, seed), f"prompt {index}: first token"


class Recorder:
    """``score_prompt`` counted: the rows and tokens of each call; and what ``keep`` is told."""

    def __init__(self, monkeypatch):
        self.calls, self.kept = [], []
        score = prefix_scoring.score_prompt

        def counted(params, cache, prompts, **options):
            self.calls.append([len(p) for p in prompts])
            return score(params, cache, prompts, **options)

        monkeypatch.setattr(prefix_scoring, "score_prompt", counted)

    def keep(self, prompt, cache, scores):
        self.kept.append(tuple(prompt))


def test_shared_beginnings_are_the_longest_with_another_prompt():
    """Against every pair compared: random prompts over few tokens (so they
    share beginnings of many lengths), some beginning others."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        prompts = [tuple(rng.integers(0, 3, size=rng.integers(1, 8)).tolist()) for _ in range(6)]
        prompts += [prompts[0] + (1, 2)]  # one that begins another, whole

        expected = []
        for prompt in prompts:  # each against every other, whatever their order: a beginning of it held by another
            beginnings = [n for n in range(len(prompt)) if any(q[:n] == prompt[:n] and q != prompt and len(q) >= n
                                                               and not q[:len(prompt)] == prompt for q in prompts)]
            expected.append(max(beginnings, default=0))
        assert shared_beginnings(prompts) == expected, prompts


def test_a_shared_beginning_is_scored_once_first(pair, monkeypatch):  # noqa: F811
    """Three prompts after one long context (two choices each short, one
    longer) and one of its own: the context is scored once, first, and
    kept; the rows then score only what follows it (its last token again)."""
    model, params = pair
    rng = np.random.default_rng(6)
    context = random_prompt(rng, MIN_SHARED + 20, VOCAB)
    prompts = [context + random_prompt(rng, n, VOCAB) for n in (3, 5, 40)] + [random_prompt(rng, 30, VOCAB)]
    record = Recorder(monkeypatch)
    rows = score_prompts(params, prompts, top=TOP, keep=record.keep)
    check_rows(model, params, prompts, rows)
    assert record.calls == [[len(context)], [4, 6, 41, 30]]
    assert record.kept == [tuple(context)] + [tuple(p) for p in prompts]


def test_a_kept_scored_prompt_gives_its_beginning(pair, monkeypatch):  # noqa: F811
    """Prompts scored and kept in a prompt cache; later prompts that share
    a beginning with one of them (the whole of it, or part) score only
    their rest; a sampled first token is still its own seed's draw."""
    model, params = pair
    rng = np.random.default_rng(7)
    kept = PromptCache(1 << 30)
    first = [random_prompt(rng, 50, VOCAB), random_prompt(rng, 25, VOCAB)]
    score_prompts(params, first, top=TOP, keep=kept.store)
    later = [first[0] + random_prompt(rng, 6, VOCAB), first[1][:20] + random_prompt(rng, 9, VOCAB)]
    hot, seeds = Sampling(temperature=1.5), [3, 8]
    record = Recorder(monkeypatch)
    rows = score_prompts(params, later, top=TOP, sampling=hot, seeds=seeds, known=kept.scored_prefix)
    check_rows(model, params, later, rows, hot, seeds)
    assert record.calls == [[7, 10]]  # from the last shared token on
    assert kept.hits == 2
