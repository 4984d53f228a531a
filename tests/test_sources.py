"""Proposal sources behind one interface: a source defined outside the
package proposes through the same decoder, the store of past answers
proposes and learns, and every row stays the target's greedy text.

Breaks tried, and the tests that catch them:
- the policy ignoring a source's offers (``prepare`` gathering the copies
  alone): test_a_source_from_outside_the_package_proposes;
- a point source's offer verified without its tokens (``point_tokens``
  zero-filling every row): test_a_source_from_outside_the_package_proposes,
  test_the_store_proposes_what_it_learned (greedy streams differ);
- a store never told of finished answers (``Decoder._end`` without
  ``learn``): test_the_store_proposes_what_it_learned;
- ``dspark generate --store`` not saving the store: test_the_cli_saves_what_the_store_learned.
(The sampled law under store proposals: test_sampling's "stored answers"
case and its control "stored continuation accepted without checking the target".)
"""

import ast
import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dspark_fn
from dspark_fn import CostCurve, Decoder
from dspark_fn.schedule import Offer
from dspark_fn.sources import PointSource, StoredAnswers, default_sources
from dspark_fn.store import Store, build_store, load
from helpers import build_pair, mlx_lm_greedy, random_prompt, target_config

CONFIG = target_config("qwen3", vocab=96, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
BLOCK = 4
NEW_TOKENS = 24
COSTS = CostCurve(0.3, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    model = build_pair(root, CONFIG, block_size=BLOCK)
    return root, model, dspark_fn.load(root / "target", root / "draft")


class Oracle(PointSource):
    """A source the package does not know: it proposes the target's own
    greedy continuation (known in advance) from the row's context (its
    whole context fits the ending it reads), wrong in every third
    proposal's second token."""

    name, kinds, reach = "oracle", 2, 64

    def __init__(self, truths: dict):
        self.truths, self.offered = truths, 0

    def offers(self, endings: list, slots: int) -> list:
        return [self.offer(ending, slots) for ending in endings]

    def offer(self, context: list, slots: int) -> Offer:
        for prompt, truth in self.truths.items():
            text = list(prompt) + truth
            if context == text[: len(context)] and len(context) < len(text):
                self.offered += 1
                proposal = text[len(context) : len(context) + slots]
                if self.offered % 3 == 0 and len(proposal) > 1:
                    proposal[1] = (proposal[1] + 1) % CONFIG["vocab_size"]
                return Offer(proposal, 1 + self.offered % 2)
        return Offer([], 0)


@pytest.mark.parametrize("proposals", ["auto", "copy"])
def test_a_source_from_outside_the_package_proposes(pair, proposals):
    """Rows verify the outside source's offers (chosen per row and round
    beside the draft, or alone), accept them while they are right, and
    each row is the target's greedy text."""
    _, model, params = pair
    prompts = [random_prompt(np.random.default_rng(seed), 12, CONFIG["vocab_size"]) for seed in (1, 2)]
    truths = {tuple(p): mlx_lm_greedy(model, p, NEW_TOKENS) for p in prompts}
    oracle = Oracle(truths)
    events = list(dspark_fn.generate(params, prompts, NEW_TOKENS, costs=COSTS, proposals=proposals,
                                     sources=(oracle,)))
    streams = [[t for e in events if e.tag == tag for t in e.emitted] for tag in range(2)]
    assert streams == [truths[tuple(p)] for p in prompts]
    rounds = [e for e in events if e.kind == "round"]
    from_oracle = [e for e in rounds if e.source == "oracle"]
    assert from_oracle and sum(e.accepted for e in from_oracle) > len(from_oracle)
    assert any(e.accepted < len(e.drafted) for e in from_oracle)  # the wrong tokens were refused
    if proposals == "copy":
        assert {e.source for e in rounds} <= {"oracle", "copy", ""}  # point sources only: no draft


def test_the_decoder_is_small_and_names_no_source():
    """At most 18 methods, and none of its code (docstrings aside) names a source."""
    methods = [name for name, value in vars(Decoder).items() if callable(value) or isinstance(value, property)]
    assert len(methods) <= 18, methods
    tree = ast.parse(textwrap.dedent(inspect.getsource(Decoder)))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, (ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    words = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    words |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    words |= {node.value for node in ast.walk(tree)
              if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}
    named = words & {"CopyIndex", "ContextCopies", "ForcedTokens", "StoredAnswers", "copy", "forced", "store", "index",
                     "copies", "draft_masks", "propose"}
    assert not named, named


def test_the_store_proposes_what_it_learned(pair):
    """An empty store learns each finished answer; the same prompt again
    is answered from the store (its rounds keep whole proposals), and both
    answers are the target's greedy text."""
    _, model, params = pair
    prompt = random_prompt(np.random.default_rng(7), 12, CONFIG["vocab_size"])
    truth = mlx_lm_greedy(model, prompt, NEW_TOKENS)
    store = Store(CONFIG["vocab_size"], "tiny")
    sources = default_sources(store)

    def answer() -> list:
        return list(dspark_fn.generate(params, prompt, NEW_TOKENS, costs=COSTS, sources=sources))

    first = answer()
    assert [t for e in first for t in e.emitted] == truth
    assert "store" not in {e.source for e in first} and len(store) > 0
    second = answer()
    assert [t for e in second for t in e.emitted] == truth
    stored = [e for e in second if e.source == "store"]
    assert stored and sum(e.accepted for e in stored) >= NEW_TOKENS // 2
    assert sum(e.kind == "round" for e in second) < sum(e.kind == "round" for e in first)


def test_a_store_that_does_not_learn_stays_as_it_was(pair):
    _, _, params = pair
    store = Store(CONFIG["vocab_size"], "tiny")
    list(dspark_fn.generate(params, [3, 4, 5], 8, costs=COSTS, sources=(StoredAnswers(store, learning=False),)))
    assert len(store) == 0


def test_the_cli_saves_what_the_store_learned(pair, tmp_path, monkeypatch):
    """``dspark generate --store PATH`` twice: a new store file, then the
    same file holding the answer twice; a store made for another model is
    refused with its name."""
    root, model, _ = pair
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    prompt = random_prompt(np.random.default_rng(9), 12, CONFIG["vocab_size"])
    path, target = tmp_path / "answers.npz", str(root / "target")

    def run(store) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "dspark_fn.cli", "generate", "--model", target, "--draft", str(root / "draft"),
                   "--prompt-tokens", ",".join(map(str, prompt)), "--max-tokens", "16", "--json", "--store", str(store)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    for _ in range(2):
        result = run(path)
        assert result.returncode == 0, result.stderr
    truth = mlx_lm_greedy(model, prompt, 16)
    assert dict(load(path, CONFIG["vocab_size"], target).entries) == dict(
        build_store([truth, truth], CONFIG["vocab_size"], target).entries)
    Store(CONFIG["vocab_size"], "another model").save(tmp_path / "other.npz")
    refused = run(tmp_path / "other.npz")
    assert refused.returncode == 2 and "answers of 'another model'" in refused.stderr


def test_stored_offers_are_rated_by_match_and_by_how_clearly_the_ending_went_on():
    """An ending that always went on alike and one that went on two ways
    are offered under different kinds, as are endings of different lengths."""
    store = build_store([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7], [5, 6, 8]], 16, "tiny")
    source = StoredAnswers(store)
    clear, split, short = source.offers([[1, 2, 3], [5, 6], [9, 2, 3]], 1)
    assert clear.tokens == [4] and split.tokens == [7] and short.tokens == [4]
    assert len({clear.kind, split.kind, short.kind}) == 3
    assert all(1 <= offer.kind <= source.kinds for offer in (clear, split, short))
    assert source.offers([[9, 9]], 1) == [Offer([], 0)]
