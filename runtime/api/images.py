"""Images of chat messages (`image_url` content parts) → the vision encoder's input, within a request's limits.

An image is read from a data: URL, or from an https URL whose host the engine allows (`allowed_media_domains`),
never more than `max_image_bytes` of it. PIL reads the header first: the size is checked against
`max_image_pixels` before any pixel is decoded, so a small file that expands to gigabytes (a decompression bomb)
is refused unread. Preprocessing is the model's processor's (mlcc-config.json's `vision.preprocess`): RGB, resize
with PIL's filter, rescale, normalise, channels first, in float32 — transformers' PIL image processors' arithmetic.
Every problem is a RequestError (HTTP 400) naming the part, the limit or the flag that would allow it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import urllib.parse
import urllib.request
from typing import Any

import numpy as np

from mlcc.errors import RequestError
from mlcc.runtime.core.request import PromptImage

# transformers' processors read a side of 1 as a channel axis (infer_channel_dimension_format): refuse it outright
MIN_SIDE = 2
_FETCH_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    allowed_domains: tuple[str, ...] = ()
    max_images: int = 8
    max_pixels: int = 25_000_000
    max_bytes: int = 20 << 20

    @classmethod
    def of(cls, config: Any) -> ImageLimits:
        """From an EngineConfig."""
        return cls(tuple(config.allowed_media_domains), config.max_images_per_request, config.max_image_pixels,
                   config.max_image_bytes)


def read_url(url: str, limits: ImageLimits, param: str) -> bytes:
    """The encoded image a part's URL names (data: or an allowed https host)."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise RequestError(f"{param}: a data URL must be base64 (data:image/png;base64,...)", param=param)
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise _too_big(param, limits)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{param}: the data URL's base64 is invalid", param=param) from None
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "https" or not parsed.hostname:
        raise RequestError(f"{param}: image URLs must be data: URLs or https:// URLs, got {url[:40]!r}", param=param)
    _check_host(parsed.hostname, limits, param)
    opener = urllib.request.build_opener(_CheckedRedirects(limits, param))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "mlcc"}), timeout=_FETCH_TIMEOUT_S) as r:
            data = r.read(limits.max_bytes + 1)
    except RequestError:
        raise
    except (OSError, ValueError) as e:
        raise RequestError(f"{param}: fetching {url[:80]} failed: {e}", param=param) from None
    if len(data) > limits.max_bytes:
        raise _too_big(param, limits)
    return data


def _too_big(param: str, limits: ImageLimits) -> RequestError:
    return RequestError(f"{param}: the image is larger than max_image_bytes ({limits.max_bytes} bytes); send a "
                        "smaller file or raise the server's --max-image-bytes", param=param)


def _check_host(host: str, limits: ImageLimits, param: str) -> None:
    host = host.lower().rstrip(".")
    if not any(host == d or host.endswith("." + d) for d in (x.lower().lstrip(".") for x in limits.allowed_domains)):
        raise RequestError(f"{param}: fetching images from {host} is not allowed; start the server with "
                           f"--allowed-media-domains {host} (or send the image as a data: URL)", param=param)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to another allowed https host."""

    def __init__(self, limits: ImageLimits, param: str):
        self.limits, self.param = limits, param

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        parsed = urllib.parse.urlsplit(newurl)
        if parsed.scheme != "https" or not parsed.hostname:
            raise RequestError(f"{self.param}: the image URL redirects to a non-https URL", param=self.param)
        _check_host(parsed.hostname, self.limits, self.param)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def decode(data: bytes, limits: ImageLimits, param: str):
    """The image as an RGB PIL image, its size checked before its pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise RequestError(f"{param}: not an image PIL can read (PNG, JPEG, WebP, GIF, ...)", param=param) from None
    except Image.DecompressionBombError as e:   # (PIL's own bound, past twice its MAX_IMAGE_PIXELS)
        raise RequestError(f"{param}: the image is larger than max_image_pixels ({limits.max_pixels}): {e}; send "
                           "a smaller image", param=param) from None
    width, height = img.size
    if width * height > limits.max_pixels:
        raise RequestError(f"{param}: the image is {width}x{height}, more than max_image_pixels ({limits.max_pixels}); "
                           "send a smaller image or raise the server's --max-image-pixels", param=param)
    if min(width, height) < MIN_SIDE:
        raise RequestError(f"{param}: the image is {width}x{height}; images must be at least {MIN_SIDE}x{MIN_SIDE} "
                           "pixels", param=param)
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise RequestError(f"{param}: the image could not be decoded ({e}); the file is truncated or corrupt",
                           param=param) from None
    return img.convert("RGB")


def preprocess(img: Any, spec: dict[str, Any]) -> np.ndarray:
    """An RGB PIL image → float32 [3, height, width] as the model's image processor makes it."""
    from PIL import Image

    height, width = spec["size"]
    resample = getattr(Image.Resampling, spec["resample"].upper())
    shortest = spec.get("shortest_edge")
    if shortest:   # the short side to `shortest` (the long one truncated, as transformers), then a center crop
        w, h = img.size
        short, long = min(w, h), max(w, h)
        scaled = (shortest, int(shortest * long / short))
        img = img.resize(scaled if w <= h else scaled[::-1], resample=resample)
        top, left = (img.size[1] - height) // 2, (img.size[0] - width) // 2
        pixels = np.asarray(img.crop((left, top, left + width, top + height)), dtype=np.float32)
    else:
        pixels = np.asarray(img.resize((width, height), resample=resample), dtype=np.float32)
    mean, std = np.asarray(spec["mean"], np.float32), np.asarray(spec["std"], np.float32)
    pixels = (pixels * np.float32(spec["rescale_factor"]) - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def load_images(urls: list[tuple[str, str]], vision: dict[str, Any], limits: ImageLimits) -> list[np.ndarray]:
    """[(url, param name)] → each image preprocessed, in order."""
    if len(urls) > limits.max_images:
        raise RequestError(f"this request has {len(urls)} images, more than max_images_per_request "
                           f"({limits.max_images}); send fewer or raise the server's --max-images-per-request",
                           param="messages")
    return [preprocess(decode(read_url(url, limits, param), limits, param), vision["preprocess"])
            for url, param in urls]


def place_images(ids: list[int], pixels: list[np.ndarray], vision: dict[str, Any]) -> tuple[PromptImage, ...]:
    """Each image's run of image tokens in the prompt's ids, in order."""
    token, length = int(vision["image_token_id"]), int(vision["tokens_per_image"])
    arr = np.asarray(ids)
    where = np.flatnonzero(arr == token)
    starts = [int(p) for i, p in enumerate(where) if i == 0 or where[i - 1] != p - 1]
    if len(starts) != len(pixels) or len(where) != length * len(pixels) or \
            any(not (arr[s:s + length] == token).all() for s in starts):
        raise RequestError(f"the prompt has {len(where)} image tokens in {len(starts)} runs for {len(pixels)} images "
                           f"of {length} tokens each; do not write the model's image tokens as text",
                           param="messages")
    return tuple(PromptImage(s, length, p, hashlib.sha256(p.tobytes()).hexdigest()) for s, p in zip(starts, pixels))
