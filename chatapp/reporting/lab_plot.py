"""Terminal curves for the lab: braille-dot line charts (and block-character bars) as plain
strings (the CLI and the Lab screen colour them). Each character cell holds 2 x 4 dots, so a 40 x 8
chart has 80 x 32 dots."""
from __future__ import annotations

from typing import Any

# Dot bit for (column 0/1, row 0..3) inside one braille cell (U+2800 + bits).
_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))


def braille(xs: list[float], ys: list[float], width: int, height: int, *, connect: bool = True,
            y_max: float | None = None) -> list[str]:
    """`height` lines of `width` braille characters; y from 0 to y_max (default: the data's max)."""
    cells = [[0] * width for _ in range(height)]
    dots_w, dots_h = width * 2, height * 4
    x0, x1 = min(xs), max(xs)
    top = y_max if y_max is not None else max(ys) or 1.0

    def dot(x: float, y: float) -> tuple[int, int]:
        dx = round((x - x0) / (x1 - x0) * (dots_w - 1)) if x1 > x0 else 0
        dy = dots_h - 1 - round(max(0.0, min(y / top, 1.0)) * (dots_h - 1))
        return dx, dy

    pts = [dot(x, y) for x, y in sorted(zip(xs, ys))]
    if connect and len(pts) > 1:             # fill in the segments dot by dot
        line = []
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            steps = max(abs(bx - ax), abs(by - ay), 1)
            line += [(ax + (bx - ax) * i // steps, ay + (by - ay) * i // steps) for i in range(steps + 1)]
        pts = line
    for dx, dy in pts:
        cells[dy // 4][dx // 2] |= _BITS[dy % 4][dx % 2]
    return ["".join(chr(0x2800 + c) for c in row) for row in cells]


def _num(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v / 1000:.3g}k"
    return f"{v:.3g}"


def chart(curve: dict[str, Any], width: int = 40, height: int = 6) -> list[str]:
    """A titled chart of one lab curve: y labels at the top and bottom, the x range underneath."""
    if not curve["x"]:
        return [curve["title"], "  (no data)"]
    if curve.get("kind") == "bars":
        return bars(curve, width)
    xs, ys = [float(x) for x in curve["x"]], [float(y) for y in curve["y"]]
    top = max(ys) or 1.0
    plot = braille(xs, ys, width, height, connect=curve.get("kind") != "scatter", y_max=top)
    label_w = max(len(_num(top)), 1)
    lines = [f"{curve['title']} ({curve['y_label']})"]
    for i, row in enumerate(plot):
        label = _num(top) if i == 0 else "0" if i == height - 1 else ""
        lines.append(f"{label:>{label_w}} ┤{row}")
    lo, hi = _num(min(xs)), _num(max(xs))
    lines.append(" " * (label_w + 2) + lo + curve["x_label"].center(max(width - len(lo) - len(hi), 0)) + hi)
    return lines


def bars(curve: dict[str, Any], width: int) -> list[str]:
    """A bars curve: per category a line with its name and value, then its bar from 0 (its `part`
    drawn ▒ at the end) and its note, in `width` columns; the last line gives the scale."""
    ys = [float(y) for y in curve["y"]]
    top = max(ys) or 1.0
    parts, notes = curve.get("part") or [0.0] * len(ys), curve.get("notes") or [""] * len(ys)
    room = max(4, width - 2 - max(len(n) for n in notes))
    lines = [f"{curve['title']} ({curve['y_label']})"]
    for name, y, part, note in zip(curve["x"], ys, parts, notes):
        whole = round(y / top * room)
        tail = min(round(part / top * room), whole)
        lines += [f"{name}: {_num(y)}", "┤" + "█" * (whole - tail) + "▒" * tail + f" {note}"]
    legend = f"   ▒ {curve['part_label']}" if curve.get("part_label") else ""
    return lines + [f"0 … {_num(top)}{legend}"]
