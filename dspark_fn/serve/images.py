"""Images in requests: where the bytes of an image part come from.

A chat message's ``image_url`` part (or a Responses ``input_image``) names
its image by URL: a ``data:`` URL carries the bytes (base64) and is always
read; a ``file://`` URL reads a file of the server's machine, only when the
server was started with ``--allow-image-files``; an ``http(s)://`` URL is
fetched only with ``--allow-image-urls``, within a time and size bound. Every
refusal or failure is a 400 naming the image and the fix, before the request
is queued. Decoding and its bounds are ``vision.read_image``'s.
"""

import base64
import binascii
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from .errors import ApiError


@dataclass(frozen=True)
class ImageSources:
    """Which image URLs a server reads besides ``data:`` URLs."""

    files: bool = False  # file:// URLs: files of the server's machine
    urls: bool = False  # http(s):// URLs: fetched by the server
    timeout: float = 10.0  # seconds a fetch may take
    max_bytes: int = 32 << 20  # bytes an image file or fetch may have

    def read(self, url, param: str) -> bytes:
        """The bytes of the image at ``url``, or an ``ApiError`` (400) saying why not."""
        if not isinstance(url, str) or not url:
            raise ApiError("an image part needs a URL ('image_url': {'url': 'data:image/png;base64,...'})", param)
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return data_url_bytes(url, param)
        if scheme == "file":
            if not self.files:
                raise ApiError("file:// image URLs are not read by this server: send the image as a data: URL, or "
                               "start the server with --allow-image-files", param)
            return self.file_bytes(Path(unquote(urlparse(url).path)), param)
        if scheme in ("http", "https"):
            if not self.urls:
                raise ApiError(f"{scheme}:// image URLs are not fetched by this server: send the image as a data: "
                               f"URL, or start the server with --allow-image-urls", param)
            return self.fetched(url, param)
        raise ApiError(f"image URLs of scheme {scheme!r} are not read: use data:, file:// (with "
                       f"--allow-image-files) or http(s):// (with --allow-image-urls)", param)

    def file_bytes(self, path: Path, param: str) -> bytes:
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                raise ApiError(f"image file {path} has {size:,} bytes; at most {self.max_bytes:,} are read", param)
            return path.read_bytes()
        except OSError as error:
            raise ApiError(f"image file {path} cannot be read: {error.strerror or error}", param) from None

    def fetched(self, url: str, param: str) -> bytes:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                data = response.read(self.max_bytes + 1)
        except urllib.error.HTTPError as error:
            raise ApiError(f"fetching image {url} failed: HTTP {error.code} {error.reason}", param) from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise ApiError(f"fetching image {url} failed: {reason}", param) from None
        if len(data) > self.max_bytes:
            raise ApiError(f"image {url} has more than {self.max_bytes:,} bytes", param)
        return data


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL."""
    header, comma, data = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ApiError("an image data URL must be base64: data:image/png;base64,<bytes>", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError("an image data URL's base64 does not decode", param) from None
