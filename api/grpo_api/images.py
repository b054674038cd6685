"""Dataset images in verl's layout (data.imageKey: a list of {bytes, path} per row), checked where
they are read: by `grpo run` before anything starts (local files), by the trainer (every file).

PIL is imported inside the functions: importing grpo_api stays cheap, and the operator never
calls them.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

IMAGE_NAME = re.compile(r"[0-9a-f]{64}")
"""A stored image's name in a run (RunLayout.image): the SHA-256 hex of its encoded bytes."""

# (magic bytes at the start, MIME type, file extension) of the formats a browser shows.
_KINDS = ((b"\x89PNG\r\n\x1a\n", "image/png", ".png"), (b"\xff\xd8\xff", "image/jpeg", ".jpg"),
          (b"GIF87a", "image/gif", ".gif"), (b"GIF89a", "image/gif", ".gif"))


def image_kind(data: bytes) -> tuple[str, str]:
    """(MIME type, file extension) of encoded image bytes, from their magic bytes (WebP: RIFF....WEBP);
    ("application/octet-stream", ".bin") for any other format PIL reads (BMP, TIFF ...)."""
    for magic, mime, ext in _KINDS:
        if data.startswith(magic):
            return mime, ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp", ".webp"
    return "application/octet-stream", ".bin"


def image_name(uri: str) -> str | None:
    """The stored image's name at the end of a record's image URI; None when it isn't one."""
    name = uri.rsplit("/", 1)[-1]
    return name if IMAGE_NAME.fullmatch(name) else None


def open_image(data: bytes):
    """A PIL RGB image from encoded bytes (PNG, JPEG ...); ValueError when they aren't one."""
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"not a readable image ({exc})") from None
    return image.convert("RGB")


def check_local_images(path: str | Path, key: str) -> None:
    """Every image of a local parquet file's `key` column opens; ValueError naming the file, row
    and image otherwise. A file without the column has nothing to check; images given by path
    are the trainer's to read."""
    import pyarrow.parquet as pq

    from grpo_api.storage import read_parquet
    if key not in pq.read_schema(path).names:
        return
    for row, images in enumerate(read_parquet(path, columns=[key]).column(key).to_pylist()):
        for k, image in enumerate(images or []):
            data = image.get("bytes") if isinstance(image, dict) else None
            if data:
                try:
                    open_image(data)
                except ValueError as exc:
                    raise ValueError(f"{path}: row {row}: {key}[{k}]: {exc}") from None
