"""Test images: real PNG and JPEG files of a known size (Pillow), as bytes, data URLs and tool results."""

from __future__ import annotations

import base64
import io
import json

from rlgate.v1 import common_pb2


def png(width: int = 64, height: int = 48, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A PNG of `width` x `height` pixels in one color."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def noise(width: int = 64, height: int = 48, seed: int = 0) -> bytes:
    """A PNG of random pixels: as big as a real screen of that size compresses to, unlike one color."""
    import random

    from PIL import Image

    pixels = random.Random(seed).randbytes(width * height * 3)
    out = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(out, format="PNG")
    return out.getvalue()


def jpeg(width: int = 40, height: int = 30) -> bytes:
    """A JPEG of `width` x `height` pixels."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 120, 200)).save(out, format="JPEG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """`data` as a base64 data URL."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def size_of(data: bytes) -> tuple[int, int]:
    """The pixel size of an encoded image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size


def size_of_url(url: str) -> tuple[int, int]:
    """The pixel size of the image a base64 data URL carries."""
    head, _, payload = url.partition(",")
    assert head.startswith("data:image/") and head.endswith(";base64"), head
    return size_of(base64.b64decode(payload, validate=True))


def image_block(data: bytes, mime: str = "image/png") -> common_pb2.ContentBlock:
    return common_pb2.ContentBlock(image=common_pb2.ImageContent(data=data, mime_type=mime))


def text_block(text: str) -> common_pb2.ContentBlock:
    return common_pb2.ContentBlock(text=common_pb2.TextContent(text=text))


def base64_image_block(url: str | None) -> common_pb2.ContentBlock:
    """A text block as Fleet's screenshot tools write it: `{"base64_image": <data URL or null>}`."""
    return text_block(json.dumps({"base64_image": url}))
