"""Guards for five promises the code keeps and no other test held: a stop
string split across rounds, a stop token kept, rows moved by a resize, a prefill's last chunk
past a capacity bucket, and a reduced draft vocabulary without a Markov head.

One tiny target (byte-level BPE tokenizer, readable greedy text) and a
draft without a Markov head serve every test here.

Breaks tried (each in a copy of the tree, this file run in a subprocess;
with the host checks on cache writes in place, and again with them turned
off), and the tests that catch them:
- the server's text stream without its hold-back (``hold = 0`` in
  ``Api.pieces``): the reply runs past the stop string to ``max_tokens``,
  finish reason "length",
  test_a_stop_string_split_across_two_rounds_is_held_back;
- the stream sending all its text at once but still searching back for a
  stop string (``ready = len(text)``): the stop string's first half is
  sent, the same test;
- ``Decoder.resize`` giving the moved rows their committed lengths in
  reverse order, those of the first rows instead of the live ones, or
  zeros: test_rows_moved_by_a_resize_keep_their_lengths_and_grow_the_cache
  and test_rows_moved_by_a_resize_store_their_own_prefixes (a stored
  prompt-cache entry whose tokens are not its cache's length, or one too
  short to be stored at all);
- ``prefill`` skipping the cache growth before its last chunk, or growing
  to the bucket of a chunk's start instead of its end:
  test_a_last_chunk_past_the_bucket_grows_the_cache[prefill / insert]
  (the capacity is asserted before anything runs; run, the chunk writes
  past its buffer and aborts the interpreter);
- a stop token dropped from the reply (``kept[:stop]`` in ``Row.cut``):
  test_a_stop_token_ends_a_reply_kept, and with it generate's and
  training's own tests (test_lossless.py, test_train.py);
- the draft vocabulary's index map shifted by one: ``vocab[(choice + 1) %
  V']`` or ``vocab[choice] + 1`` in ``rounds._draft``, or the output
  head's rows cut with the ids rolled by one at load
  (``checkpoints.draft_params_from_weights``):
  test_a_reduced_vocabulary_drafts_the_same_target_ids.
"""

import asyncio
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import build_draft, build_target, draft_config, mlx_lm_greedy, random_prompt, target_config
from mlx.utils import tree_flatten
from published import qwen_tokenizer

import dspark_fn
from dspark_fn.buffers import capacity_for
from dspark_fn.checkpoints import load_tokenizer, save_draft
from dspark_fn.drafts.vocab import reduced_checkpoint
from dspark_fn.prefilling import LONG_PREFILL_CHUNK, chunk_spans, smallest_chunk
from dspark_fn.serve.engine import Engine, Request

VOCAB = 300  # the test tokenizer's size
CONFIG = target_config("qwen3", vocab=VOCAB, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
DRAFT = draft_config(CONFIG, layers=1, taps=(0, 1), block_size=4, markov_rank=0) | {"confidence_head_with_markov": False}
FIRST_BUCKET = capacity_for(1)  # the cache a growing decoder starts with


def readable_only(directory, model, tokenizer):
    """Zero the (tied) embedding rows of every token that is not printable
    ASCII text, special tokens included, and save the target again: those
    tokens' logits are then 0 while the largest of the others' lies far
    above, so greedy decoding picks readable text and never a stop token."""
    weight = model.model.embed_tokens.weight
    readable = [i for i in range(weight.shape[0]) if i not in tokenizer.all_special_ids
                and (text := tokenizer.decode([i])).isascii() and text.isprintable()]
    keep = mx.zeros((weight.shape[0], 1), weight.dtype)
    keep[mx.array(readable)] = 1
    model.model.embed_tokens.weight = weight * keep
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """mlx-lm's model of the target, the pair loaded, and their directory."""
    root = tmp_path_factory.mktemp("guards")
    qwen_tokenizer(root / "target")
    model = build_target(root / "target", CONFIG, seed=5, vector_spread=0.4)
    model = readable_only(root / "target", model, load_tokenizer(root / "target"))
    build_draft(root / "draft", DRAFT, seed=6)
    return model, dspark_fn.load(root / "target", root / "draft"), root


def replies(requests: list) -> list:
    """Each engine request's tokens once it is done (a failure is an error here)."""
    answers = []
    for request in requests:
        tokens = []
        while True:
            kind, value, _ = request.events.get(timeout=120)
            if kind == "error":
                pytest.fail(value)
            if kind == "done":
                break
            tokens += value
        answers.append(tokens)
    return answers


# ---- 1. a stop string whose halves arrive in two rounds


async def texts(api, job) -> list:
    """The text of each piece the server's stream hands out for ``job`` (one request)."""
    [request] = api.submit(job)
    return [piece.text async for piece in api.pieces(job, request)]


async def streamed(api, job) -> tuple[str, str]:
    """A streamed reply's text and its last finish reason, read from the SSE chunks."""
    text, finish = "", None
    async for event in api.stream(job, api.submit(job)):
        if event.startswith("data: {"):
            for choice in json.loads(event[len("data: "):])["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def straddling_stop(pieces: list) -> tuple[str, int]:
    """A stop string of at least three characters: the end of one round's
    text and the start of the next round's (at most two of each), found
    nowhere earlier in the reply and not at its start; and where it starts."""
    full, boundary = "".join(pieces), 0
    for piece, following in zip(pieces, pieces[1:]):
        boundary += len(piece)
        start = boundary - len(piece[-2:])
        stop = full[start : boundary + len(following[:2])]
        if len(stop) >= 3 and full.find(stop) == start > 0:
            return stop, start
    pytest.fail(f"no round boundary to split a stop string over in {pieces!r}")


def test_a_stop_string_split_across_two_rounds_is_held_back(pair):
    """At verify width 1 every round adds one token: a stop string made of the
    end of one round's text and the start of the next one's is cut from the
    reply (plain and streamed), nothing of it is sent, and the finish reason
    is "stop"."""
    pytest.importorskip("fastapi")
    from dspark_fn.serve.app import Api

    _, params, root = pair
    engine = Engine(params, max_batch=1, max_context=128, width=1)
    try:
        api = Api(engine, load_tokenizer(root / "target"), "guards")
        body = {"prompt": "hello world", "max_tokens": 30, "temperature": 0}
        pieces = asyncio.run(texts(api, api.reader.job(body, "text")))
        stop, cut = straddling_stop(pieces)
        job = api.reader.job(body | {"stop": [stop]}, "text")
        reply = asyncio.run(api.complete(job, api.submit(job)))["choices"][0]
        assert (reply["text"], reply["finish_reason"]) == ("".join(pieces)[:cut], "stop")
        assert asyncio.run(streamed(api, api.reader.job(body | {"stop": stop, "stream": True}, "text"))) == (
            "".join(pieces)[:cut], "stop"
        )
    finally:
        engine.close()


def test_a_stop_token_ends_a_reply_kept(pair):
    """A request's stop token, reached inside a round of several tokens, ends
    its reply with the stop token kept and counted: the rule the decoder's
    rows own (``driver.Row.cut``), the same one ``generate`` and the
    trainer's answering read."""
    model, params, _ = pair
    prompt = random_prompt(np.random.default_rng(4), 30, VOCAB)
    truth = mlx_lm_greedy(model, prompt, 24)
    stop = truth[6]
    cut = truth[: truth.index(stop) + 1]
    engine = Engine(params, max_batch=2, max_context=128, width=3)
    try:
        request = engine.submit(Request(prompt=prompt, max_tokens=24, stop_tokens=frozenset({stop})))
        assert replies([request]) == [cut] and request.produced == len(cut)
    finally:
        engine.close()


# ---- 2. rows that a resize moves keep their own committed lengths


def test_rows_moved_by_a_resize_keep_their_lengths_and_grow_the_cache(pair):
    """Four rows, the first and third released, the batch resized to two: the
    live rows move to the front with their own committed lengths, and
    decoding on past the first capacity bucket (the cache grows for the
    longer row) gives each the target's greedy stream."""
    model, params, _ = pair
    rng = np.random.default_rng(2)
    prompts = [random_prompt(rng, length, VOCAB) for length in (30, 190, 60, 236)]
    decoder = dspark_fn.Decoder(params, 4, width=3)
    streams = decoder.insert(prompts).emitted  # tags 0..3 in rows 0..3

    def take(step):
        for tag, emitted in zip(step.tags, step.emitted):
            streams[tag] += emitted

    for _ in range(2):
        take(decoder.step())
    decoder.release(0)
    decoder.release(2)
    decoder.resize(2)  # sequences 1 and 3 move to rows 0 and 1
    assert decoder.committed.tolist() == decoder.cache.length.tolist()
    assert decoder.cache.capacity == FIRST_BUCKET  # it grows after the resize
    while min(len(prompts[tag]) + len(streams[tag]) for tag in (1, 3)) < FIRST_BUCKET + 24:
        take(decoder.step())
    assert decoder.cache.capacity > FIRST_BUCKET
    assert [streams[tag] for tag in (1, 3)] == [mlx_lm_greedy(model, prompts[t], len(streams[t])) for t in (1, 3)]


def test_rows_moved_by_a_resize_store_their_own_prefixes(pair):
    """Three requests start together in a batch of four; the first ends after
    one round, so the batch shrinks to two and the others move to rows 0
    and 1. Each finished request's prompt-cache entry holds exactly the
    tokens its cache row committed, and a follow-up of each conversation
    reuses it and answers as the target does."""
    model, params, _ = pair
    rng = np.random.default_rng(3)
    prompts = [random_prompt(rng, length, VOCAB) for length in (20, 40, 70)]
    budgets = [2, 30, 20]
    engine = Engine(params, max_batch=4, max_context=128, width=3)
    moves, resize = [], engine.decoder.resize

    def recorded_resize(batch: int) -> None:
        moves.append((engine.decoder.batch, batch))
        resize(batch)

    engine.decoder.resize = recorded_resize
    try:
        with engine.wake:  # held while submitting: the engine admits all three at once
            requests = [engine.submit(Request(p, n)) for p, n in zip(prompts, budgets)]
        answers = replies(requests)
        assert (4, 2) in moves  # requests in rows 1 and 2 moved to rows 0 and 1
        truths = [p + mlx_lm_greedy(model, p, n + DRAFT["block_size"] + 1) for p, n in zip(prompts, budgets)]
        assert answers == [t[len(p) : len(p) + n] for t, p, n in zip(truths, prompts, budgets)]
        stored = engine.prompt_cache.entries
        assert len(stored) == 3
        for (_, key), (cache, _) in stored.items():
            truth = next(t for t, p in zip(truths, prompts) if list(key[: len(p)]) == p)
            assert int(cache.length[0]) == len(key) and list(key) == truth[: len(key)]
        for prompt, answer, truth in list(zip(prompts, answers, truths))[1:]:
            follow_up = prompt + answer + [(truth[len(prompt) + len(answer)] + 1) % VOCAB]
            request = engine.submit(Request(follow_up, 6))
            assert replies([request]) == [mlx_lm_greedy(model, follow_up, 6)]
            assert len(prompt) + len(answer) - 1 <= request.cached_tokens <= len(prompt) + len(answer)
    finally:
        engine.close()


# ---- 3. a prompt whose last chunk needs a larger bucket than the chunk before it

PROMPT_LENGTH = 260


@pytest.mark.parametrize("how", ["prefill", "insert"])
def test_a_last_chunk_past_the_bucket_grows_the_cache(pair, how):
    """A 260-token prompt prefilled into a growing cache of 256 slots: its
    chunks are 256 + 64 tokens (256 + 8 on the bundled BLAS), the last one
    needs the 512-slot bucket. The
    cache has grown to hold it (checked before anything runs: a short buffer
    would be written past its end), and decoding goes on as the target's."""
    model, params, _ = pair
    padded = -(-PROMPT_LENGTH // smallest_chunk()) * smallest_chunk()
    spans = chunk_spans(padded, (LONG_PREFILL_CHUNK, smallest_chunk()))
    last, size = spans[-1]
    assert capacity_for(last) == FIRST_BUCKET < capacity_for(last + size)  # what this prompt is for
    prompt = random_prompt(np.random.default_rng(4), PROMPT_LENGTH, VOCAB)
    empty = dspark_fn.init_cache(params, 1, FIRST_BUCKET)
    if how == "prefill":
        cache, tokens = dspark_fn.prefill(params, empty, prompt, grow=True)
    else:
        cache, tokens = dspark_fn.insert(params, empty, [0], [prompt], grow=True)
    capacity = cache.capacity  # an int: a failing assert must not print (and so run) the cache
    assert capacity >= last + size
    stream = tokens.tolist()
    while len(stream) < 8:
        cache, result = dspark_fn.speculate(params, cache, tokens, width=3)
        stream += result.emitted[0, : result.count.item()].tolist()
        tokens = result.next_tokens
    assert stream[:8] == mlx_lm_greedy(model, prompt, 8)


# ---- 4. a reduced vocabulary's drafted ids, without a Markov head to notice


def test_a_reduced_vocabulary_drafts_the_same_target_ids(pair, tmp_path):
    """A draft without a Markov head, cut to a vocabulary holding every token
    it drafts (and others): round for round it drafts the same target ids
    as the whole draft, so verification accepts and emits the same."""
    _, params, root = pair
    rng = np.random.default_rng(5)
    prompt = random_prompt(rng, 12, VOCAB)

    def rounds(pair_params):
        events = dspark_fn.generate(pair_params, prompt, 24, width=None, proposals="draft")
        return [(e.drafted, e.accepted, e.emitted) for e in events if e.kind == "round"]

    whole = rounds(params)
    drafted = {token for round_ in whole for token in round_[0]}
    others = rng.choice(sorted(set(range(VOCAB)) - drafted), 40, replace=False).tolist()
    ids = np.array(sorted(drafted | set(others)), np.int32)
    assert len(ids) < VOCAB // 2
    config = json.loads((root / "draft" / "config.json").read_text())
    weights = mx.load(str(root / "draft" / "model.safetensors"))
    reduced = dspark_fn.load(root / "target", save_draft(tmp_path / "reduced", *reduced_checkpoint(config, weights, ids)))
    assert (reduced.spec.draft.markov_rank, reduced.spec.draft.draft_vocab_size) == (0, len(ids))
    assert rounds(reduced) == whole
