"""Drawing an environment's current screen as a small PNG (what the aggregator's `computer` tool returns).

Every app screen here is the same shape: a title bar, a header row and a list of rows, with a status line.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

WIDTH = 800
ROW_H = 18
PAD = 8


@dataclass(frozen=True)
class Column:
    title: str
    width: int  # characters shown before truncation


@dataclass(frozen=True)
class Screen:
    title: str
    columns: Sequence[Column]
    rows: Sequence[Sequence[object]]
    status: str = ""
    bold_rows: frozenset[int] = frozenset()  # indices drawn highlighted (e.g. unread mail)


def _fit(value: object, width: int) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def render(screen: Screen) -> bytes:
    """A PNG of the screen; sized to its rows, deterministic for the same input."""
    font = ImageFont.load_default()
    char_w = 7  # the default bitmap font is ~6-7 px per character
    height = PAD * 2 + ROW_H * (len(screen.rows) + 3)
    img = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, 0, WIDTH, ROW_H + PAD), fill=(32, 72, 140))
    draw.text((PAD, PAD // 2 + 2), _fit(screen.title, 110), fill="white", font=font)
    y = ROW_H + PAD + 4
    x = PAD
    for col in screen.columns:
        draw.text((x, y), _fit(col.title, col.width), fill=(90, 90, 90), font=font)
        x += col.width * char_w + PAD
    y += ROW_H
    draw.line((PAD, y - 3, WIDTH - PAD, y - 3), fill=(200, 200, 200))
    for i, values in enumerate(screen.rows):
        if i in screen.bold_rows:
            draw.rectangle((0, y - 2, WIDTH, y + ROW_H - 4), fill=(230, 238, 250))
        x = PAD
        for col, value in zip(screen.columns, values, strict=False):
            draw.text((x, y), _fit(value, col.width), fill="black", font=font)
            x += col.width * char_w + PAD
        y += ROW_H
    if screen.status:
        draw.text((PAD, y + 2), _fit(screen.status, 110), fill=(90, 90, 90), font=font)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=False)
    return out.getvalue()
