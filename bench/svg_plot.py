"""A small dependency-free SVG chart: a grid of panels, one curve each (line or scatter, with an
optional dashed least-squares line, or horizontal bars by category). Enough for the lab's figures
without a plotting library."""
from __future__ import annotations

import math
from html import escape
from typing import Any

from pdchat.themes.palette import LIGHT_ROLES

# The light shades of the colour roles: the SVG has a white background.
ROLE_COLOURS = LIGHT_ROLES
PANEL_W, PANEL_H, COLS = 300, 220, 4
PAD_L, PAD_R, PAD_T, PAD_B = 52, 14, 30, 40
HEADER = 52


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2 or 5 times a power of ten apart)."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.3g}"


def _panel(c: dict[str, Any], ox: float, oy: float) -> list[str]:
    xs, ys = [float(x) for x in c["x"]], [float(y) for y in c["y"]]
    colour = ROLE_COLOURS.get(c.get("role", ""), "#334155")
    xt = nice_ticks(min(xs + [0.0]) if c.get("kind") != "scatter" else min(xs), max(xs))
    yt = nice_ticks(0.0, max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    left, right, top, bottom = ox + PAD_L, ox + PANEL_W - PAD_R, oy + PAD_T, oy + PANEL_H - PAD_B

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (right - left)

    def py(y: float) -> float:
        return bottom - (y - y0) / (y1 - y0) * (bottom - top)

    out = _card(c, ox, oy)
    for t in yt:
        out.append(f'<line x1="{left}" x2="{right}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>')
        out.append(f'<text x="{left - 5}" y="{py(t) + 3.5:.1f}" class="tick" text-anchor="end">{_label(t)}</text>')
    for t in xt:
        out.append(f'<text x="{px(t):.1f}" y="{bottom + 13}" class="tick" text-anchor="middle">{_label(t)}</text>')
    out.append(f'<line x1="{left}" x2="{right}" y1="{bottom}" y2="{bottom}" class="axis"/>')
    out.append(f'<text x="{(left + right) / 2}" y="{bottom + 28}" class="axislabel" text-anchor="middle">'
               f'{escape(c["x_label"])}</text>')
    out.append(f'<text x="{ox + 13}" y="{(top + bottom) / 2}" class="axislabel" text-anchor="middle" '
               f'transform="rotate(-90 {ox + 13} {(top + bottom) / 2})">{escape(c["y_label"])}</text>')
    if c.get("fit"):
        a, b = c["fit"]["slope"], c["fit"]["intercept"]
        fx0, fx1 = min(xs), max(xs)
        out.append(f'<line x1="{px(fx0):.1f}" y1="{py(a * fx0 + b):.1f}" x2="{px(fx1):.1f}" '
                   f'y2="{py(a * fx1 + b):.1f}" class="fit"/>')
    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
    if c.get("kind") != "scatter":
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
    radius = 1.6 if len(xs) > 24 else 3
    out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{radius}" fill="{colour}"/>' for x, y in zip(xs, ys)]
    out += [_point_label(px(x), py(y), label, right_half=px(x) > (left + right) / 2)
            for x, y, label in zip(xs, ys, c.get("labels") or [])]
    return out


def _card(c: dict[str, Any], ox: float, oy: float) -> list[str]:
    return [f'<rect x="{ox + 4}" y="{oy + 4}" width="{PANEL_W - 8}" height="{PANEL_H - 8}" rx="8" class="card"/>',
            f'<text x="{ox + 14}" y="{oy + 21}" class="title">{escape(c["title"])}</text>']


def _bars(c: dict[str, Any], ox: float, oy: float) -> list[str]:
    """kind "bars": one horizontal bar per category (x), its length y from 0, its name and note
    above it; `part` (optional) is each bar's last stretch, drawn in `part_role`'s colour and named
    by `part_label` beside the axis label."""
    ys = [float(y) for y in c["y"]]
    ticks = nice_ticks(0.0, max(ys))
    left, right, top, bottom = ox + 14, ox + PANEL_W - PAD_R, oy + PAD_T, oy + PANEL_H - PAD_B
    row = (bottom - top) / len(ys)

    def px(v: float) -> float:
        return left + v / ticks[-1] * (right - left)

    out = _card(c, ox, oy)
    for t in ticks:
        out.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top}" y2="{bottom}" class="grid"/>')
        out.append(f'<text x="{px(t):.1f}" y="{bottom + 13}" class="tick" text-anchor="middle">{_label(t)}</text>')
    colour = ROLE_COLOURS.get(c.get("role", ""), "#334155")
    part_colour = ROLE_COLOURS.get(c.get("part_role", ""), "#64748b")
    parts, notes = c.get("part") or [0.0] * len(ys), c.get("notes") or [""] * len(ys)
    for i, (name, y, part, note) in enumerate(zip(c["x"], ys, parts, notes)):
        y0 = top + i * row
        out.append(f'<text x="{left}" y="{y0 + 10:.1f}" class="tick">{escape(str(name))}</text>')
        out.append(f'<text x="{right}" y="{y0 + 10:.1f}" class="tick" text-anchor="end">{escape(note)}</text>')
        out.append(f'<rect x="{left}" y="{y0 + 14:.1f}" width="{px(y) - left:.1f}" height="{min(12.0, row - 16):.1f}" '
                   f'fill="{colour}"/>')
        if part:
            out.append(f'<rect x="{px(y - part):.1f}" y="{y0 + 14:.1f}" width="{px(y) - px(y - part):.1f}" '
                       f'height="{min(12.0, row - 16):.1f}" fill="{part_colour}"/>')
    out.append(f'<line x1="{left}" x2="{right}" y1="{bottom}" y2="{bottom}" class="axis"/>')
    out.append(f'<text x="{left}" y="{bottom + 28}" class="axislabel">{escape(c["y_label"])}</text>')
    if c.get("part_label"):
        out.append(f'<rect x="{right - 8}" y="{bottom + 20}" width="8" height="8" fill="{part_colour}"/>')
        out.append(f'<text x="{right - 12}" y="{bottom + 28}" class="axislabel" text-anchor="end">'
                   f'{escape(c["part_label"])}</text>')
    return out


def _point_label(x: float, y: float, label: str, right_half: bool) -> str:
    # Labels in the right half end at their point, so they stay inside the panel.
    anchor, dx = ("end", -5) if right_half else ("start", 5)
    return f'<text x="{x + dx:.1f}" y="{y - 5:.1f}" class="tick" text-anchor="{anchor}">{escape(label)}</text>'


def svg(curves: list[dict[str, Any]], title: str, subtitle: str = "") -> str:
    """The curves as one SVG document, panels laid out COLS to a row."""
    rows = -(-len(curves) // COLS)
    width, height = COLS * PANEL_W + 16, HEADER + rows * PANEL_H + 8
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="system-ui, -apple-system, Segoe UI, sans-serif">',
             "<style>.card{fill:#ffffff;stroke:#e2e8f0}.title{font-size:13px;font-weight:600;fill:#0f172a}"
             ".tick{font-size:10px;fill:#64748b}.axislabel{font-size:11px;fill:#475569}"
             ".grid{stroke:#eef2f7}.axis{stroke:#94a3b8}.fit{stroke:#64748b;stroke-dasharray:4 3;stroke-width:1.2}"
             "</style>",
             f'<rect width="{width}" height="{height}" fill="#f8fafc"/>',
             f'<text x="20" y="26" font-size="18" font-weight="700" fill="#0f172a">{escape(title)}</text>',
             f'<text x="20" y="44" font-size="12" fill="#64748b">{escape(subtitle)}</text>']
    for i, c in enumerate(curves):
        draw = _bars if c.get("kind") == "bars" else _panel
        parts += draw(c, 8 + (i % COLS) * PANEL_W, HEADER + (i // COLS) * PANEL_H)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
