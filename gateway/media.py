"""Images from a chat's `image_url` parts: `data:` URLs, local files under an allowed folder, and
http(s) URLs fetched with a size limit, a timeout and no private addresses (vLLM's flags:
--allowed-local-media-path, and --allow-private-media-urls to reach private hosts). Anything else
is a MediaError, which the API answers with 400 (docs/vision.md)."""
from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
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
    max_image_pixels: int = 1 << 26
    fetch_timeout_s: float = 10.0


def load_image(url: str, policy: MediaPolicy):
    """The image at `url` as a PIL image, decoded whole (RGB conversion is the processor's)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, policy)
    elif scheme == "file":
        data = _local_file(url, policy)
    elif scheme in ("http", "https"):
        data = _download(url, policy)
    else:
        raise MediaError("an image_url must be a data:, http(s): or file: URL")
    return decode_image(data, policy)


def decode_image(data: bytes, policy: MediaPolicy):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise MediaError(f"images must be PNG, JPEG, WebP or GIF, not {image.format}")
            if image.width * image.height > policy.max_image_pixels:
                raise MediaError(f"the image has {image.width}x{image.height} pixels, more than "
                                 f"{policy.max_image_pixels}")
            image.load()
            return image.copy()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # each hop is checked by `_download` itself


_opener = urllib.request.build_opener(_NoRedirects)


def _download(url: str, policy: MediaPolicy) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        _check_host(url, policy)
        try:
            with _opener.open(urllib.request.Request(url, headers={"User-Agent": "pagoda"}),
                              timeout=policy.fetch_timeout_s) as response:
                data = response.read(policy.max_image_bytes + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in (301, 302, 303, 307, 308) and exc.headers.get("Location"):
                url = urllib.parse.urljoin(url, exc.headers["Location"])
                continue
            raise MediaError(f"fetching the image failed: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise MediaError(f"fetching the image failed: {getattr(exc, 'reason', exc)}") from None
        if len(data) > policy.max_image_bytes:
            raise MediaError(f"the image is larger than {policy.max_image_bytes} bytes")
        return data
    raise MediaError(f"fetching the image took more than {MAX_REDIRECTS} redirects")


def _check_host(url: str, policy: MediaPolicy) -> None:
    """Refuse a URL whose host resolves to a private, loopback, link-local or reserved address
    (unless --allow-private-media-urls): a client must not reach the server's own network."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError("an image redirect must go to an http(s) URL")
    if policy.allow_private_media_urls:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port or 443)}
    except (socket.gaierror, UnicodeError):
        raise MediaError(f"the image's host {parts.hostname!r} does not resolve") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if not ip.is_global:
            raise MediaError(f"the image's host {parts.hostname!r} is a private address "
                             "(the server allows it with --allow-private-media-urls)")
