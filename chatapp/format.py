"""Number formatting shared by the panel and the per-message summary. None -> "n/a"."""
from __future__ import annotations

from typing import Any

from pdchat.engine import settings

NA = "n/a"
BARS = "▁▂▃▄▅▆▇█"


def ms(v: float | None) -> str:
    if v is None:
        return NA
    return f"{v:,.0f} ms" if v >= 10 else f"{v:.1f} ms"


def seconds(v_ms: float | None) -> str:
    """A wait a person reads: "0.4 s", "12 s", "2 min 5 s"."""
    if v_ms is None:
        return NA
    s = v_ms / 1000
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    return f"{int(s // 60)} min {int(s % 60)} s"


def time_left(elapsed_s: float, fraction: float) -> str:
    """"~2 min 5 s left" at the pace so far (elapsed / fraction done), once there is a pace to go by."""
    if fraction < 0.02 or elapsed_s < 1:
        return "estimating the time left"
    return f"~{seconds(1000 * elapsed_s * (1 - fraction) / fraction)} left"


def rate(v: float | None, unit: str = "tok/s") -> str:
    return NA if v is None else f"{v:,.1f} {unit}"


def pct(v: float | None) -> str:
    return NA if v is None else f"{v:.0f}%"


def size(v: int | float | None) -> str:
    if v is None:
        return NA
    for unit, scale in (("GB", 1024 ** 3), ("MB", 1024 ** 2), ("KB", 1024)):
        if abs(v) >= scale:
            return f"{v / scale:,.1f} {unit}"
    return f"{v:,.0f} B"


def count(v: int | None) -> str:
    return NA if v is None else f"{v:,}"


def summary(m: dict[str, Any] | None, prefill_rate: bool = False) -> str:
    """One line per reply: TTFT · prompt (cached) [· prefill rate] [· KV transfer] · output @ rate ·
    TPOT · spec."""
    if not m:
        return ""
    parts = [f"TTFT {ms(m.get('ttft_ms'))}"]
    prompt = f"{count(m.get('prompt_tokens'))} prompt tok"
    if m.get("cached_prompt_tokens"):
        prompt += f" ({count(m['cached_prompt_tokens'])} cached)"
    parts.append(prompt)
    if prefill_rate:
        parts.append(f"prefill {rate(m.get('prefill_tok_s'))}")
    if m.get("kv_transfer_ms") is not None:        # prefilled by another process (disaggregated)
        parts.append(f"KV transfer {size(m.get('kv_transfer_bytes'))} in {ms(m['kv_transfer_ms'])}")
    parts.append(f"{count(m.get('output_tokens'))} tok @ {rate(m.get('decode_tok_s'))}")
    parts.append(f"TPOT {ms(m.get('tpot_ms'))}")
    if m.get("spec_method"):
        drafted = m.get("spec_drafted") or 0
        acc = f"{100 * (m.get('spec_accepted') or 0) / drafted:.0f}%" if drafted else NA
        parts.append(f"spec {acc}")
    if m.get("finish_reason") and m["finish_reason"] not in ("stop",):
        parts.append(str(m["finish_reason"]))
    if m.get("made_with"):
        parts.append(made_with(m["made_with"]))
    return " · ".join(parts)


def made_with(w: dict[str, Any]) -> str:
    """What produced a reply: "model on device", then each toggle that differed from its default."""
    out = [f"{w.get('model') or 'model n/a'} on {w.get('device') or 'n/a'}"]
    for name, value in (w.get("changed") or {}).items():
        try:
            title = settings.get(name).title
        except KeyError:                  # a setting saved by another version of pdchat
            title = name
        out.append(f"{title} {setting_value(value)}")
    return ", ".join(out)


def setting_value(value: Any) -> str:
    """A toggle's value as the panel says it: on, off, or the value."""
    return "off" if value is None or value is False else "on" if value is True else str(value)


def sparkline(values: list[float], width: int) -> str:
    """Unicode bars for the last `width` values, scaled to their max; '' when there are none."""
    vals = [v for v in values if v is not None][-width:]
    if not vals:
        return ""
    top = max(vals) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))] for v in vals)


def bar(fracs: list[float], width: int) -> list[int]:
    """Split `width` cells among fractions (summing to <= 1); returns cell counts."""
    cells = [int(round(f * width)) for f in fracs]
    while sum(cells) > width:
        i = cells.index(max(cells))
        cells[i] -= 1
    return cells
