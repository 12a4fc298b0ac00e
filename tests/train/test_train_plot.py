"""The built-in PNG loss chart (no matplotlib): a valid PNG whose pixels show the curve."""

from __future__ import annotations

import struct
import zlib

import pytest

from usp.train.png_chart import LINE, nice_ticks, write_line_chart


def _decode(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit RGB PNG written without row filters."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind}"
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color, *_ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    rows = [raw[y * stride : (y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)  # filter "none"
    return width, height, [row[1:] for row in rows]


def test_chart_draws_a_falling_curve(tmp_path):
    path = tmp_path / "loss.png"
    steps = list(range(1, 101))
    write_line_chart(path, steps, [5.0 - 0.045 * s for s in steps], width=300, height=200)
    width, height, rows = _decode(path.read_bytes())
    assert (width, height) == (300, 200)
    line_pixels = [
        (x, y)
        for y, row in enumerate(rows)
        for x in range(width)
        if tuple(row[3 * x : 3 * x + 3]) == LINE
    ]
    assert len(line_pixels) > 100
    left = min(line_pixels)  # the leftmost curve pixel is high, the rightmost low
    right = max(line_pixels)
    assert left[1] < right[1] - 50


@pytest.mark.parametrize(
    "low,high,expected",
    [(0, 200, [0, 50, 100, 150, 200]), (0.03, 5.6, [2, 4]), (1, 1, [1])],
)
def test_nice_ticks(low, high, expected):
    ticks = nice_ticks(low, high)
    assert [round(t, 9) for t in ticks][-len(expected) :] == expected


def test_chart_refuses_mismatched_data(tmp_path):
    with pytest.raises(ValueError, match="as many x as y"):
        write_line_chart(tmp_path / "x.png", [1, 2], [1.0])
