"""Images through the server, with the ``openai`` client: a tiny Gemma 4
release (``multimodal.py``) served in this process.

- a data-URL image in a chat message, and as a Responses ``input_image``,
  answers as ``generate`` does on the same prompt laid out by the chat
  template (what ``dspark generate --image`` runs);
- a second turn about the same image reuses the first turn's cache
  (``cached_tokens`` in ``usage``) and never encodes the image again;
- ``file://`` URLs only behind ``--allow-image-files DIR``, ``http(s)://``
  only behind ``--allow-image-urls`` (a failed fetch named), and bad images
  (not base64, truncated, a decompression bomb, more than ``--max-images``,
  more pixels together than ``--max-image-pixels``, too many for the
  context, sent to a text-only target) get a 400 naming the problem before
  anything is queued.

``ImageSources`` on its own, no model:

- a file is read only if it is a regular file under the directory:
  ``/dev/zero`` and a FIFO are refused at once (never read, never waited
  on), and a missing file, one outside the directory and a symlink out of it
  get one and the same message;
- the image count is refused before any image is read, and the pixels the
  headers state before any image is decoded;
- a fetch reaches only public addresses (the first URL's and every
  redirect's), follows at most three redirects, and ends at one deadline
  however slowly, and steadily, the server sends.
"""

import base64
import http.server
import io
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote

import pytest

import dspark_fn
from dspark_fn.catalog import load_named
from dspark_fn.chat import stop_tokens
from dspark_fn.cli import build_parser, image_sources
from dspark_fn.serve import images
from dspark_fn.serve.app import create_app
from dspark_fn.serve.engine import Engine
from dspark_fn.serve.errors import ApiError
from dspark_fn.serve.images import FILE_REFUSAL, ImageSources, is_public_address
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
    """The files of its directory; ``/redirect?to=URL`` answers a 302 to URL, ``/loop`` a 302 to itself."""

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path in ("/redirect", "/loop"):
            self.send_response(302)
            self.send_header("Location", unquote(query.removeprefix("to=")) if path == "/redirect" else "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """A local web server of ``picture.png`` (and of ``Files``' redirects)."""
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
def image_dir(tmp_path_factory):
    """The directory ``open_server`` reads image files from."""
    return tmp_path_factory.mktemp("image-dir")


@pytest.fixture(scope="module")
def open_server(release, engine, image_dir):
    """Started with --allow-image-files DIR --allow-image-urls --max-images 64,
    and let fetch from this machine (the tests' web server is on 127.0.0.1)."""
    sources = ImageSources(files=image_dir, urls=True, max_images=64, allow_private_hosts=True)
    with running(create_app(engine, release.tokenizer, "m", image_sources=sources)) as base:
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


@pytest.mark.parametrize("source", ["base64", "url"])
def test_an_anthropic_image_block_answers_as_chat_completions(release, engine, open_server, web, source):
    """An ``image`` block (base64, or a url source behind --allow-image-urls)
    in a Messages request answers as the same image sent as an image_url
    part through chat completions; the same bounds refuse a bad one."""
    anthropic = pytest.importorskip("anthropic")
    chat = open_server.chat.completions.create(model="m", messages=[image_message(data_url(png_bytes(IMAGE)))],
                                               max_tokens=TOKENS, temperature=0)
    sent = ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(IMAGE)).decode()}
            if source == "base64" else {"type": "url", "url": web + "/picture.png"})
    client = anthropic.Anthropic(base_url=str(open_server.base_url).removesuffix("/v1/"), api_key="unused",
                                 max_retries=0)
    message = client.messages.create(model="m", max_tokens=TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": sent}, {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == chat.choices[0].message.content
    with pytest.raises(anthropic.BadRequestError, match="base64 does not decode"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}]}])


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


def test_file_and_web_images_only_when_allowed(release, strict, open_server, web, image_dir):
    path = image_dir / "picture.png"
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
    with pytest.raises(openai.BadRequestError, match="image file URL not readable"):
        open_server.chat.completions.create(model="m", messages=[image_message((image_dir / "gone.png").as_uri())])


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


def test_too_many_images_for_the_context(open_server):
    url = data_url(png_bytes(IMAGE))
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 40}
    with pytest.raises(openai.BadRequestError, match=r"with its 40 image\(s\) takes \d+ tokens; the context holds 512"):
        open_server.chat.completions.create(model="m", messages=[message], max_tokens=4)


def test_more_images_than_max_images_are_refused(engine, strict):
    """Nine of them, each fine alone (the default allows eight)."""
    url = data_url(png_bytes(IMAGE))
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 9}
    before = engine.stats()["images_encoded"]
    with pytest.raises(openai.BadRequestError, match=r"9 images in one request; at most 8 .*--max-images"):
        strict.chat.completions.create(model="m", messages=[message], max_tokens=4)
    assert engine.stats()["images_encoded"] == before


def test_images_of_more_pixels_together_than_one_image_may_have_are_refused(strict):
    """Two 5000 x 5000 headers: each under the one-image bound, together over the request's."""
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(5000, 5000))}}] * 2}
    with pytest.raises(openai.BadRequestError, match="50,000,000 pixels; at most 33,554,432 are taken per request"):
        strict.chat.completions.create(model="m", messages=[message], max_tokens=4)


def test_images_to_a_text_target_are_refused(release):
    class TextEngine:
        max_context, failure, dead, grammars = 512, None, False, None
        params = SimpleNamespace(vision=None, spec=SimpleNamespace(target=SimpleNamespace(model_type="qwen3",
                                                                                          vocab_size=1024)))
        decoder = SimpleNamespace(widest=1)

        def stats(self):
            return {}

        def close(self):
            pass

    with running(create_app(TextEngine(), release.tokenizer, "m")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"this target \(qwen3\) takes no images"):
            client.chat.completions.create(model="m", messages=[image_message(data_url(png_bytes(IMAGE)))])


# ``ImageSources`` alone: files


def outcome_within(seconds: float, read):
    """What ``read()`` returned or raised; the test fails if it takes more than ``seconds``."""
    outcome = []

    def run():
        try:
            outcome.append(read())
        except BaseException as error:  # MemoryError included: the old /dev/zero read
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still reading after {seconds} s"
    return outcome[0]


def refusal(sources: ImageSources, url: str, seconds: float = 1.0) -> str:
    """The message of the ``ApiError`` reading ``url`` raises, within ``seconds``."""
    outcome = outcome_within(seconds, lambda: sources.read(url, "messages"))
    assert isinstance(outcome, ApiError), f"{url} was read: {outcome!r}"[:200]
    assert outcome.status == 400 and outcome.param == "messages"
    return outcome.message


def test_a_regular_file_under_the_directory_is_read(tmp_path):
    (tmp_path / "sub").mkdir()
    picture = tmp_path / "sub" / "picture.png"
    picture.write_bytes(png_bytes(IMAGE))
    (tmp_path / "alias.png").symlink_to(picture)  # a symlink that stays inside is followed
    sources = ImageSources(files=tmp_path)
    for path in (picture, tmp_path / "alias.png"):
        assert sources.read(path.as_uri(), "messages") == png_bytes(IMAGE)


def test_dev_zero_is_refused_not_read(tmp_path):
    """``/dev/zero`` reports size 0: read by its size it never ends. Named in
    the directory or through a symlink into it, it is refused at once."""
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    assert refusal(ImageSources(files=Path("/dev")), "file:///dev/zero") == FILE_REFUSAL
    assert refusal(ImageSources(files=tmp_path), (tmp_path / "zero.png").as_uri()) == FILE_REFUSAL


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    assert refusal(ImageSources(files=tmp_path), fifo.as_uri()) == FILE_REFUSAL


def test_every_refused_file_gets_the_same_message(tmp_path):
    """Missing, outside the directory (there, or through a symlink), a
    directory, a FIFO: one message, naming no path, so a client cannot probe
    which paths exist."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside.png"
    allowed.mkdir()
    outside.write_bytes(png_bytes(IMAGE))
    (allowed / "escape.png").symlink_to(outside)
    (allowed / "folder").mkdir()
    os.mkfifo(allowed / "pipe.png")
    sources = ImageSources(files=allowed)
    urls = [(allowed / name).as_uri() for name in ("missing.png", "escape.png", "folder", "pipe.png")]
    urls += [outside.as_uri(), (allowed / ".." / "outside.png").as_uri(), "file:///etc/passwd"]
    assert {refusal(sources, url) for url in urls} == {FILE_REFUSAL}


def test_a_file_over_max_bytes_is_refused(tmp_path):
    (tmp_path / "picture.png").write_bytes(png_bytes(IMAGE))
    message = refusal(ImageSources(files=tmp_path, max_bytes=100), (tmp_path / "picture.png").as_uri())
    assert "more than 100 bytes" in message


# ``ImageSources`` alone: images per request and their pixels


def test_too_many_images_are_refused_before_any_is_read():
    """Nine URLs whose reading would fail: the count is what is refused."""
    with pytest.raises(ApiError, match="9 images in one request; at most 8"):
        ImageSources().read_all(["data:image/png;base64,@@@"] * 9, "messages")
    with pytest.raises(ApiError, match="3 images in one request; at most 2"):
        ImageSources(max_images=2).read_all([data_url(png_bytes(IMAGE))] * 3, "messages")


def test_pixels_over_the_cap_are_refused_from_the_headers(monkeypatch):
    """Headers that claim 3000 x 3000 over a few bytes of body: the sum is
    refused at the third image, the fourth never read, nothing decoded."""
    from PIL import ImageFile

    decoded, read = [], []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: decoded.append(image))
    sources = ImageSources(max_pixels=20_000_000)
    monkeypatch.setattr(ImageSources, "read", lambda self, url, param, deadline=None: read.append(url) or png(3000, 3000))
    with pytest.raises(ApiError, match=r"first 3 image\(s\) would decode into 27,000,000 pixels; at most 20,000,000"):
        sources.read_all(["one", "two", "three", "four"], "messages")
    assert read == ["one", "two", "three"] and not decoded


def test_images_within_the_caps_are_read_whole():
    picture = png_bytes(IMAGE)
    assert ImageSources(max_images=2, max_pixels=2 * 24 * 40).read_all([data_url(picture)] * 2, "m") == [picture] * 2


def test_a_format_outside_the_webs_own_is_refused():
    """PIL reads TIFF (and EPS, through Ghostscript); a client's bytes reach only the web's formats."""
    buffer = io.BytesIO()
    IMAGE.save(buffer, "TIFF")
    with pytest.raises(ApiError, match=r"image 1 is not an image this reader knows \(PNG, JPEG, GIF, WEBP, BMP\)"):
        ImageSources().read_all([data_url(buffer.getvalue())], "messages")


def test_a_payload_that_is_no_image_is_named_by_its_index():
    urls = [data_url(png_bytes(IMAGE)), data_url(b"plain text, no image")]
    with pytest.raises(ApiError, match="image 2 is not an image"):
        ImageSources().read_all(urls, "messages")


# ``ImageSources`` alone: fetches


@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:2800:220:1:248:1893:25c8:1946", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("240.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("::", False), ("fe80::1", False),
    ("fc00::1", False), ("ff02::1", False), ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False),
    ("::ffff:93.184.216.34", True), ("2002:7f00:1::", False), ("2002:a9fe:a9fe::1", False),
    ("2002:5db8:d822::1", True),
])
def test_is_public_address(address, public):
    assert is_public_address(address) is public


def test_ports_other_than_the_schemes_own_are_refused_without_connecting():
    sources = ImageSources(urls=True)
    for url, port in (("http://93.184.216.34:6379/x.png", 6379), ("https://93.184.216.34:80/x.png", 80)):
        assert f"its port {port}" in refusal(sources, url)


def test_private_addresses_are_refused_without_connecting(web):
    sources = ImageSources(urls=True)
    for url in (web + "/picture.png", "http://169.254.169.254/latest/meta-data/", "http://[::1]/x.png",
                "http://[::ffff:127.0.0.1]/x.png", "https://10.0.0.1/x.png", "http://0.0.0.0/x.png"):
        assert "not at a public address" in refusal(sources, url)


def test_a_host_with_one_private_address_among_public_ones_is_refused(monkeypatch):
    """A connection may go to any address of the host, so all are vetted."""
    monkeypatch.setattr(images, "host_addresses", lambda host, port: [
        (socket.AF_INET, ("93.184.216.34", port)), (socket.AF_INET, ("10.0.0.5", port))])
    assert "not at a public address" in refusal(ImageSources(urls=True), "http://images.example.com/a.png")


@pytest.fixture
def loopback_public(monkeypatch, web):
    """127.0.0.1 counted public and the web server's port counted http's own:
    the tests' web server stands for a public one, while every other
    private address stays refused."""
    vetted = images.is_public_address
    monkeypatch.setattr(images, "is_public_address", lambda address: address == "127.0.0.1" or vetted(address))
    monkeypatch.setitem(images.DEFAULT_PORTS, "http", int(web.rsplit(":", 1)[1]))


def test_a_fetch_from_a_public_address_reads_the_image(web, loopback_public):
    assert ImageSources(urls=True).read(web + "/picture.png", "messages") == png_bytes(IMAGE)


def test_a_redirect_is_vetted_as_the_first_url(web, loopback_public):
    sources = ImageSources(urls=True, timeout=2)
    assert sources.read(web + "/redirect?to=/picture.png", "messages") == png_bytes(IMAGE)
    for target in ("http://169.254.169.254/latest/meta-data/", "http://[::1]/x.png", "http://10.0.0.1/x.png"):
        assert "not at a public address" in refusal(sources, f"{web}/redirect?to={target}")
    assert "only http(s)://" in refusal(sources, f"{web}/redirect?to=file:///etc/passwd")


def test_at_most_three_redirects_are_followed(web, loopback_public):
    assert "more than 3 redirects" in refusal(ImageSources(urls=True), web + "/loop")


def test_fetch_failures_are_named(web):
    sources = ImageSources(urls=True, allow_private_hosts=True, max_bytes=100)
    assert refusal(sources, web + "/missing.png").endswith("failed: HTTP 404 Not Found")
    assert "more than 100 bytes" in refusal(sources, web + "/picture.png")
    assert "printable ASCII" in refusal(sources, web + "/a b\r\nX-Injected: 1")
    port = free_local_port()
    assert "the connection failed" in refusal(sources, f"http://127.0.0.1:{port}/x.png")


def free_local_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


@contextmanager
def dribbling(answer: bytes, pause: float):
    """A local server that answers each connection with ``answer``, one byte
    every ``pause`` seconds: every read is quick, the whole answer slow."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.recv(65536)
                for byte in answer:
                    if done.wait(pause):
                        break
                    try:
                        connection.sendall(bytes([byte]))
                    except OSError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/slow.png"
    finally:
        done.set()
        thread.join(5)
        listener.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 80\r\n\r\n" + b"x" * 80,  # the body dribbles
    b"HTTP/1.1 200 OK\r\nX-Padding: " + b"x" * 80 + b"\r\nContent-Length: 1\r\n\r\nx",  # the headers do
], ids=["body", "headers"])
def test_a_dribbling_server_is_cut_at_the_deadline(answer):
    """80 bytes 50 ms apart take 4 s, each read a 20th of the 1 s timeout:
    the fetch ends at its one deadline, not per read."""
    with dribbling(answer, pause=0.05) as url:
        started = time.monotonic()
        message = refusal(ImageSources(urls=True, timeout=1.0, allow_private_hosts=True), url, seconds=3.0)
        assert time.monotonic() - started < 1.5
    assert message.endswith("failed: the request's fetches took longer than 1 s")


def test_a_requests_fetches_share_one_deadline():
    """Three slow URLs in one request end at the one deadline of the
    request, not at three: the second and third fetch get what the first left."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 80\r\n\r\n" + b"x" * 80
    sources = ImageSources(urls=True, timeout=1.0, allow_private_hosts=True, max_images=8)
    with dribbling(answer, pause=0.05) as url:
        started = time.monotonic()
        with pytest.raises(ApiError, match="the request's fetches took longer than 1 s"):
            sources.read_all([url, url, url], "messages")
        assert time.monotonic() - started < 1.5


# ``dspark serve``'s image flags


def test_the_serve_flags_make_the_image_sources(tmp_path):
    def sources(*flags):
        return image_sources(build_parser().parse_args(["serve", *flags]))

    assert sources() == ImageSources()
    assert sources("--allow-image-files", str(tmp_path), "--allow-image-urls", "--max-images", "3",
                   "--max-image-pixels", "1000") == ImageSources(files=tmp_path, urls=True, max_images=3,
                                                                 max_pixels=1000)
    (tmp_path / "picture.png").write_bytes(b"x")
    for path in (tmp_path / "picture.png", tmp_path / "missing"):
        with pytest.raises(SystemExit, match="^dspark: --allow-image-files .* is not a directory$"):
            sources("--allow-image-files", str(path))
    with pytest.raises(SystemExit, match="positive"):
        sources("--max-images", "0")
