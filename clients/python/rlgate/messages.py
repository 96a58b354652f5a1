"""Typed chat messages whose content is text or a list of parts that can hold images.

What rlgate hands a policy: `Episode.initial_messages()`, `TurnResult.observations`, `rlgate rollout`'s
conversation, the adapters' prompts. A message is frozen; its content is either a plain `str` or a tuple of
`TextPart` / `ImagePart`. Two renderings cover every consumer:

- `to_openai()`: OpenAI-compatible chat dicts; an image becomes
  `{"type": "image_url", "image_url": {"url": "data:<mime>;base64,..."}}`;
- `text()`: text only, an image replaced by a short placeholder (for text-only policies and for trainers
  whose messages are `dict[str, str]`, such as skyrl-gym's).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


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
        """A message from parts, adjacent text runs joined; plain text when no image is among them."""
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
    """Every message as an OpenAI-compatible chat dict."""
    return [m.to_openai() for m in messages]
