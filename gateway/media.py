"""Images from a chat's `image_url` parts: `data:` URLs, local files under an allowed folder, and
http(s) URLs fetched with a size limit, a timeout and no private addresses (vLLM's flags:
--allowed-local-media-path, and --allow-private-media-urls to reach private hosts). Anything else
is a MediaError, which the API answers with 400 (docs/vision.md)."""
from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_REDIRECTS = 3


class MediaError(ValueError):
    """An image the request names cannot be used: the message says why, for a 400."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    allowed_local_media_path: str | None = None  # file:// URLs under this folder; none without it
    allow_private_media_urls: bool = False
    max_image_bytes: int = 20 << 20  # an encoded image (a data: URL's, a file's, a download's)
    max_image_pixels: int = 1 << 26  # the images of one prompt, together
    fetch_timeout_s: float = 10.0


def load_images(urls: list[str], policy: MediaPolicy) -> list:
    """Each URL's image; together at most `policy.max_image_pixels` (checked before each decodes)."""
    images, pixels = [], 0
    for url in urls:
        images.append(load_image(url, policy, policy.max_image_pixels - pixels))
        pixels += images[-1].width * images[-1].height
    return images


def load_image(url: str, policy: MediaPolicy, max_pixels: int | None = None):
    """The image at `url` as a PIL image, decoded whole (RGB conversion is the processor's), of at
    most `max_pixels` (default: the policy's)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, policy)
    elif scheme == "file":
        data = _local_file(url, policy)
    elif scheme in ("http", "https"):
        data = _download(url, policy)
    else:
        raise MediaError("an image_url must be a data:, http(s): or file: URL")
    return decode_image(data, policy.max_image_pixels if max_pixels is None else max_pixels)


def decode_image(data: bytes, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            if image.width * image.height > max_pixels:
                raise MediaError(f"the image has {image.width}x{image.height} pixels, more than the "
                                 f"{max(max_pixels, 0)} left for this prompt's images")
            image.load()
            return image.copy()
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError("the image could not be decoded as PNG, JPEG, WebP or GIF") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"the image could not be decoded: {exc}") from None


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise MediaError("a data: URL image must be base64: data:image/png;base64,...")
    if len(payload) > policy.max_image_bytes * 4 // 3 + 4:
        raise MediaError(f"the image is larger than {policy.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL's base64 is malformed") from None


def _local_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise MediaError("file: URLs need the server to name a folder with --allowed-local-media-path")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("a file: URL must name a local path")
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    root = Path(policy.allowed_local_media_path).resolve()
    if not path.is_relative_to(root):
        raise MediaError("the file is outside --allowed-local-media-path")
    if not path.is_file():
        raise MediaError("no such image file")
    if path.stat().st_size > policy.max_image_bytes:
        raise MediaError(f"the image is larger than {policy.max_image_bytes} bytes")
    return path.read_bytes()


def _download(url: str, policy: MediaPolicy) -> bytes:
    """GET `url` from the address its host was checked at (no second lookup for DNS to answer
    otherwise; no proxy), following redirects by the same rule, within the size and a total deadline."""
    deadline = time.monotonic() + policy.fetch_timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = _checked_address(parts, port, policy)
            host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
            connection = (_PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP)(
                parts.hostname, port, timeout=_left(deadline, policy), address=address)
            try:
                connection.request("GET", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                                   headers={"User-Agent": "pagoda",
                                            "Host": host if parts.port is None else f"{host}:{parts.port}"})
                sock = connection.sock  # (the connection lets go of it once a response will close)
                sock.settimeout(_left(deadline, policy))
                response = connection.getresponse()
                if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                    url = urllib.parse.urljoin(url, response.getheader("Location"))
                    continue
                if response.status != 200:
                    raise MediaError(f"fetching the image failed: HTTP {response.status}")
                return _read(sock, response, policy, deadline)
            finally:
                connection.close()
        except MediaError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise MediaError(f"fetching the image failed: {exc}") from None
    raise MediaError(f"fetching the image took more than {MAX_REDIRECTS} redirects")


def _left(deadline: float, policy: MediaPolicy) -> float:
    """Seconds left of the download's one deadline (every connect and read waits at most this)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaError(f"fetching the image took more than {policy.fetch_timeout_s} s (--media-fetch-timeout)")
    return left


def _read(sock: socket.socket, response, policy: MediaPolicy, deadline: float) -> bytes:
    chunks, size = [], 0
    while True:
        sock.settimeout(_left(deadline, policy))
        chunk = response.read1(1 << 16)  # what one receive brings: the deadline is checked between
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > policy.max_image_bytes:
            raise MediaError(f"the image is larger than {policy.max_image_bytes} bytes")
        chunks.append(chunk)


class _PinnedHTTP(http.client.HTTPConnection):
    """A connection to `address`, the host's checked address, whatever its name resolves to now."""

    def __init__(self, host: str, port: int | None, *, address: str, **kwargs) -> None:
        super().__init__(host, port, **kwargs)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int | None, *, address: str, **kwargs) -> None:
        super().__init__(host, port, context=ssl.create_default_context(), **kwargs)
        self.address = address

    def connect(self) -> None:  # the certificate is checked against the host's name
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _checked_address(parts: urllib.parse.SplitResult, port: int, policy: MediaPolicy) -> str:
    """The address to fetch from: the host's, refused when any address it resolves to is private,
    loopback, link-local or reserved (unless --allow-private-media-urls): a client must not reach
    the server's own network."""
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError("an image redirect must go to an http(s) URL")
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise MediaError(f"the image's host {parts.hostname!r} does not resolve") from None
    addresses = [info[4][0] for info in infos]
    if not policy.allow_private_media_urls:
        for address in addresses:
            ip = ipaddress.ip_address(address.split("%")[0])
            if not ip.is_global or any(ip in network for network in _EMBEDS_IPV4):
                raise MediaError(f"the image's host {parts.hostname!r} is a private address "
                                 "(the server allows it with --allow-private-media-urls)")
    return addresses[0]


# IPv6 prefixes that carry an IPv4 address (NAT64, 6to4): counted global, they may reach a private one
_EMBEDS_IPV4 = ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("2002::/16")
