"""Small line charts drawn with Pillow (already a server dependency), so plotting adds no package.

`line_panels(path, title, x_label, xs, panels)` draws one panel per (y label, values) side by side, with a
log2 x axis (concurrency levels 1, 16, 64, 256), labelled points and a zero-based y axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

PANEL_W, PANEL_H = 520, 360
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 70, 20, 50, 55
COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44))


def _nice_max(value: float) -> float:
    """A round upper bound for an axis (1, 2 or 5 times a power of ten)."""
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * exp:
            return float(step * exp)
    return float(10 * exp)


def _label(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def line_panels(
    path: Path, title: str, x_label: str, xs: Sequence[float], panels: Sequence[tuple[str, Sequence[float]]]
) -> Path:
    if not xs or any(len(ys) != len(xs) for _, ys in panels):
        raise ValueError("every panel needs one y value per x")
    font = ImageFont.load_default()
    width = PANEL_W * len(panels)
    image = Image.new("RGB", (width, PANEL_H + 30), "white")
    draw = ImageDraw.Draw(image)
    draw.text((width // 2, 8), title, fill="black", font=font, anchor="mt")
    log_xs = [math.log2(x) for x in xs]
    x_lo, x_hi = min(log_xs), max(log_xs)
    x_span = (x_hi - x_lo) or 1.0
    for index, (label, ys) in enumerate(panels):
        left = index * PANEL_W + MARGIN_L
        top = 30 + MARGIN_T
        right = (index + 1) * PANEL_W - MARGIN_R
        bottom = 30 + PANEL_H - MARGIN_B
        y_max = _nice_max(max(ys) * 1.1)
        draw.text(((left + right) // 2, top - 8), label, fill="black", font=font, anchor="mb")
        for tick in range(6):  # y grid and labels
            y = bottom - (bottom - top) * tick / 5
            draw.line((left, y, right, y), fill=(225, 225, 225))
            draw.text((left - 6, y), f"{y_max * tick / 5:g}", fill="black", font=font, anchor="rm")
        draw.rectangle((left, top, right, bottom), outline="black")
        points = []
        for x, lx, y_value in zip(xs, log_xs, ys, strict=True):
            px = left + (right - left) * (lx - x_lo) / x_span
            py = bottom - (bottom - top) * y_value / y_max
            points.append((px, py))
            draw.text((px, bottom + 6), f"{x:g}", fill="black", font=font, anchor="mt")
            draw.text((px, py - 6), _label(y_value), fill=COLORS[index % len(COLORS)], font=font, anchor="mb")
        draw.line(points, fill=COLORS[index % len(COLORS)], width=2)
        for px, py in points:
            draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=COLORS[index % len(COLORS)])
        draw.text(((left + right) // 2, bottom + 24), x_label, fill="black", font=font, anchor="mt")
    image.save(path)
    return path
