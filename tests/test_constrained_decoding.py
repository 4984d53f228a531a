"""Constrained generation through the driver: ``generate(..., constraint=...)``
and the ``Decoder`` that owns a matcher per row are token-identical to the
target alone decoding under the same grammar (mlx-lm's ``generate_step``
with llguidance's mask as a logits processor), whatever the rows verify:
the draft's proposals replaced by always-right, always-wrong and
partly-right ones (and the real draft), forced tokens, copies, plain steps;
under the draft alone (its block made during the round before, unmasked)
and under the planner's choice of sources (its block made at the round's
start, the first slot masked); alone and in batches with unconstrained rows.

Also: a schema that forces most tokens is decoded in rounds that verify the
forced tokens without a draft pass and keep all of them; a grammar that
reaches a dead end ends its row ("dead_end") with no refused token; a
model that thinks first is held to the grammar from the end of its thinking
on; constraints compile nothing new.

Breaks tried, and what caught them: the driver's verify masks with position
j opened, for each j (``test_a_mask_dropped_by_the_driver_is_caught``, the
first token's mask too); the masks of drafting rows built along nothing
(the equality tests); no forced tokens read after a step
(``test_forced_tokens_are_verified_without_a_draft_pass``); a dead end not
ended when the forced look-ahead finds it (the dead-end test after a
prefill: the row takes a round that emits nothing).
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import driver, rounds
from dspark_fn import policy as proposing
from dspark_fn.buffers import capacity_for
from dspark_fn.constraints import Constraint, compile_constraint
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.sampling import Mode
from dspark_fn.schedule import CostCurve, width_buckets
from dspark_fn.types import Proposal
from grammars import (CONSTRAINTS, EOS, JSON_PIECES, JSON_VOCAB, PieceTokenizer, check_valid, constrained_pair,
                      mlx_lm_constrained_greedy, vocabulary)
from helpers import PROPOSALS, mlx_lm_greedy, right_prefix

BLOCK = 4
WIDTH = BLOCK + 1
BUDGET = 90
PROMPTS = [[5, 17, 33], [40, 2, 9, 71, 8], [66], [12, 12, 90, 3]]
TEXT = PieceTokenizer(JSON_PIECES)
# A draft pass costs a fifth of a plain step and widening is cheap: the planner drafts while drafts pay.
COSTS = CostCurve(0.2, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})
MODES = {
    "draft alone": dict(width=WIDTH, proposals="draft"),  # made ahead for free batches, at the round's start if held
    "planned": dict(width="auto", costs=COSTS),  # sources at the round's start: forced tokens, copies, the draft
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return constrained_pair(tmp_path_factory.mktemp("constrained_decoding"), BLOCK)



@pytest.fixture(scope="module")
def references(pair, vocab):
    """The target alone on each (constraint, prompt): constrained greedy, or plain greedy without a constraint."""
    model, _ = pair
    known = {}

    def reference(name, prompt):
        key = (name, tuple(prompt))
        if key not in known:
            known[key] = (mlx_lm_greedy(model, prompt, BUDGET) if name is None
                          else mlx_lm_constrained_greedy(model, prompt, CONSTRAINTS[name], vocab, BUDGET))
        return known[key]

    return reference


def scripted_draft(monkeypatch, prompts: list, truths: list, kind: str) -> None:
    """The decoder's draft pass replaced by proposals of ``kind`` built from
    each row's reference stream at the row's position (its cache length)."""
    calls = itertools.count()

    def propose(params, cache, tokens, sampling=None, masks=None):
        r = next(calls)
        rows = []
        for b, (prompt, truth) in enumerate(zip(prompts, truths)):
            emitted = max(int(cache.length[b]) - len(prompt) + 1, 0)
            rest = truth[emitted: emitted + BLOCK]
            rows.append(PROPOSALS[kind](rest, r + b, JSON_VOCAB) + [EOS] * (BLOCK - len(rest)))
        batch = len(rows)
        return Proposal(tokens=mx.array(rows, mx.int32), confidence_logits=mx.full((batch, BLOCK), 3.0),
                        log_probs=mx.zeros((batch, BLOCK, JSON_VOCAB)))

    monkeypatch.setattr(proposing, "propose", propose)


def decode(params, grammars, names: list, prompts: list, truths: list, **options) -> list:
    """``generate`` over the batch, each row under its constraint (None:
    free); checks that every round kept exactly the proposals that agree
    with the row's reference (forced tokens all of them). Returns the
    streams and the rounds' sources."""
    constraint = [None if name is None else grammars[name] for name in names]
    streams, sources = [[] for _ in prompts], []
    for event in dspark_fn.generate(params, prompts, BUDGET, constraint=constraint, **options):
        stream, truth = streams[event.tag], truths[event.tag]
        if event.kind == "round":
            rest = truth[len(stream):]
            right = min(right_prefix(event.drafted, rest), len(rest))
            assert min(event.accepted, len(rest)) == right, (event, rest)
            sources.append(event.source)
        stream += event.emitted
        if event.finish is not None:  # a constrained row ends at its grammar's end, a free one at its budget
            assert event.finish == ("length" if names[event.tag] is None else "stop"), event
    return streams, sources


@pytest.mark.parametrize("kind", [*sorted(PROPOSALS), "draft"])
@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_generate_under_a_constraint_equals_the_target_alone(pair, grammars, references, monkeypatch, name, kind):
    _, params = pair
    truth = references(name, PROMPTS[0])
    if kind != "draft":
        scripted_draft(monkeypatch, PROMPTS[:1], [truth], kind)
    (stream,), _ = decode(params, grammars, [name], PROMPTS[:1], [truth], **MODES["planned"])
    assert stream == truth
    check_valid(name, stream)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", [*sorted(PROPOSALS), "draft"])
def test_constrained_and_free_rows_share_the_decoder(pair, grammars, references, monkeypatch, mode, kind):
    """Rows of every constraint beside free ones, accepting unevenly, ending at different rounds."""
    _, params = pair
    names = ["nested object", None, "regex", "tool call", None]
    prompts = PROMPTS + [PROMPTS[0]]
    truths = [references(name, prompt) for name, prompt in zip(names, prompts)]
    if kind != "draft":
        scripted_draft(monkeypatch, prompts, truths, kind)
    streams, _ = decode(params, grammars, names, prompts, truths, **MODES[mode])
    assert streams == truths
    for name, stream in zip(names, streams):
        if name is not None:
            check_valid(name, stream)


def test_the_draft_alone_waits_for_the_grammar_when_a_row_is_held(pair, grammars, references, monkeypatch):
    """With the draft as the only source, a free batch's draft is made with
    the verify before it (no mask), but a batch with a constrained row
    drafts after the round's commits, each pass with the grammar's mask on
    the constrained row's first slot, and still equals the target alone."""
    _, params = pair
    real, given = proposing.propose, []

    def propose(params, cache, tokens, sampling=None, masks=None):
        given.append(None if masks is None else np.array(masks))
        return real(params, cache, tokens, sampling, masks)

    monkeypatch.setattr(proposing, "propose", propose)
    names = ["nested object", "regex"]
    truths = [references(name, prompt) for name, prompt in zip(names, PROMPTS[:2])]
    streams, _ = decode(params, grammars, names, PROMPTS[:2], truths, **MODES["draft alone"])
    assert streams == truths and given
    everything = np.uint32(0xFFFFFFFF)
    for masks in given:  # [B, G, words]: a going row's first slot narrowed, the later slots open
        assert masks is not None and (masks[:, 0] != everything).any() and (masks[:, 1:] == everything).all()
    given.clear()
    list(dspark_fn.generate(params, PROMPTS[:2], 20, **MODES["draft alone"]))
    assert given and all(masks is None for masks in given)


def test_forced_tokens_are_verified_without_a_draft_pass(pair, vocab, references, monkeypatch):
    """A schema whose keys and enum tails are long: most of the answer is
    forced. Rounds that verify forced tokens keep every one of them, and a
    round in which the row verifies forced tokens runs no draft pass."""
    _, params = pair
    schema = {"type": "object", "properties": {
        "arguments": {"enum": ["celsius", "fahrenheit"]}, "name": {"const": "get_weather"},
        "city": {"enum": ["small", "large"]}, "tags": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["arguments", "name", "city", "tags"], "additionalProperties": False}
    grammar = compile_constraint(Constraint.json_schema(schema), vocab)
    truth = mlx_lm_constrained_greedy(pair[0], PROMPTS[1], Constraint.json_schema(schema), vocab, BUDGET)
    drafts = []
    propose = proposing.propose
    monkeypatch.setattr(proposing, "propose", lambda *args, **kwargs: drafts.append(True) or propose(*args, **kwargs))
    decoder = dspark_fn.Decoder(params, 1, costs=COSTS)
    stream = decoder.start([PROMPTS[1]], constraints=grammar).emitted[0]
    forced = 0
    while decoder.busy:
        drafts.clear()
        step = decoder.step()
        stream += step.emitted[0]
        if step.sources[0] == "forced":
            assert not drafts, "a draft pass in a round of forced tokens"
            assert step.accepted[0] == len(step.drafted[0]) > 0
            forced += len(step.drafted[0])
    assert stream == truth
    assert forced > len(truth) / 2, (forced, len(truth))
    policy = decoder.cache.policy
    forced_kind = policy.kinds.kind(policy.kinds.names.index("forced"), 1)
    rates = policy.rates
    assert (rates.acceptance[0, forced_kind] == 1).all() and rates.observed[0, forced_kind, 0] > 0


@pytest.mark.parametrize("text", ["a", "ab"])
def test_a_dead_end_ends_the_row_before_any_refused_token(pair, vocab, references, text):
    """``text`` then a newline, which no piece holds: after ``text`` the
    grammar admits nothing. The row ends "dead_end" with exactly ``text``, in
    the step that emitted its last character (the prefill's, for "a": found
    by reading the tokens it forces next; a round's, for "ab": its bonus
    position allows only an end of sequence, which the grammar refuses); a
    free row beside it goes on to its budget."""
    _, params = pair
    grammar = compile_constraint(Constraint.regex(text + "\n"), vocab)
    events = list(dspark_fn.generate(params, PROMPTS[:2], 12, constraint=[grammar, None], **MODES["planned"]))
    stuck = [event for event in events if event.tag == 0]
    assert [t for e in stuck for t in e.emitted] == TEXT(text)
    assert stuck[-1].finish == "dead_end" and stuck[-1].emitted[-1] == TEXT(text)[-1]
    assert (stuck[-1].kind == "prefill") == (text == "a")
    free = [t for event in events if event.tag == 1 for t in event.emitted]
    assert free == references(None, PROMPTS[1])[:12]


def test_a_mask_dropped_by_the_driver_is_caught(pair, grammars, references, monkeypatch):
    """The mutation "the driver opens the verify's mask at position j", for
    every j, and "the first token's mask opened", each make an always-right
    run differ from the target alone."""
    _, params = pair
    truth = references("nested object", PROMPTS[1])
    scripted_draft(monkeypatch, PROMPTS[1:2], [truth], "always-right")
    built = driver.verify_masks

    def run():
        streams, _ = decode(params, grammars, ["nested object"], PROMPTS[1:2], [truth], **MODES["draft alone"])
        assert streams == [truth]

    for position in range(WIDTH):
        def opened(*args, position=position, **kwargs):
            masks = built(*args, **kwargs)
            masks[:, position] = 0xFFFFFFFF
            return masks

        monkeypatch.setattr(driver, "verify_masks", opened)
        with pytest.raises(AssertionError):
            run()
    monkeypatch.setattr(driver, "verify_masks", built)
    first = driver.next_masks
    monkeypatch.setattr(driver, "next_masks", lambda matchers, size: np.full_like(first(matchers, size), 0xFFFFFFFF))
    with pytest.raises(AssertionError):
        run()
    monkeypatch.setattr(driver, "next_masks", first)
    run()


def test_constraints_compile_nothing_new_in_the_driver(pair, grammars):
    """After unconstrained runs (each mode), constrained runs and mixed
    batches through ``generate`` trace no kernel."""
    _, params = pair
    for options in MODES.values():
        list(dspark_fn.generate(params, PROMPTS[:2], 40, **options))
    cache, anchors = dspark_fn.prefill(params, dspark_fn.init_cache(params, 2, capacity_for(1)), PROMPTS[:2])
    for width in width_buckets(BLOCK):  # every width the planner may pick, without masks
        dspark_fn.verify(params, cache, anchors, rounds.undrafted(params, 2, Mode()), width)
    warm = TRACE_COUNTS.copy()
    for options in MODES.values():
        for names in (["nested object", "regex"], ["tool call", None]):
            list(dspark_fn.generate(params, PROMPTS[:2], 40, constraint=[grammars.get(n) for n in names], **options))
    assert TRACE_COUNTS == warm, {k: TRACE_COUNTS[k] - warm[k] for k in TRACE_COUNTS}


def test_a_thinking_model_is_constrained_from_the_end_of_its_thinking(pair, vocab):
    """The model thinks freely until its end-of-thinking token, then follows
    the regex: greedy equals the target alone under the same grammar, the
    thinking is what the free target writes, and the rest matches. (The end
    marker is a token the free target writes early, so the thinking ends.)"""
    model, params = pair
    free = mlx_lm_greedy(model, PROMPTS[0], 8)
    end = free[3]
    assert end not in free[:3]
    constraint = Constraint.after_thinking(CONSTRAINTS["regex"], end=[end])
    truth = mlx_lm_constrained_greedy(model, PROMPTS[0], constraint, vocab, BUDGET)
    grammar = compile_constraint(constraint, vocab)
    stream = [t for e in dspark_fn.generate(params, PROMPTS[0], BUDGET, constraint=grammar, **MODES["planned"])
              for t in e.emitted]
    assert stream == truth and stream[:4] == free[:4]
    answer = stream[4:]
    while TEXT.text(answer[:1]).isspace():  # up to 8 whitespace characters may follow the end of thinking
        answer = answer[1:]
    check_valid("regex", answer)


def test_grammars_of_another_vocabulary_are_refused(pair):
    _, params = pair
    other = compile_constraint(CONSTRAINTS["regex"], vocabulary(JSON_PIECES, 256))
    with pytest.raises(ValueError, match="compiled for a vocabulary of 256 tokens constrains a model of 128"):
        list(dspark_fn.generate(params, PROMPTS[0], 4, constraint=other))
    with pytest.raises(ValueError, match="one compiled Grammar"):
        dspark_fn.Decoder(params, 2, width=WIDTH).insert(PROMPTS[:2], constraints=[CONSTRAINTS["regex"], None])
