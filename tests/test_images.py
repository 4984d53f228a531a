"""Images in, DSpark out: each release that takes images (``multimodal.RELEASES``:
Gemma 4 with a vision encoder, with per-layer inputs, and unified (the
12B's patch embedder); Qwen3.5; LFM2-VL) on a tiny random release in the published
layout, against mlx-vlm's own model of the same checkpoint, the same image
and the same prompt.

- the image prefill (chunks of 8: Gemma's image spans, which attend both
  ways, are never cut; Qwen's multimodal positions and LFM2-VL's
  convolutions run across chunk ends): the target's logits and taps at
  every position within the fp32 bound of mlx-vlm's;
- the draft's context after the prefill holds the taps of every position,
  the image's included (``test_draft_context_covers_image_positions``);
- greedy output equals mlx-vlm's ``generate`` (no speculation) for 64
  tokens with always-right, always-wrong and partly-right proposals; a
  batch mixing image and text rows (images of two sizes) equals each row's
  own reference; ``generate``, ``Decoder.insert`` and ``dspark generate
  --image`` likewise; a cached image prefix is not encoded again; the
  round kernels do not trace again for other image sizes;
- bad input is refused, naming it, before anything runs.

Breaks tried (each restored after), and what caught them:
- the taps at image positions zeroed in the prefill chunk:
  test_draft_context_covers_image_positions (every family);
- Gemma's span overlay dropped (image tokens causal): test_image_prefill
  and the greedy tests [gemma4];
- a chunk allowed to cut a Gemma image span: test_image_prefill[gemma4];
- Qwen's position shift not added after the prompt (decoding at the
  slots): the greedy tests and the mixed batch [qwen3_5], and
  test_sampling's image case;
- Qwen's 3-D offsets dropped, or the height and width axes swapped in
  ``frequency_axes``: test_image_prefill[qwen3_5];
- image features left out (the image token's own embedding kept): the
  prefill and greedy tests [lfm2-vl];
- Gemma's per-layer inputs reading the image token's own row instead of the
  pad token's: the prefill and greedy tests [gemma4-per-layer].
"""

import io
import json
import struct
import zlib

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.checkpoints import load_tokenizer
from dspark_fn.prefilling import chunk_spans, image_rows
from dspark_fn.vision import image_prompt, read_image
from dspark_fn.kernel import TRACE_COUNTS
from helpers import PROPOSALS, build_pair, drive_proposals, speculative_tokens
from multimodal import RELEASES, Release, chat_text, synthetic_image, write_pair
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

NEW_TOKENS = 64
CHUNK = 8


@pytest.fixture(scope="module", params=sorted(RELEASES))
def release(request, tmp_path_factory):
    return Release(tmp_path_factory.mktemp(request.param), request.param)


IMAGE = synthetic_image(24, 40, seed=1)
OTHER = synthetic_image(40, 24, seed=2)  # another size: another number of image tokens


def chunked_prefill(params, prompt, taps: tuple):
    """The prompt's logits and taps at every position through the family's
    ``prompt_forward`` in chunks of ``CHUNK``, as the prefill lays them out."""
    spec = params.spec
    adapter = spec.target_adapter
    length = len(prompt.tokens)
    padded = -(-length // CHUNK) * CHUNK
    rows = image_rows(params, [prompt], np.array([0]), padded)
    tokens = mx.array([list(prompt.tokens) + [0] * (padded - length)])
    kv = adapter.init_kv(spec.target, 1, padded)
    logits, features, plan = [], [], chunk_spans(padded, (CHUNK,), rows.whole)
    for begin, size in plan:
        chunk, start, images = tokens[:, begin : begin + size], mx.array([begin]), rows.chunk(begin, size)
        if adapter.prompt_forward is None:
            hidden, tapped, kv = adapter.forward(spec.target, params.target, kv, chunk, start, taps, images=images)
        else:
            hidden, tapped, kv = adapter.prompt_forward(spec.target, params.target, kv, chunk, start, taps,
                                                        mx.array([0]), mx.array([length]), images=images)
        logits.append(np.array(adapter.logits(spec.target, params.target, hidden)[0]))
        features.append(np.array(tapped[0]))
    return np.concatenate(logits)[:length], np.concatenate(features)[:length], plan, rows.whole


def test_image_prefill_matches_mlx_vlm(release):
    """Logits and taps at every position of a prompt with an image, prefilled
    in chunks of 8, against mlx-vlm's one-call prefill; a chunk never cuts a
    span that attends both ways."""
    taps = tuple(range(release.params.spec.target.num_layers))
    text = release.text("What is in this picture?", 1)
    prompt = image_prompt(release.params, text, [IMAGE])
    logits, features, plan, whole = chunked_prefill(release.params, prompt, taps)
    expected_logits, expected_features = release.reference(text, [IMAGE], taps)
    assert list(prompt.tokens) == np.array(release.inputs(text, [IMAGE])["input_ids"])[0].tolist()
    assert_fp32_close(logits, expected_logits, "prefill logits", **release.budget())
    assert_fp32_close(features, expected_features, "prefill taps", **release.budget())
    ends = {begin + size for begin, size in plan}
    assert not any(first < end < stop for first, stop in whole for end in ends)
    if release.family.startswith("gemma4"):
        assert whole and any(size > CHUNK for _, size in plan)  # the 15-token image stretched its chunk


def test_draft_context_covers_image_positions(release):
    """After ``prefill``, the draft's context holds the projected taps of
    every prompt position, image positions included: equal to the context
    the draft builds from mlx-vlm's own taps. Zeroing the taps at image
    positions fails here."""
    params = release.params
    spec = params.spec
    text = release.text("Describe it.", 1)
    prompt = image_prompt(params, text, [IMAGE])
    length = len(prompt.tokens)
    cache, first = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 512), [prompt])
    logits, features = release.reference(text, [IMAGE], spec.taps)
    assert first.tolist() == [int(np.argmax(logits[-1]))]
    context = spec.draft_arch.init_context(spec.draft, 1, 512)
    expected = spec.draft_arch.extend_context(spec.draft, params.draft, context, mx.array(features)[None],
                                              mx.array([0]))
    image_slots = mx.array(prompt.image_slots())
    assert image_slots.size
    for (keys, values), (want_keys, want_values) in zip(cache.draft, expected):
        for ours, want, what in ((keys, want_keys, "keys"), (values, want_values, "values")):
            assert_fp32_close(ours[0, :, :length], want[0, :, :length], f"draft context {what}", **release.budget())
            assert_fp32_close(ours[0, :, image_slots], want[0, :, image_slots], f"draft context {what} at the image",
                              **release.budget())


@pytest.mark.parametrize("kind", sorted(PROPOSALS))
def test_greedy_equals_mlx_vlm_generate(release, kind):
    """64 tokens after a prompt with an image, verifying proposals built from
    mlx-vlm's greedy stream: every round keeps exactly the right prefix."""
    width = release.params.spec.block_size + 1
    text = release.text("Tell me a story about it.", 1)
    truth = release.greedy(text, [IMAGE], NEW_TOKENS + width)
    prompt = image_prompt(release.params, text, [IMAGE])
    vocab = release.params.spec.target.vocab_size
    drive_proposals(None, release.params, vocab, [prompt], kind, NEW_TOKENS, truths=[truth])
    assert len(set(truth[:NEW_TOKENS])) >= 8  # varied text, or equality proves little


def test_a_batch_of_image_and_text_rows_equals_each_row(release):
    """Rows with images of two sizes and a text row in one batch, each
    accepting at its own pace: each equals its own reference."""
    width = release.params.spec.block_size + 1
    cases = [(release.text("Tell me about it.", 1), [IMAGE]), (release.text("Hello there, friend.", 0), []),
             (release.text("Compare the two.", 2), [OTHER, IMAGE])]
    truths = [release.greedy(text, images, 48 + width) for text, images in cases]
    prompts = [image_prompt(release.params, text, images) if images
               else np.array(release.inputs(text, [])["input_ids"])[0].tolist() for text, images in cases]
    vocab = release.params.spec.target.vocab_size
    drive_proposals(None, release.params, vocab, prompts, "partly-right", 48, shift=2, truths=truths, capacity=1024)


# ---- the driver and the command line


def test_generate_equals_mlx_vlm_generate(release):
    """``generate`` (the driver: the draft gate, copies, widths by Algorithm 1) after an image prompt."""
    text = release.text("Tell me a story about it.", 1)
    prompt = image_prompt(release.params, text, [IMAGE])
    assert speculative_tokens(release.params, [prompt], NEW_TOKENS) == release.greedy(text, [IMAGE], NEW_TOKENS)


def test_generate_batch_of_image_and_text_rows_equals_each_alone(release):
    texts = [release.text("What is in it?", 1), release.text("Say something.", 0), release.text("Both?", 2)]
    prompts = [image_prompt(release.params, texts[0], [OTHER]),
               np.array(release.inputs(texts[1], [])["input_ids"])[0].tolist(),
               image_prompt(release.params, texts[2], [IMAGE, OTHER])]
    together = [[] for _ in prompts]
    for event in dspark_fn.generate(release.params, prompts, 40):
        together[event.tag] += event.emitted
    assert together == [speculative_tokens(release.params, [prompt], 40) for prompt in prompts]


def sequence_tokens(decoder, tag, step) -> list:
    """Sequence ``tag``'s tokens from ``step`` on, until it ends (its ``Ended`` record's)."""
    while True:
        ended = [record for record in step.ended if record.tag == tag]
        if ended:
            return ended[0].tokens
        step = decoder.step()


def test_decoder_inserts_an_image_prompt_into_a_running_batch(release):
    """A text sequence runs; an image prompt joins it between rounds and decodes as mlx-vlm does."""
    params = release.params
    text = release.text("Tell me about it.", 1)
    decoder = dspark_fn.Decoder(params, 2)
    decoder.insert([np.array(release.inputs(release.text("Hi.", 0), [])["input_ids"])[0].tolist()], tags=["text"],
                   max_new_tokens=40)
    for _ in range(3):
        decoder.step()
    step = decoder.insert([image_prompt(params, text, [IMAGE])], tags=["image"], max_new_tokens=30)
    assert sequence_tokens(decoder, "image", step) == release.greedy(text, [IMAGE], 30)


def test_a_cached_image_prefix_is_not_encoded_again(release):
    """A later turn about the same image continues from the cache of the
    first (as the server's prompt cache hands it over): its image is not
    encoded again, and it decodes as the whole prompt would."""
    params, vision = release.params, release.params.vision
    first = image_prompt(params, release.text("Tell me about it.", 1), [IMAGE])
    cached, _ = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 512), [first])
    later = image_prompt(params, release.text("Tell me about it.", 1) + "Then", [IMAGE])
    assert later.tokens[: len(first)] == first.tokens
    alone = speculative_tokens(params, [later], 16)
    encoded = vision.encoded
    decoder = dspark_fn.Decoder(params, 1)
    step = decoder.insert([later], tags=["later"], prefix=cached, max_new_tokens=16)
    assert vision.encoded == encoded
    assert sequence_tokens(decoder, "later", step) == alone


def traces_during(fn) -> dict:
    before = TRACE_COUNTS.copy()
    fn()
    return {k: TRACE_COUNTS[k] - before[k] for k in TRACE_COUNTS if TRACE_COUNTS[k] != before[k]}


def test_rounds_compile_once_whatever_the_image_sizes(release):
    """Images of other sizes (other numbers of image tokens) enter through the
    prefill only: the round kernels do not trace again."""
    text = release.text("What is it?", 1)
    run = lambda prompt: speculative_tokens(release.params, [prompt], 24, width=None, capacity=1024)  # noqa: E731
    run(image_prompt(release.params, text, [IMAGE]))
    again = traces_during(lambda: [run(image_prompt(release.params, release.text("And this?", n), images))
                                   for n, images in ((1, [OTHER]), (2, [OTHER, synthetic_image(32, 32, 3)]))])
    assert set(again) <= {"prefill_images"}, again  # a span that stretches its chunk: a prefill kernel of that size


def test_dspark_generate_image(release, tmp_path, capsys):
    """``dspark generate --image PATH "prompt"`` prints the tokens mlx-vlm's
    generate gives for that image and the prompt in a user turn (up to the
    release's stop token, which ends the CLI's reply)."""
    from dspark_fn.cli import main

    IMAGE.save(tmp_path / "picture.png")
    root = release.root
    code = main(["generate", "--model", str(root / "target"), "--draft", str(root / "draft"), "--image",
                 str(tmp_path / "picture.png"), "What is in this picture?", "--max-tokens", "24", "--json"])
    assert code == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    expected = release.greedy(release.text("What is in this picture?", 1), [IMAGE], 24)
    assert tokens == expected[: len(tokens)] and (len(tokens) == 24 or tokens[-1] in release.described["stops"])


def test_dspark_generate_refuses_what_it_cannot_read(release, tmp_path, capsys):
    from dspark_fn.cli import main

    root = release.root
    model = ["--model", str(root / "target"), "--draft", str(root / "draft")]
    (tmp_path / "cut.png").write_bytes(encoded(synthetic_image(64, 64))[:300])
    assert main(["generate", *model, "--image", str(tmp_path / "cut.png"), "What is it?"]) == 2
    assert "image 1 could not be decoded (truncated or corrupt)" in capsys.readouterr().err
    assert main(["generate", *model, "--image", str(tmp_path / "cut.png"), "--prompt-tokens", "1,2,3"]) == 2
    assert "--image goes with one text prompt" in capsys.readouterr().err


# ---- bad input, refused before anything runs


def png(width: int, height: int, body: bytes = b"\x00") -> bytes:
    """A PNG whose header claims ``width`` x ``height`` RGB pixels, with a tiny body."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(body)) + chunk(b"IEND", b"")


def encoded(image, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind)
    return buffer.getvalue()


def test_unreadable_truncated_and_bomb_images_are_refused():
    with pytest.raises(ValueError, match="image 1 is not an image"):
        read_image(b"these bytes are text")
    whole = encoded(synthetic_image(64, 64))
    with pytest.raises(ValueError, match="image 2 could not be decoded"):
        read_image(whole[: len(whole) // 2], index=1)
    with pytest.raises(ValueError, match=r"6000 x 6000 pixels .* at most 33,554,432"):
        read_image(png(6000, 6000))  # 36 megapixels in a few bytes
    with pytest.raises(ValueError, match="decompression bomb"):
        read_image(png(100_000, 100_000))  # past PIL's own bound: refused as it opens
    with pytest.raises(ValueError, match="no such file"):
        read_image("/nonexistent/picture.png")
    assert read_image(whole).size == (64, 64)


def test_images_to_a_text_target_are_refused(tmp_path):
    from dspark_fn.vision import image_families

    build_pair(tmp_path, {**__import__("helpers").target_config()}, block_size=3)
    params = dspark_fn.load(tmp_path / "target", tmp_path / "draft")
    with pytest.raises(ValueError, match=r"this target \(qwen3\) takes no images.*gemma4.*lfm2-vl.*qwen3_5"):
        image_prompt(params, "look: <image>", [IMAGE])
    assert {"gemma4", "gemma4_unified", "qwen3_5", "qwen3_5_moe", "lfm2-vl"} == set(image_families())


def test_a_release_without_its_tower_tensors_is_refused_before_it_runs(tmp_path):
    """Found when the release loads, told when an image comes (not in the middle of a prefill)."""
    write_pair(tmp_path, "qwen3_5")
    path = tmp_path / "target" / "model.safetensors"
    weights = mx.load(str(path))
    del weights["model.visual.blocks.0.attn.qkv.weight"]
    mx.save_safetensors(str(path), weights)
    params = dspark_fn.load(tmp_path / "target", tmp_path / "draft")
    with pytest.raises(ValueError, match=r"lacks 1 tensors of its vision side \(vision_tower.blocks.0.attn.qkv"):
        image_prompt(params, chat_text(load_tokenizer(tmp_path / "target"), "Hi", 1), [IMAGE])


def test_placeholders_and_context_are_checked(release):
    text = release.text("Two pictures?", 1)
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\) .* for 2 image\(s\)"):
        image_prompt(release.params, text, [IMAGE, OTHER])
    with pytest.raises(ValueError, match=r"with its 1 image\(s\) takes \d+ tokens .* the context holds 20"):
        image_prompt(release.params, text, [IMAGE], max_tokens=20)
