"""A loss curve as a PNG with nothing but the standard library.

``loss.png`` is part of what a run leaves behind, on a fresh machine too, where
matplotlib (tens of MB) is not installed. This draws one line chart (axes, grid, tick
labels, the curve) into an RGB buffer and encodes it (zlib + the PNG chunk format).
Labels use a 3x5 pixel font that knows digits, ``. - +`` and the letters of its labels.
A second series (the ``[eval]`` losses) is drawn as dots joined by a thinner line.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

# 3x5 glyphs, one string of 3 characters per row ('#' = ink)
_GLYPHS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    ".": ("...", "...", "...", "...", ".#."),
    "-": ("...", "...", "###", "...", "..."),
    "+": ("...", ".#.", "###", ".#.", "..."),
    " ": ("...", "...", "...", "...", "..."),
    "a": ("...", "##.", "..#", "###", "###"),
    "e": ("...", "###", "###", "#..", "###"),
    "i": (".#.", "...", ".#.", ".#.", ".#."),
    "l": ("#..", "#..", "#..", "#..", "###"),
    "n": ("...", "##.", "#.#", "#.#", "#.#"),
    "o": ("...", "###", "#.#", "#.#", "###"),
    "p": ("...", "###", "#.#", "###", "#.."),
    "r": ("...", "###", "#..", "#..", "#.."),
    "s": ("...", "###", "##.", ".##", "###"),
    "t": (".#.", "###", ".#.", ".#.", ".##"),
    "v": ("...", "#.#", "#.#", "#.#", ".#."),
}
_SCALE = 2  # font pixels per glyph pixel

WHITE, BLACK, GRID, LINE = (255, 255, 255), (40, 40, 40), (225, 225, 225), (31, 119, 180)
SECOND = (255, 127, 14)  # the second series (eval losses)


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, width: int = 1) -> None:
        """Bresenham, ``width`` pixels thick (downwards and to the right)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for w in range(width):
                self.dot(x0, y0 + w, color)
                self.dot(x0 + w, y0, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, text: str, color=BLACK) -> None:
        """Top-left at (x, y); characters the font lacks are drawn as blanks."""
        for i, char in enumerate(text):
            glyph = _GLYPHS.get(char, _GLYPHS[" "])
            for row, bits in enumerate(glyph):
                for col, bit in enumerate(bits):
                    if bit == "#":
                        for a in range(_SCALE):
                            for b in range(_SCALE):
                                self.dot(
                                    x + (4 * i + col) * _SCALE + a, y + row * _SCALE + b, color
                                )

    def png(self) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )  # filter type 0 (none) before every row

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (
                struct.pack(">I", len(data))
                + kind
                + data
                + struct.pack(">I", zlib.crc32(kind + data))
            )

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows, 9))
            + chunk(b"IEND", b"")
        )


def text_width(text: str) -> int:
    return len(text) * 4 * _SCALE


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values (1, 2 or 5 times a power of ten apart) in [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.3g}"


def write_line_chart(
    path: Path,
    xs: Sequence[float],
    ys: Sequence[float],
    *,
    points: tuple[Sequence[float], Sequence[float]] | None = None,
    width: int = 720,
    height: int = 420,
) -> None:
    """A PNG line chart of ``ys`` against ``xs`` (x axis "step", y axis "loss");
    ``points``: a second series ``(xs, ys)`` (dots, labelled "eval" against "train")."""
    if not xs or len(xs) != len(ys):
        raise ValueError("write_line_chart needs as many x as y values, at least one")
    second_x, second_y = points if points is not None else ((), ())
    if len(second_x) != len(second_y):
        raise ValueError("write_line_chart's points need as many x as y values")
    finite_second = [y for y in second_y if math.isfinite(y)]
    left, right, top, bottom = 70, 20, 20, 50
    canvas = _Canvas(width, height)
    x_low, x_high = min([*xs, *second_x]), max([*xs, *second_x])
    y_low, y_high = min([*ys, *finite_second]), max([*ys, *finite_second])
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    pad = (y_high - y_low) * 0.05 or abs(y_high) * 0.05 or 1.0
    y_low, y_high = y_low - pad, y_high + pad
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> int:
        return left + round((x - x_low) / (x_high - x_low) * (plot_w - 1))

    def py(y: float) -> int:
        return top + round((y_high - y) / (y_high - y_low) * (plot_h - 1))

    for tick in nice_ticks(x_low, x_high):
        canvas.line(px(tick), top, px(tick), top + plot_h - 1, GRID)
        label = _label(tick)
        canvas.text(px(tick) - text_width(label) // 2, top + plot_h + 8, label)
    for tick in nice_ticks(y_low, y_high):
        canvas.line(left, py(tick), left + plot_w - 1, py(tick), GRID)
        label = _label(tick)
        canvas.text(left - 8 - text_width(label), py(tick) - 5, label)
    canvas.line(left, top, left, top + plot_h - 1, BLACK)  # axes
    canvas.line(left, top + plot_h - 1, left + plot_w - 1, top + plot_h - 1, BLACK)
    canvas.text(left + plot_w // 2 - text_width("step") // 2, height - 18, "step")
    canvas.text(8, top, "loss")
    curve = [(px(x), py(y)) for x, y in zip(xs, ys) if math.isfinite(y)]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        canvas.line(x0, y0, x1, y1, LINE, width=2)
    if len(curve) == 1:
        canvas.line(*curve[0], *curve[0], LINE, width=3)
    if points is not None:
        dots = [(px(x), py(y)) for x, y in zip(second_x, second_y) if math.isfinite(y)]
        for (x0, y0), (x1, y1) in zip(dots, dots[1:]):
            canvas.line(x0, y0, x1, y1, SECOND)
        for x, y in dots:
            canvas.line(x - 2, y - 2, x - 2, y - 2, SECOND, width=5)  # a 5x5 dot
        legend_x = left + plot_w - 8 - text_width("train") - 16
        for row, (name, color) in enumerate((("train", LINE), ("eval", SECOND))):
            y = top + 8 + 14 * row
            canvas.line(legend_x, y + 4, legend_x + 10, y + 4, color, width=2)
            canvas.text(legend_x + 14, y, name)
    Path(path).write_bytes(canvas.png())
