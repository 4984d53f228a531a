"""Images through the server, with the ``openai`` client: a tiny Gemma 4
release (``multimodal.py``) served in this process.

- a data-URL image in a chat message, and as a Responses ``input_image``,
  answers as ``generate`` does on the same prompt laid out by the chat
  template (what ``dspark generate --image`` runs);
- a second turn about the same image reuses the first turn's cache
  (``cached_tokens`` in ``usage``) and never encodes the image again;
- ``file://`` URLs only behind ``--allow-image-files``, ``http(s)://`` only
  behind ``--allow-image-urls`` (a failed fetch named), and bad images (not
  base64, truncated, a decompression bomb, too many for the context, sent to
  a text-only target) get a 400 naming the problem before anything is queued.
"""

import base64
import http.server
import io
import threading
from types import SimpleNamespace

import pytest

import dspark_fn
from dspark_fn.catalog import load_named
from dspark_fn.chat import stop_tokens
from dspark_fn.serve.app import create_app
from dspark_fn.serve.engine import Engine
from dspark_fn.serve.images import ImageSources
from dspark_fn.vision import image_prompt
from helpers import running
from multimodal import chat_text, synthetic_image, write_pair
from test_images import png

openai = pytest.importorskip("openai")

IMAGE = synthetic_image(24, 40, seed=1)
QUESTION = "What is in this picture?"
TOKENS = 24


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(url: str, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-images")
    write_pair(root, "gemma4")
    params, tokenizer, _ = load_named(str(root / "target"), str(root / "draft"))
    return SimpleNamespace(root=root, params=params, tokenizer=tokenizer)


class Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """A local web server of ``picture.png``."""
    root = tmp_path_factory.mktemp("web")
    (root / "picture.png").write_bytes(png_bytes(IMAGE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Files(*a, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def engine(release):
    engine = Engine(release.params, max_batch=2, max_context=512, width=None)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def strict(release, engine):
    """The server as started by default: data: URLs only."""
    with running(create_app(engine, release.tokenizer, "m")) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def open_server(release, engine):
    """Started with --allow-image-files --allow-image-urls."""
    with running(create_app(engine, release.tokenizer, "m", image_sources=ImageSources(files=True, urls=True))) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def reference_text(release, text: str, images: list) -> str:
    """What ``generate`` writes for the prompt, up to the stop token, as the server detokenizes it."""
    stops = stop_tokens(release.tokenizer)
    prompt = image_prompt(release.params, text, images)
    tokens = [t for e in dspark_fn.generate(release.params, [prompt], TOKENS, stop_tokens=stops) for t in e.emitted]
    detokenizer = release.tokenizer.detokenizer
    detokenizer.reset()
    for token in tokens:
        if token not in stops:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def test_a_data_url_image_answers_as_generate(release, strict):
    reply = strict.chat.completions.create(model="m", messages=[image_message(data_url(png_bytes(IMAGE)))],
                                           max_tokens=TOKENS, temperature=0)
    expected = reference_text(release, chat_text(release.tokenizer, QUESTION, 1), [IMAGE])
    assert expected and reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(image_prompt(release.params, chat_text(release.tokenizer, QUESTION, 1),
                                                         [IMAGE]))


def test_a_responses_input_image_answers_as_generate(release, strict):
    response = strict.responses.create(model="m", max_output_tokens=TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png_bytes(IMAGE))},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == reference_text(release, chat_text(release.tokenizer, QUESTION, 1), [IMAGE])


def test_a_second_turn_about_the_image_reuses_its_cache(release, engine, strict):
    """The second turn's prompt starts with the first's (its image by content,
    sent again as another encoding of the same picture): the prompt cache
    serves it, and the image is not run through the tower again."""
    first = [image_message(data_url(png_bytes(IMAGE)))]
    reply = strict.chat.completions.create(model="m", messages=first, max_tokens=8, temperature=0)
    encoded = engine.stats()["images_encoded"]
    buffer = io.BytesIO()
    IMAGE.save(buffer, "BMP")  # the same pixels in another format: the same content hash
    second = [image_message("data:image/bmp;base64," + base64.b64encode(buffer.getvalue()).decode()),
              {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "user", "content": "And its colours?"}]
    again = strict.chat.completions.create(model="m", messages=second, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(
        image_prompt(release.params, chat_text(release.tokenizer, QUESTION, 1), [IMAGE])) - 1
    assert engine.stats()["images_encoded"] == encoded


def test_another_image_of_the_same_size_is_not_served_from_the_cache(release, strict):
    """Same text, same token count, other pixels: the cache keys images by
    content, so nothing from the image on is reused, and the answer is the
    other image's."""
    strict.chat.completions.create(model="m", messages=[image_message(data_url(png_bytes(IMAGE)))], max_tokens=4)
    other = synthetic_image(24, 40, seed=9)
    reply = strict.chat.completions.create(model="m", messages=[image_message(data_url(png_bytes(other)))],
                                           max_tokens=TOKENS, temperature=0)
    prompt = image_prompt(release.params, chat_text(release.tokenizer, QUESTION, 1), [other])
    assert reply.usage.prompt_tokens_details.cached_tokens <= prompt.image_ranges()[0][0]
    expected = reference_text(release, chat_text(release.tokenizer, QUESTION, 1), [other])
    assert reply.choices[0].message.content == expected
    assert expected != reference_text(release, chat_text(release.tokenizer, QUESTION, 1), [IMAGE])


def test_file_and_web_images_only_when_allowed(release, strict, open_server, web, tmp_path):
    path = tmp_path / "picture.png"
    path.write_bytes(png_bytes(IMAGE))
    expected = reference_text(release, chat_text(release.tokenizer, QUESTION, 1), [IMAGE])
    for url, flag in ((path.as_uri(), "--allow-image-files"), (web + "/picture.png", "--allow-image-urls")):
        with pytest.raises(openai.BadRequestError, match=flag):
            strict.chat.completions.create(model="m", messages=[image_message(url)], max_tokens=TOKENS)
        reply = open_server.chat.completions.create(model="m", messages=[image_message(url)], max_tokens=TOKENS,
                                                    temperature=0)
        assert reply.choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        open_server.chat.completions.create(model="m", messages=[image_message(web + "/missing.png")])
    with pytest.raises(openai.BadRequestError, match="cannot be read"):
        open_server.chat.completions.create(model="m", messages=[image_message((tmp_path / "gone.png").as_uri())])


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@", "base64 does not decode"),
    ("data:image/png," + "x" * 8, "must be base64"),
    (data_url(png_bytes(IMAGE)[:200]), "could not be decoded"),
    (data_url(b"plain text, no image"), "is not an image"),
    (data_url(png(6000, 6000)), "at most 33,554,432"),
    ("ftp://example.com/a.png", "scheme 'ftp'"),
])
def test_bad_images_get_a_400_before_anything_is_queued(engine, strict, url, message):
    before = engine.stats()["queue"]
    with pytest.raises(openai.BadRequestError, match=message):
        strict.chat.completions.create(model="m", messages=[image_message(url)], max_tokens=4)
    assert engine.stats()["queue"] == before


def test_too_many_images_for_the_context(strict):
    url = data_url(png_bytes(IMAGE))
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 40}
    with pytest.raises(openai.BadRequestError, match=r"with its 40 image\(s\) takes \d+ tokens; the context holds 512"):
        strict.chat.completions.create(model="m", messages=[message], max_tokens=4)


def test_images_to_a_text_target_are_refused(release):
    class TextEngine:
        max_context, failure, dead, grammars = 512, None, False, None
        params = SimpleNamespace(vision=None, spec=SimpleNamespace(target=SimpleNamespace(model_type="qwen3",
                                                                                          vocab_size=1024)))
        decoder = SimpleNamespace(planner=SimpleNamespace(max_width=1))

        def stats(self):
            return {}

        def close(self):
            pass

    with running(create_app(TextEngine(), release.tokenizer, "m")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"this target \(qwen3\) takes no images"):
            client.chat.completions.create(model="m", messages=[image_message(data_url(png_bytes(IMAGE)))])
