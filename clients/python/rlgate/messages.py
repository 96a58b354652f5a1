"""Typed chat messages whose content is text or a list of parts that can hold images.

What rlgate hands a policy: `Episode.initial_messages()`, `TurnResult.observations`, `rlgate rollout`'s
conversation, the adapters' prompts. A message is frozen; its content is either a plain `str` or a tuple of
`TextPart` / `ImagePart`. Two renderings cover every consumer:

- `to_openai()`: OpenAI-compatible chat dicts; an image becomes
  `{"type": "image_url", "image_url": {"url": "data:<mime>;base64,..."}}`;
- `text()`: text only, an image replaced by a short placeholder (for text-only policies and for trainers
  whose messages are `dict[str, str]`, such as skyrl-gym's).

A conversation of screens grows by one or more images a turn: `keep_last_images(messages, n)` keeps the last
`n` and puts a short note (`IMAGE_OMITTED`) in place of each older one, so a long episode's prompt stays
bounded. `rlgate rollout` and the adapters apply it each turn (`DEFAULT_KEEP_IMAGES` unless set).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from PIL import Image

Role = Literal["system", "user", "assistant", "tool"]

# What stands in for a screen that `keep_last_images` dropped from the context.
IMAGE_OMITTED = "[earlier screenshot omitted]"
# Screens a conversation keeps by default (rollout and the adapters): the current one and two before it.
DEFAULT_KEEP_IMAGES = 3
# Pixels `ImagePart.to_pil` decodes at most (an 8K screen): a few compressed bytes can claim billions.
MAX_IMAGE_PIXELS = 7680 * 4320

_DATA_URL_RE = re.compile(r"data:(image/[A-Za-z0-9.+-]+);base64,", re.IGNORECASE)


class UnreadableImage(ValueError):
    """An image that cannot be used: not a base64 `data:image/...` URL, or bytes no image decoder reads."""


@dataclass(frozen=True)
class TextPart:
    """A run of text.

    Args:
        text: the text itself.
    """

    text: str

    def to_openai(self) -> dict[str, Any]:
        """`{"type": "text", "text": ...}`."""
        return {"type": "text", "text": self.text}


@dataclass(frozen=True)
class ImagePart:
    """An image, kept as its encoded bytes (PNG or JPEG as the environment sent it).

    Args:
        data: the encoded image (not base64).
        mime_type: its media type, such as `image/png`.
    """

    data: bytes
    mime_type: str

    @classmethod
    def from_data_url(cls, url: str) -> ImagePart:
        """The image a `data:image/<type>;base64,<data>` URL carries, decoded once.

        Args:
            url: the data URL (its size is bounded by whoever received it: rlgate's gateway bounds a result).

        Raises:
            UnreadableImage: not such a URL, the base64 is malformed, or it carries no bytes.
        """
        match = _DATA_URL_RE.match(url)
        if match is None:
            raise UnreadableImage("not a data:image/...;base64 URL")
        try:
            data = base64.b64decode(url[match.end() :], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnreadableImage(f"malformed base64 ({exc})") from None
        if not data:
            raise UnreadableImage("the data URL carries no bytes")
        return cls(data, match.group(1).lower())

    def to_pil(self) -> Image.Image:
        """The decoded image (Pillow, imported here: only the adapters that hand models images need it).

        Raises:
            UnreadableImage: the bytes are not an image Pillow can decode, or it has more than
                `MAX_IMAGE_PIXELS` pixels (checked from its header, before decoding).
        """
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(self.data))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise UnreadableImage(f"{self.mime_type} image of {width}x{height} pixels is larger than 8K")
            image.load()  # decode now: a truncated file fails here, not inside a trainer's renderer
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise UnreadableImage(f"{self.mime_type} image could not be decoded ({exc})") from None
        return image

    def data_url(self) -> str:
        """The image as a `data:` URL, the form OpenAI-compatible endpoints take."""
        return f"data:{self.mime_type};base64,{base64.b64encode(self.data).decode('ascii')}"

    def placeholder(self) -> str:
        """What a text-only reader sees in the image's place."""
        return f"[image: {self.mime_type}, {len(self.data)} bytes]"

    def to_openai(self) -> dict[str, Any]:
        """`{"type": "image_url", "image_url": {"url": "data:...;base64,..."}}`."""
        return {"type": "image_url", "image_url": {"url": self.data_url()}}


Part = TextPart | ImagePart
Content = str | tuple[Part, ...]


@dataclass(frozen=True)
class Message:
    """One chat message.

    Args:
        role: `system`, `user`, `assistant` or `tool`.
        content: plain text, or a tuple of text and image parts in reading order.
    """

    role: Role
    content: Content

    @classmethod
    def of(cls, role: Role, parts: Iterable[Part | str]) -> Message:
        """A message from parts, adjacent text runs joined; plain text when no image is among them.

        Args:
            role: `system`, `user`, `assistant` or `tool`.
            parts: text (a `str` or `TextPart`) and image parts, in reading order.
        """
        merged: list[Part] = []
        for part in parts:
            piece = TextPart(part) if isinstance(part, str) else part
            if isinstance(piece, TextPart) and merged and isinstance(merged[-1], TextPart):
                merged[-1] = TextPart(merged[-1].text + piece.text)
            else:
                merged.append(piece)
        if all(isinstance(p, TextPart) for p in merged):
            return cls(role, "".join(p.text for p in merged if isinstance(p, TextPart)))
        return cls(role, tuple(merged))

    @property
    def parts(self) -> tuple[Part, ...]:
        """The content as parts (plain text is one `TextPart`)."""
        return (TextPart(self.content),) if isinstance(self.content, str) else self.content

    @property
    def images(self) -> tuple[ImagePart, ...]:
        """The image parts, in order."""
        return tuple(p for p in self.parts if isinstance(p, ImagePart))

    def text(self) -> str:
        """The content as text, each image replaced by its placeholder."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else p.placeholder() for p in self.content)

    def to_openai(self) -> dict[str, Any]:
        """An OpenAI-compatible chat message: `content` a string, or a list of parts when it holds images."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": [p.to_openai() for p in self.content]}

    def to_text_dict(self) -> dict[str, str]:
        """`{"role": ..., "content": <text>}`, images as placeholders (skyrl-gym's message shape)."""
        return {"role": self.role, "content": self.text()}


def to_openai(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Every message as an OpenAI-compatible chat dict.

    Args:
        messages: the conversation.
    """
    return [m.to_openai() for m in messages]


def to_text_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Every message as `{"role", "content": <text>}`, images as placeholders (for text-only readers).

    Args:
        messages: the conversation.
    """
    return [m.to_text_dict() for m in messages]


def images_to_omit(counts: Sequence[int], keep: int) -> list[int]:
    """How many leading images of each message to omit so that only the last `keep` images remain.

    The one rule of `keep_last_images`, apart for readers whose messages are not `Message`s (the Tinker
    cookbook's).

    Args:
        counts: the number of images in each message, in conversation order.
        keep: how many of the most recent images to keep (0: none).

    Raises:
        ValueError: `keep` is negative.
    """
    if keep < 0:
        raise ValueError(f"images to keep must be 0 or more, not {keep}")
    excess = max(0, sum(counts) - keep)
    omit: list[int] = []
    for count in counts:
        here = min(count, excess)
        omit.append(here)
        excess -= here
    return omit


def keep_last_images(messages: Sequence[Message], keep: int = DEFAULT_KEEP_IMAGES) -> list[Message]:
    """The conversation with only its last `keep` images; each older one becomes the note `IMAGE_OMITTED`.

    Messages without an omitted image are returned as they are (the same objects).

    Args:
        messages: the conversation.
        keep: how many of the most recent images to keep (0: none).

    Raises:
        ValueError: `keep` is negative.
    """
    omit = images_to_omit([len(m.images) for m in messages], keep)
    return [m if n == 0 else _omit_images(m, n) for m, n in zip(messages, omit, strict=True)]


def _omit_images(message: Message, count: int) -> Message:
    parts: list[Part] = []
    for part in message.parts:
        if isinstance(part, ImagePart) and count > 0:
            parts.append(TextPart(IMAGE_OMITTED))
            count -= 1
        else:
            parts.append(part)
    return Message.of(message.role, parts)
