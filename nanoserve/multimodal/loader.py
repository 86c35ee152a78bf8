"""Where a message's image or video comes from -> what the processor takes, under the server's rules.

    MediaLoader(rules).image(source)   a data URL, an allowed http(s) or file URL, or (offline) a PIL image, bytes
                                       or an array -> the image as the processor takes it (bytes, PIL, array)
    MediaLoader(rules).video(source)   a data:video/jpeg URL of base64 JPEG frames (vLLM's form), or frames ->
                                       a Video

The rules are vLLM's flags: http(s) URLs are fetched only from hosts that `allowed_media_domains` lists (none by
default: a request may not make the server fetch from anywhere it names), file:// URLs are read only under
`allowed_local_media_path`. A fetched or read file may not exceed `max_bytes`, and a fetch must finish within
`timeout` seconds; decoding limits (pixels, formats, corrupt data) are the processor's (media.py). Every problem
is a ValueError whose message says what is wrong; the server answers it with a 400 naming the request field.
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from nanoserve.multimodal.media import MAX_IMAGE_PIXELS, as_rgb_array, decode_image
from nanoserve.multimodal.processor import Video
from nanoserve.multimodal.video import frames_array

MAX_MEDIA_BYTES = 20 << 20
"""The largest image or video file fetched or read from a URL (20 MiB; a data URL is bounded by the request's
body limit)."""
FETCH_TIMEOUT_S = 10.0
"""How long fetching one http(s) URL may take."""


@dataclass(frozen=True)
class MediaRules:
    """What a request may point the server at (vLLM's --allowed-media-domains, --allowed-local-media-path)."""

    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_bytes: int = MAX_MEDIA_BYTES
    timeout: float = FETCH_TIMEOUT_S


def parse_data_url(url: str) -> tuple[str, str]:
    """data:<media type>;base64,<payload> -> (media type, payload); ValueError for anything else."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError("a data URL must be data:<media type>;base64,<data>")
    return head[len("data:"):-len(";base64")].lower(), payload


def b64decode(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the data is not valid base64 ({e})") from None


class MediaLoader:
    """Loads the sources of image and video parts under a set of rules (see the module docstring)."""

    def __init__(self, rules: MediaRules | None = None):
        self.rules = rules or MediaRules()
        self.local_root = os.path.realpath(self.rules.allowed_local_media_path) \
            if self.rules.allowed_local_media_path else None

    # -- images ---------------------------------------------------------------------------------------------
    def image(self, source: Any) -> Any:
        """An image part's source -> bytes, a PIL image or an array (the processor decodes and checks it)."""
        if isinstance(source, (Image.Image, np.ndarray, bytes, bytearray)):
            return source
        if not isinstance(source, str) or not source:
            raise ValueError("an image must be given as a URL (data:, http(s): or file:)")
        if source.startswith("data:"):
            media_type, payload = parse_data_url(source)
            if not media_type.startswith("image/"):
                raise ValueError(f"a data URL of type {media_type or 'none'} is no image (image/png, image/jpeg, "
                                 f"image/webp)")
            return b64decode(payload)
        return self.read_url(source)

    # -- videos ---------------------------------------------------------------------------------------------
    def video(self, source: Any) -> Video:
        """A video part's source -> its frames. A URL must be vLLM's data:video/jpeg;base64,<frame>,<frame>,...
        (each frame a base64 JPEG); a decoded list of frames (offline) passes as it is."""
        if isinstance(source, Video):
            return source
        if isinstance(source, (np.ndarray, list)):
            return Video(source)
        if not isinstance(source, str) or not source:
            raise ValueError("a video must be given as a URL (data:video/jpeg;base64,...)")
        if not source.startswith("data:"):
            raise ValueError("a video must be sent as data:video/jpeg;base64,<frame>,<frame>,... (its frames as "
                             "JPEG images): video files (mp4, webm, ...) are not decoded here")
        media_type, payload = parse_data_url(source)
        if media_type != "video/jpeg":
            raise ValueError(f"a video data URL of type {media_type or 'none'} cannot be decoded: send its frames "
                             f"as data:video/jpeg;base64,<frame>,<frame>,...")
        frames = [decode_image(b64decode(part)) for part in payload.split(",")]
        if len({f.shape for f in frames}) > 1:
            raise ValueError(f"the video's frames differ in size: {sorted({f.shape[:2] for f in frames})}")
        return Video(np.stack(frames))

    # -- URLs -----------------------------------------------------------------------------------------------
    def read_url(self, url: str) -> bytes:
        """The bytes behind an http(s) or file URL, if the rules allow it."""
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme in ("http", "https"):
            return self._fetch(url, parsed)
        if parsed.scheme == "file":
            return self._read_local(urllib.parse.unquote(parsed.path))
        raise ValueError(f"a URL must be data:, http(s): or file:, got {parsed.scheme or 'none'}:")

    def _fetch(self, url: str, parsed: urllib.parse.ParseResult) -> bytes:
        domains = self.rules.allowed_media_domains
        host = (parsed.hostname or "").lower()
        if not domains:
            raise ValueError("http(s) URLs are not fetched by this server (start it with --allowed-media-domains to "
                             "allow some hosts); send the image as a data URL")
        if host not in domains:
            raise ValueError(f"the host {host!r} is not in --allowed-media-domains")
        request = urllib.request.Request(url, headers={"User-Agent": "nanoserve"})
        try:
            with _NO_REDIRECTS.open(request, timeout=self.rules.timeout) as response:
                return self._bounded(response, f"{host}'s answer")
        except urllib.error.HTTPError as e:
            raise ValueError(f"fetching the URL failed: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"fetching the URL failed: {getattr(e, 'reason', e)}") from None

    def _read_local(self, path: str) -> bytes:
        if self.local_root is None:
            raise ValueError("file URLs are not read by this server (start it with --allowed-local-media-path)")
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.local_root]) != self.local_root:
            raise ValueError("the file must be under --allowed-local-media-path")
        if not os.path.isfile(real):
            raise ValueError("the file does not exist")
        with open(real, "rb") as f:
            return self._bounded(f, "the file")

    def _bounded(self, stream: Any, what: str) -> bytes:
        limit = self.rules.max_bytes
        data = stream.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{what} is larger than the limit of {limit:,} bytes")
        return data


def load_parts(loader: MediaLoader, parts: list[Any], max_pixels: int = MAX_IMAGE_PIXELS
               ) -> tuple[list[np.ndarray], list[Video]]:
    """The images and videos of a conversation's media parts (each with `modality`, `source` and `where`: the
    chat template's MediaPart), loaded and decoded in order; a ValueError names the part's field."""
    images: list[np.ndarray] = []
    videos: list[Video] = []
    for part in parts:
        try:
            if part.modality == "image":
                images.append(as_rgb_array(loader.image(part.source), max_pixels))
            else:
                video = loader.video(part.source)
                videos.append(Video(frames_array(video.frames, max_pixels), video.fps, video.frame_indices))
        except ValueError as e:
            raise ValueError(f"{part.where}: {e}") from None
    return images, videos


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead outside the allowed hosts: it is refused, not followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102
        raise urllib.error.HTTPError(req.full_url, code, "redirects are not followed", headers, fp)


_NO_REDIRECTS = urllib.request.build_opener(_NoRedirect)
