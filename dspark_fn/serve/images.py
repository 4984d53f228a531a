"""Images in requests: where the bytes of an image part come from, and how
much a request may bring.

A chat message's ``image_url`` part (or a Responses ``input_image``) names
its image by URL:

- a ``data:`` URL carries the bytes (base64) and is always read;
- a ``file://`` URL is read only when the server was started with
  ``--allow-image-files DIR``, and only if its real path (symlinks followed)
  is a regular file under DIR's real path: it is opened without blocking
  (a FIFO cannot hang a worker), checked on the open descriptor (no device,
  FIFO or socket; ``/dev/zero`` and ``/proc`` files report no size to trust),
  and read up to the byte bound. Every refusal of a file reads the same, so
  a client learns nothing about which paths exist;
- an ``http(s)://`` URL is fetched only with ``--allow-image-urls``, with the
  standard library: every address its host resolves to must be public (no
  private, loopback, link-local, multicast, reserved or unspecified address,
  IPv4-mapped and 6to4 ones included), only on the scheme's own port (80,
  443: a public host's other ports are its own services), the connection goes to an address that was
  checked (no second lookup for DNS rebinding to answer), at most
  ``MAX_REDIRECTS`` redirects are followed, each checked the same way, and
  one deadline bounds all of a request's fetches together (lookups,
  connections, redirects and every read of the bodies) as one byte bound
  bounds each body.

A request brings at most ``max_images`` images (``--max-images``), counted
before any is read, and their sizes as their headers state them add up to
at most ``max_pixels`` pixels (``--max-image-pixels``), checked before any
is decoded. Every refusal or failure is a 400 naming the image and the fix,
before the request is queued. Decoding and its per-image bounds are
``vision.read_image``'s.
"""

import base64
import binascii
import http.client
import io
import ipaddress
import os
import socket
import ssl
import stat
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse, urlsplit

from ..vision import MAX_IMAGE_PIXELS, opened_image
from .errors import ApiError

# The same words for a missing file, one outside the directory, a device, a
# FIFO or an unreadable file: any difference would tell a client which paths exist.
FILE_REFUSAL = ("image file URL not readable: only regular files under the server's image directory "
                "(--allow-image-files DIR) are read")
MAX_REDIRECTS = 3
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_PORTS = {"http": 80, "https": 443}
READ_CHUNK = 1 << 16


class FetchRefused(Exception):
    """A fetch stopped, its message fit for the client (nothing of the server's network in it)."""


@dataclass(frozen=True)
class ImageSources:
    """Which image URLs a server reads besides ``data:`` URLs, and how much a request may bring."""

    files: Path | None = None  # file:// URLs: regular files under this directory
    urls: bool = False  # http(s):// URLs: fetched by the server
    timeout: float = 10.0  # seconds all of a request's fetches may take together, redirects included
    max_bytes: int = 32 << 20  # bytes an image file or fetch may have
    max_images: int = 8  # images a request may bring
    # Decoded pixels of a request's images together: as many as one image may
    # have (``vision.MAX_IMAGE_PIXELS``, 32 Mi, about 100 MB as RGB), so a
    # request of small images cannot add up to more than one large image.
    max_pixels: int = MAX_IMAGE_PIXELS
    allow_private_hosts: bool = False  # fetch from any address: for tests' local servers only

    def read_all(self, urls: list, param: str) -> list[bytes]:
        """The bytes of each image, counted before any is read and their
        pixels (from the headers) summed before any is decoded."""
        if len(urls) > self.max_images:
            raise ApiError(f"{len(urls)} images in one request; at most {self.max_images} are taken "
                           f"(the server's --max-images): send fewer images", param)
        pictures, pixels, deadline = [], 0, Deadline(self.timeout)  # one for the request: eight slow URLs wait once
        for index, url in enumerate(urls):
            picture = self.read(url, param, deadline)
            pixels += header_pixels(picture, index, param)
            if pixels > self.max_pixels:
                raise ApiError(f"the request's first {index + 1} image(s) would decode into {pixels:,} pixels; "
                               f"at most {self.max_pixels:,} are taken per request (the server's "
                               f"--max-image-pixels): send fewer or smaller images", param)
            pictures.append(picture)
        return pictures

    def read(self, url, param: str, deadline: "Deadline | None" = None) -> bytes:
        """The bytes of the image at ``url`` (a fetch within ``deadline``, by
        default one of its own), or an ``ApiError`` (400) saying why not."""
        if not isinstance(url, str) or not url:
            raise ApiError("an image part needs a URL ('image_url': {'url': 'data:image/png;base64,...'})", param)
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return data_url_bytes(url, param)
        if scheme == "file":
            if self.files is None:
                raise ApiError("file:// image URLs are not read by this server: send the image as a data: URL, or "
                               "start the server with --allow-image-files DIR", param)
            return self.file_bytes(Path(unquote(urlparse(url).path)), param)
        if scheme in ("http", "https"):
            if not self.urls:
                raise ApiError(f"{scheme}:// image URLs are not fetched by this server: send the image as a data: "
                               f"URL, or start the server with --allow-image-urls", param)
            return self.fetched(url, param, deadline or Deadline(self.timeout))
        raise ApiError(f"image URLs of scheme {scheme!r} are not read: use data:, file:// (with "
                       f"--allow-image-files DIR) or http(s):// (with --allow-image-urls)", param)

    def file_bytes(self, path: Path, param: str) -> bytes:
        """The bytes of a file under ``files``, or the one refusal that names no path."""
        try:
            data = regular_file_bytes(path, self.files, self.max_bytes + 1)
        except (OSError, ValueError):  # ValueError: a NUL in the path
            raise ApiError(FILE_REFUSAL, param) from None
        if len(data) > self.max_bytes:
            raise ApiError(f"an image file has more than {self.max_bytes:,} bytes; at most that many are read", param)
        return data

    def fetched(self, url: str, param: str, deadline: "Deadline") -> bytes:
        """The fetched bytes, or a refusal naming the URL sent and what went wrong, nothing of the network's."""
        try:
            return fetch(url, deadline, self.max_bytes, self.allow_private_hosts)
        except FetchRefused as refusal:
            raise ApiError(f"fetching image {url} failed: {refusal}", param) from None
        except TimeoutError:
            raise ApiError(f"fetching image {url} failed: the request's fetches took longer than {self.timeout:g} s",
                           param) from None
        except ssl.SSLError:
            raise ApiError(f"fetching image {url} failed: the TLS connection failed (is its certificate valid?)",
                           param) from None
        except (OSError, http.client.HTTPException):
            raise ApiError(f"fetching image {url} failed: the connection failed or the answer was not HTTP",
                           param) from None


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL."""
    header, comma, data = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ApiError("an image data URL must be base64: data:image/png;base64,<bytes>", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError("an image data URL's base64 does not decode", param) from None


def header_pixels(data: bytes, index: int, param: str) -> int:
    """The pixels image ``index`` would decode into, from its header alone (``vision.opened_image``)."""
    try:
        width, height = opened_image(data, index).size
    except ValueError as error:
        raise ApiError(str(error), param) from None
    return width * height


def regular_file_bytes(path: Path, directory: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path`` if its real path is a regular file
    under ``directory``'s real path; an ``OSError`` otherwise."""
    # os.path.realpath, not Path.resolve: a symlink loop then fails at open
    # (ELOOP, an OSError) rather than raising RuntimeError here.
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(directory)):
        raise PermissionError(path)
    # O_NONBLOCK: opening a FIFO with no writer would wait for one. O_NOFOLLOW:
    # a symlink put in place of the checked path since is not followed out.
    with open(real, "rb", opener=lambda name, _: os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)) as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):  # the file opened, not what the path names now
            raise PermissionError(path)
        return file.read(limit)


class Deadline:
    """The one time bound of a fetch: every step gets what is left of it."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; ``TimeoutError`` once none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch's deadline passed")
        return left


def fetch(url: str, deadline: Deadline, max_bytes: int, allow_private: bool) -> bytes:
    """The body of a 200 answer to GET ``url``, redirects followed (each new
    location vetted as the first), within ``deadline`` and ``max_bytes``."""
    for _ in range(MAX_REDIRECTS + 1):
        scheme, host, port, target = url_parts(url)
        addresses = vetted_addresses(host, port, deadline, allow_private)
        if not allow_private and port != DEFAULT_PORTS[scheme]:  # a public host's other ports: its own services
            raise FetchRefused(f"its port {port} (or a redirect's) is not {scheme}'s own ({DEFAULT_PORTS[scheme]}): "
                               f"this server fetches {scheme} URLs from port {DEFAULT_PORTS[scheme]} only")
        with connected(addresses, scheme, host, deadline) as sock:
            sock.settimeout(deadline.left())
            sock.sendall(request_bytes(host, port, scheme, target))
            response = http.client.HTTPResponse(DeadlineReader(sock, deadline), method="GET")
            response.begin()
            location = response.getheader("Location")
            if response.status in REDIRECT_STATUSES and location:
                url = urljoin(url, location)
                continue
            if response.status != 200:
                raise FetchRefused(status_text(response.status))
            return bounded_body(response, max_bytes)
    raise FetchRefused(f"more than {MAX_REDIRECTS} redirects")


def status_text(status: int) -> str:
    """``HTTP 404 Not Found``: the standard phrase, not the one the server sent."""
    try:
        return f"HTTP {status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def url_parts(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, request target)`` of an http(s) URL, or ``FetchRefused``."""
    # The target goes into the request line as it is: spaces, controls or
    # non-ASCII there could split the request, so they are refused, not sent.
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        raise FetchRefused("a URL (or a redirect's location) must be printable ASCII, percent-encoded")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise FetchRefused("a URL's port is not a port number") from None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        raise FetchRefused("only http(s):// URLs with a host are fetched, a redirect's location included")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port or DEFAULT_PORTS[parts.scheme], target


def is_public_address(address: str) -> bool:
    """Whether the server may connect to ``address`` for a client: not one of
    its own network's (private, loopback, link-local such as the cloud
    metadata service at 169.254.169.254, multicast, reserved, unspecified)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped:  # ::ffff:127.0.0.1 reaches 127.0.0.1
            return is_public_address(str(ip.ipv4_mapped))
        if ip.sixtofour and not is_public_address(str(ip.sixtofour)):  # 2002:7f00:1:: is relayed to 127.0.0.1
            return False
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified)


def host_addresses(host: str, port: int) -> list[tuple]:
    """``(family, socket address)`` of each TCP address ``host`` resolves to."""
    return [(family, address) for family, _, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def vetted_addresses(host: str, port: int, deadline: Deadline, allow_private: bool) -> list[tuple]:
    """The addresses of ``host``, all of them public unless ``allow_private``:
    one private address among public ones is refused too, since a connection
    may go to any of them."""
    addresses = resolved_within(host, port, deadline)
    if not allow_private and not all(is_public_address(address[0]) for _, address in addresses):
        raise FetchRefused("its host (or a redirect's) is not at a public address: this server fetches only "
                           "from the public internet")
    return addresses


def resolved_within(host: str, port: int, deadline: Deadline) -> list[tuple]:
    """``host_addresses`` within the deadline: a lookup takes no timeout, so it
    runs on a thread of its own, left behind (to end with the resolver's own
    timeout) when the deadline passes first."""
    answer = []

    def look_up():
        try:
            answer.append(host_addresses(host, port))
        except Exception as error:  # carried to the waiting thread (a name IDNA cannot encode raises UnicodeError)
            answer.append(error)

    lookup = threading.Thread(target=look_up, daemon=True)
    lookup.start()
    lookup.join(deadline.left())
    if not answer:
        raise TimeoutError("the host name lookup outlasted the deadline")
    if isinstance(answer[0], Exception) or not answer[0]:
        raise FetchRefused("its host name (or a redirect's) did not resolve")
    return answer[0]


def connected(addresses: list[tuple], scheme: str, host: str, deadline: Deadline) -> socket.socket:
    """A socket to the first vetted address that takes the connection, TLS
    (checked against ``host``) for https; the handshake's timeout is a
    total, as is ``sendall``'s."""
    failure = OSError("no address to connect to")
    for family, address in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.left())
            sock.connect(address)
            if scheme == "https":
                sock.settimeout(deadline.left())  # the handshake gets what the connection left
                return tls_context().wrap_socket(sock, server_hostname=host)
            return sock
        except OSError as error:  # TimeoutError and ssl.SSLError are OSErrors
            sock.close()
            if isinstance(error, (TimeoutError, ssl.SSLError)):
                raise
            failure = error
    raise failure


@cache
def tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def request_bytes(host: str, port: int, scheme: str, target: str) -> bytes:
    """A GET of ``target``, its Host header naming the host of the URL (the socket goes to its vetted address)."""
    name = f"[{host}]" if ":" in host else host
    authority = name if port == DEFAULT_PORTS[scheme] else f"{name}:{port}"
    return (f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nAccept: image/*\r\nAccept-Encoding: identity\r\n"
            f"User-Agent: dspark-fn\r\nConnection: close\r\n\r\n").encode("ascii")


class DeadlineReader(io.RawIOBase):
    """A socket's bytes as ``http.client.HTTPResponse`` reads them, each read
    given only what is left of the deadline: a server that dribbles its
    headers or body, each byte in time, still ends at the deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline):
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.sock.settimeout(self.deadline.left())
        return self.sock.recv_into(buffer)

    def makefile(self, mode: str):  # how HTTPResponse takes its stream from a "socket"
        return io.BufferedReader(self)


def bounded_body(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """The body, read a chunk at a time and refused once past ``max_bytes``."""
    body = bytearray()
    while chunk := response.read1(READ_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise FetchRefused(f"the image has more than {max_bytes:,} bytes")
    return bytes(body)
