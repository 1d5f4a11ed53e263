"""Decoding user images safely: data URLs (base64 PNG, JPEG or WebP), http(s) only when the
operator allows it for listed hosts, and limits on bytes, pixels and images per request.

Every refusal is an ImageError (a ValueError) whose message names the limit or the fault; the
server answers it with a 400. Pixels are checked from the header before anything is decoded, so
a decompression bomb (a small file declaring 20000 x 20000 pixels) costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP")
_MIME = {"image/png", "image/jpeg", "image/jpg", "image/webp"}


class ImageError(ValueError):
    """An image was refused; the message says which limit or what is wrong."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20              # encoded size of one image
    max_pixels: int = 40_000_000           # width x height of one image (decoded)
    max_images: int = 8                    # images in one request
    allow_remote: bool = False             # fetch http(s) URLs at all
    allowed_hosts: tuple[str, ...] = field(default=())   # hosts (or ".suffix") that may be fetched
    fetch_timeout_s: float = 10.0
    max_request_pixels: int = 40_000_000   # all images of one request together
    max_aspect_ratio: float = 200.0        # a 1 x 39,999,999 strip costs seconds and GBs


def check_count(n: int, limits: ImageLimits) -> None:
    if n > limits.max_images:
        raise ImageError(f"the request has {n} images; at most {limits.max_images} are allowed "
                         "per request (--max-images-per-request)")


def load_image(url: object, limits: ImageLimits) -> Image.Image:
    """An image_url's `url` (or the {"url": ...} object) -> a decoded RGB-able PIL image."""
    img = open_image(url, limits)
    finish_decode(img)
    return img


def open_image(url: object, limits: ImageLimits) -> Image.Image:
    """The image's header only (its size known, its pixels not decoded): what the checks
    that decide whether decoding is worth it need."""
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ImageError("image_url needs a 'url' string")
    if url.startswith("data:"):
        data = _from_data_url(url, limits)
    elif url.startswith(("http://", "https://")):
        data = _fetch(url, limits)
    else:
        raise ImageError("image_url must be a data URL (data:image/png;base64,...) or, where "
                         "the server allows it, an http(s) URL")
    return open_bytes(data, limits)


def decode(data: bytes, limits: ImageLimits) -> Image.Image:
    img = open_bytes(data, limits)
    finish_decode(img)
    return img


def open_bytes(data: bytes, limits: ImageLimits) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes} "
                         "bytes per image (--max-image-bytes)")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise ImageError(_too_many_pixels(None, limits)) from None
    except Exception:
        raise ImageError("the image is not a readable PNG, JPEG or WebP file") from None
    w, h = img.size
    if w * h > limits.max_pixels:
        raise ImageError(_too_many_pixels((w, h), limits))
    if w < 1 or h < 1:
        raise ImageError("the image is empty")
    if max(w, h) > limits.max_aspect_ratio * min(w, h):
        raise ImageError(f"the image is {w}x{h} pixels; its aspect ratio is over "
                         f"{limits.max_aspect_ratio:g}:1")
    return img


def finish_decode(img: Image.Image) -> None:
    try:
        img.load()
    except Exception as exc:        # truncated or corrupt data
        raise ImageError(f"the image data is corrupt or truncated ({exc})") from None


def decoded_bytes(img: Image.Image) -> int:
    """What decoding the image holds in memory (4 bytes a pixel: RGBA at worst)."""
    w, h = img.size
    return 4 * w * h


def _too_many_pixels(size: tuple[int, int] | None, limits: ImageLimits) -> str:
    what = f"{size[0]}x{size[1]} pixels" if size else "too many pixels"
    return (f"the image has {what}; the limit is {limits.max_pixels} pixels per image "
            "(--max-image-pixels)")


def _from_data_url(url: str, limits: ImageLimits) -> bytes:
    head, sep, payload = url[5:].partition(",")
    parts = head.split(";")
    if not sep or "base64" not in parts[1:]:
        raise ImageError("a data URL image must be base64 (data:image/png;base64,...)")
    if parts[0].lower() not in _MIME:
        raise ImageError(f"data URL type {parts[0]!r} is not supported; use image/png, "
                         "image/jpeg or image/webp")
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise ImageError(f"the image is about {len(payload) * 3 // 4} bytes; the limit is "
                         f"{limits.max_bytes} bytes per image (--max-image-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's base64 payload is not valid base64") from None


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == a.lower() or (a.startswith(".") and host.endswith(a.lower()))
               for a in allowed)


def _fetch(url: str, limits: ImageLimits) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or ""
    if not limits.allow_remote:
        raise ImageError("image URLs over http(s) are refused by this server; send the image "
                         "inline as a data URL (or start it with --allow-image-urls HOST,...)")
    if not host_allowed(host, limits.allowed_hosts):
        raise ImageError(f"image host {host!r} is not in this server's allow-list "
                         "(--allow-image-urls)")
    opener = urllib.request.build_opener(_NoRedirect)   # a redirect could leave the list
    try:
        with opener.open(url, timeout=limits.fetch_timeout_s) as resp:
            data = resp.read(limits.max_bytes + 1)
    except Exception as exc:
        raise ImageError(f"fetching the image from {host!r} failed ({exc})") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image at {host!r} is over the limit of {limits.max_bytes} "
                         "bytes per image (--max-image-bytes)")
    return data


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        raise ImageError("image URL redirects are not followed")
