"""The media a chat message names (``url``, ``image_url``, ``path``, data URLs), loaded only where the caller allows.

A server hands user messages to the processor, so a URL or a path in a message is a request made on the user's
behalf. `MediaPolicy` says what may be loaded; its default is what a server can expose:

* data URLs (``data:image/png;base64,...``) and base64 strings: always, within ``max_media_bytes``;
* local files: only under the directories of ``allowed_local_media_path`` (none by default), after resolving ``..``
  and symbolic links;
* ``http(s)`` URLs: only with ``allow_remote_media=True``; even then a host whose addresses include a loopback,
  link-local, private, shared, multicast or reserved one is refused unless ``allow_private_network_media`` is True
  or a list of networks that holds every one of them. The connection goes to the address that was checked (no second
  lookup), redirects are followed by hand and each one is checked the same way, proxies from the environment are not
  used, the body stops at ``max_media_bytes`` and the whole download at ``media_timeout`` seconds.

Images are opened lazily by PIL, so the pixel budget (the image processor's ``max_image_pixels``) is checked on the
size the file's header states, before its pixels are decoded.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import os
import re
import socket
import ssl
import stat
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

DEFAULT_MAX_MEDIA_BYTES = 64 * 2**20
DEFAULT_MEDIA_TIMEOUT = 10.0
MAX_REDIRECTS = 5
MEDIA_OPTIONS = ("allowed_local_media_path", "allow_remote_media", "allow_private_network_media", "max_media_bytes",
                 "media_timeout")

_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class KimiK3MediaError(ValueError):
    """A media reference in a message was refused by the media policy, or its bytes are not a readable image."""


def _networks(value: Any) -> tuple | bool:
    if value is True or value is False or value is None:
        return bool(value)
    items = [value] if isinstance(value, str) else list(value)
    try:
        return tuple(ipaddress.ip_network(item, strict=False) for item in items)
    except ValueError as error:
        raise KimiK3MediaError(f"allow_private_network_media: {error}; give True, False or networks such as "
                               "['10.1.2.0/24', '127.0.0.1/32']") from None


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped or address.sixtofour
        if mapped is not None and not _is_public(mapped):
            return False
    return address.is_global and not (address.is_multicast or address.is_reserved or address.is_unspecified)


@dataclass(frozen=True)
class MediaPolicy:
    """What a message's media references may load (see the module docstring). ``allowed_local_media_path``: a
    directory or a list of them; ``allow_private_network_media``: True, False, or networks (``"10.1.2.0/24"``)."""

    allowed_local_media_path: tuple[str, ...] = ()
    allow_remote_media: bool = False
    allow_private_network_media: Any = False
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    media_timeout: float = DEFAULT_MEDIA_TIMEOUT

    @classmethod
    def create(cls, allowed_local_media_path: Any = None, allow_remote_media: bool = False,
               allow_private_network_media: Any = False, max_media_bytes: int | None = None,
               media_timeout: float | None = None) -> MediaPolicy:
        paths = () if not allowed_local_media_path else (
            [allowed_local_media_path] if isinstance(allowed_local_media_path, (str, os.PathLike))
            else list(allowed_local_media_path))
        roots = []
        for path in paths:
            root = os.path.realpath(os.fspath(path))
            if not os.path.isdir(root):
                raise KimiK3MediaError(f"allowed_local_media_path: {os.fspath(path)!r} is not a directory")
            roots.append(root)
        max_bytes = DEFAULT_MAX_MEDIA_BYTES if max_media_bytes is None else max_media_bytes
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise KimiK3MediaError(f"max_media_bytes must be a positive int, got {max_bytes!r}")
        timeout = DEFAULT_MEDIA_TIMEOUT if media_timeout is None else float(media_timeout)
        if not timeout > 0:
            raise KimiK3MediaError(f"media_timeout must be positive seconds, got {media_timeout!r}")
        return cls(tuple(roots), bool(allow_remote_media), _networks(allow_private_network_media), max_bytes, timeout)

    def options(self) -> dict[str, Any]:
        private = self.allow_private_network_media
        return {"allowed_local_media_path": list(self.allowed_local_media_path),
                "allow_remote_media": self.allow_remote_media,
                "allow_private_network_media": private if isinstance(private, bool) else [str(n) for n in private],
                "max_media_bytes": self.max_media_bytes, "media_timeout": self.media_timeout}

    # ------------------------------------------------------------------------------------------ bytes
    def read(self, source: str, *, base64_only: bool = False) -> bytes:
        """The bytes ``source`` names (data URL, base64, http(s) URL or local path), as the policy allows."""
        if not isinstance(source, str):
            raise KimiK3MediaError(f"a media reference must be a string, got {type(source).__name__}")
        if source.startswith("data:"):
            header, _, payload = source.partition(",")
            if ";base64" not in header:
                raise KimiK3MediaError(f"the data URL {source[:40]!r}... is not base64: use data:<type>;base64,...")
            return self._decode_base64(payload)
        if base64_only:
            return self._decode_base64(source)
        if source.startswith(("http://", "https://")):
            return self._fetch(source)
        if _SCHEME.match(source):
            raise KimiK3MediaError(f"the media URL {source[:80]!r} has a scheme K3's processor does not load; give an "
                                   "http(s) URL, a data URL or a local path")
        if len(source) >= 64 and _BASE64.fullmatch(source) and not (self.allowed_local_media_path
                                                                     and os.path.exists(source)):
            return self._decode_base64(source)
        return self._read_local(source)

    def _decode_base64(self, payload: str) -> bytes:
        if len(payload) * 3 // 4 > self.max_media_bytes:
            raise KimiK3MediaError(f"base64 media of about {len(payload) * 3 // 4} bytes is above max_media_bytes="
                                   f"{self.max_media_bytes}; raise max_media_bytes to accept it")
        try:
            return base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError) as error:
            raise KimiK3MediaError(f"the base64 media could not be decoded ({error})") from None

    def _local_path(self, path: str) -> str:
        """The resolved path of a local medium the allow-list holds, a regular file within the byte budget."""
        if not self.allowed_local_media_path:
            raise KimiK3MediaError(
                f"the local file {path[:120]!r} was not loaded: reading local files is off by default (a message "
                "could name any file). Pass allowed_local_media_path=[directory, ...] to the processor (or "
                "from_pretrained), or pass the image itself (PIL image, array, data URL)")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.allowed_local_media_path):
            raise KimiK3MediaError(
                f"the local file {path[:120]!r} is outside allowed_local_media_path "
                f"{list(self.allowed_local_media_path)} (after resolving '..' and symbolic links); move it there or "
                "add its directory")
        try:
            info = os.stat(real)
        except OSError as error:
            raise KimiK3MediaError(f"could not read the local media {path[:120]!r} ({error.strerror or error})") \
                from None
        if not stat.S_ISREG(info.st_mode):
            raise KimiK3MediaError(f"the local media {path[:120]!r} is not a regular file")
        if info.st_size > self.max_media_bytes:
            raise KimiK3MediaError(f"the local media {path[:120]!r} is {info.st_size} bytes, above max_media_bytes="
                                   f"{self.max_media_bytes}; raise max_media_bytes to accept it")
        return real

    def _read_local(self, path: str) -> bytes:
        real = self._local_path(path)
        try:  # O_NOFOLLOW: a link put in place of the checked file after the check is not followed
            descriptor = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(descriptor, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise KimiK3MediaError(f"the local media {path[:120]!r} is not a regular file")
                data = handle.read(self.max_media_bytes + 1)
        except OSError as error:
            raise KimiK3MediaError(f"could not read the local media {path[:120]!r} ({error.strerror or error})") \
                from None
        if len(data) > self.max_media_bytes:
            raise KimiK3MediaError(f"the local media {path[:120]!r} is above max_media_bytes={self.max_media_bytes}")
        return data

    # ------------------------------------------------------------------------------------------ network
    def check_host(self, host: str, port: int) -> list[str]:
        """The addresses ``host`` resolves to, all allowed by the policy (else `KimiK3MediaError`)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as error:
            raise KimiK3MediaError(f"could not resolve the media host {host!r} ({error})") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        for text in addresses:
            address = ipaddress.ip_address(text.split("%")[0])
            if _is_public(address):
                continue
            allowed = self.allow_private_network_media
            if allowed is True or (isinstance(allowed, tuple) and any(address in net for net in allowed)):
                continue
            raise KimiK3MediaError(
                f"the media host {host!r} resolves to {address}, a loopback / link-local / private / reserved "
                "address, which is refused (a message must not reach the server's own network). An operator who "
                "means to allow it passes allow_private_network_media=True or a list of networks holding it")
        if not addresses:
            raise KimiK3MediaError(f"the media host {host!r} has no address")
        return addresses

    def _fetch(self, url: str) -> bytes:
        if not self.allow_remote_media:
            raise KimiK3MediaError(
                f"the media URL {url[:120]!r} was not fetched: remote media is off by default (a message could make "
                "the server request any address). Pass allow_remote_media=True to the processor (or from_pretrained) "
                "to allow public http(s) URLs, or pass the image itself (PIL image, array, data URL)")
        deadline = time.monotonic() + self.media_timeout
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise KimiK3MediaError(f"the media URL {url[:120]!r} is not an http(s) URL with a host")
            if parts.username or parts.password:
                raise KimiK3MediaError(f"the media URL {url[:120]!r} carries credentials; they are not sent")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise KimiK3MediaError(f"the media URL {url[:120]!r} has an invalid port") from None
            address = self.check_host(parts.hostname, port)[0]
            try:
                connection = _PinnedConnection(parts.scheme, parts.hostname, port, address, _left(deadline, url))
            except (OSError, ssl.SSLError) as error:
                raise KimiK3MediaError(f"could not connect to the media URL {url[:120]!r} ({type(error).__name__}: "
                                       f"{str(error)[:200]})") from None
            try:
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                connection.request("GET", path, headers={"User-Agent": "transformers-k3", "Accept": "*/*",
                                                         "Accept-Encoding": "identity"})
                response = connection.getresponse()
                if response.status in (301, 302, 303, 307, 308):
                    location = response.getheader("Location")
                    if not location:
                        raise KimiK3MediaError(f"the media URL {url[:120]!r} redirects without a Location")
                    url = urljoin(url, location)
                    continue
                if response.status != 200:
                    raise KimiK3MediaError(f"the media URL {url[:120]!r} answered HTTP {response.status}")
                length = response.getheader("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_media_bytes:
                    raise KimiK3MediaError(f"the media at {url[:120]!r} is {int(length)} bytes, above "
                                           f"max_media_bytes={self.max_media_bytes}; raise max_media_bytes to accept "
                                           "it")
                chunks, size = [], 0
                while size <= self.max_media_bytes:
                    _left(deadline, url)  # each read also times out on its own (the socket's timeout)
                    chunk = response.read(min(1 << 16, self.max_media_bytes + 1 - size))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                body = b"".join(chunks)
                if len(body) > self.max_media_bytes:
                    raise KimiK3MediaError(f"the media at {url[:120]!r} is larger than max_media_bytes="
                                           f"{self.max_media_bytes}; raise max_media_bytes to accept it")
                return body
            except (OSError, http.client.HTTPException) as error:
                raise KimiK3MediaError(f"could not fetch the media URL {url[:120]!r} ({type(error).__name__}: "
                                       f"{str(error)[:200]})") from None
            finally:
                connection.close()
        raise KimiK3MediaError(f"the media URL redirected more than {MAX_REDIRECTS} times")

    # ------------------------------------------------------------------------------------------ images
    def open_image(self, source: str, max_pixels: int | None, *, base64_only: bool = False):
        """A decoded PIL image from ``source``; its header's size is checked against ``max_pixels`` first."""
        return open_image_bytes(self.read(source, base64_only=base64_only), max_pixels, f"{source[:80]!r}")

    def load_video(self, source: str):
        """Decoded frames ``[T, H, W, C]`` of the video ``source`` names, read as the policy allows (transformers'
        ``load_video`` decodes a local copy; it never fetches anything itself here)."""
        import tempfile

        from transformers.video_utils import load_video

        is_local = not source.startswith(("data:", "http://", "https://")) and not _SCHEME.match(source)
        if is_local and not (len(source) >= 64 and _BASE64.fullmatch(source)):
            return _decode_video(load_video, self._local_path(source), source)
        data = self.read(source)
        with tempfile.TemporaryDirectory(prefix="k3-media-") as folder:
            path = os.path.join(folder, "video")
            with open(path, "wb") as handle:
                handle.write(data)
            return _decode_video(load_video, path, source)


def _decode_video(load_video, path: str, name: str):
    try:
        frames, _ = load_video(path)
    except Exception as error:  # the decoder backends are optional and raise their own errors
        raise KimiK3MediaError(f"could not decode the video {name[:80]!r} ({type(error).__name__}: "
                               f"{str(error)[:160]}); install a video backend (av, decord, opencv) or pass frames")\
            from None
    return frames


def _left(deadline: float, url: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KimiK3MediaError(f"the media URL {url[:120]!r} took longer than media_timeout; raise media_timeout to "
                               "wait longer")
    return left


class _PinnedConnection:
    """An HTTP(S) connection to the address that was checked, with the URL's host name for TLS and Host."""

    def __init__(self, scheme: str, host: str, port: int, address: str, timeout: float):
        context = ssl.create_default_context() if scheme == "https" else None
        if context is not None:
            self._connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
        else:
            self._connection = http.client.HTTPConnection(host, port, timeout=timeout)
        sock = socket.create_connection((address, port), timeout=timeout)
        if context is not None:
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except Exception:
                sock.close()
                raise
        self._connection.sock = sock

    def request(self, *args, **kwargs):
        return self._connection.request(*args, **kwargs)

    def getresponse(self):
        return self._connection.getresponse()

    def close(self):
        self._connection.close()


def require_pillow():
    """Pillow's ``Image`` module; images need it (the ``[vision]`` extra), text-only use does not."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("processing images needs Pillow, which the base install leaves out: "
                          "pip install 'transformers-k3[vision]' (or pip install Pillow)") from None
    return Image


def open_image_bytes(data: bytes, max_pixels: int | None, name: str = "the image"):
    """Open ``data`` with PIL, refuse it above ``max_pixels`` on the header's size, then decode it (EXIF
    orientation applied)."""
    Image = require_pillow()
    from PIL import ImageOps

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:  # PIL's own limit, checked on the header too
        count = re.search(r"\((\d+) pixels\)", str(error))
        raise KimiK3MediaError(
            f"{name} is {count.group(1) if count else 'too many'} pixels, above the budget max_image_pixels="
            f"{max_pixels} and Pillow's decompression-bomb limit (checked before decoding); downscale it first")\
            from None
    except Exception as error:  # PIL raises UnidentifiedImageError, SyntaxError, ValueError... per format
        raise KimiK3MediaError(f"{name} is not an image PIL can read ({type(error).__name__}: {str(error)[:160]}); "
                               "give a PNG, JPEG, WebP, GIF or another format Pillow opens") from None
    check_pixels(image.size, max_pixels, name)
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except Exception as error:  # a truncated or corrupt body fails only when the pixels are decoded
        raise KimiK3MediaError(f"{name} could not be decoded ({type(error).__name__}: {str(error)[:160]}); the "
                               "file is truncated or corrupt") from None


def check_pixels(size: tuple[int, int], max_pixels: int | None, name: str = "the image") -> None:
    width, height = size
    if max_pixels is not None and width * height > max_pixels:
        raise KimiK3MediaError(
            f"{name} is {width}x{height} = {width * height} pixels, above the budget max_image_pixels={max_pixels} "
            "(checked before decoding); downscale it first, or raise the image processor's max_image_pixels")


__all__ = ["KimiK3MediaError", "MediaPolicy", "MEDIA_OPTIONS", "open_image_bytes", "check_pixels"]
