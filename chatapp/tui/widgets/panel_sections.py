"""The telemetry panel's sections as text: phase, latency, timeline, KV cache, batch, speculative
decoding, device. Pure rendering from (engine stats dict, LiveSnapshot, last metrics) at a given
width; widgets/telemetry.py puts them on screen."""
from __future__ import annotations

from collections import deque

from rich.cells import cell_len
from rich.text import Text

from pdchat.chatapp import format as fmt
from pdchat.chatapp.tui.live import LiveSnapshot
from pdchat.chatapp.tui.machine_busy import MachineBusy

WIDTH = 34           # a section's width before the panel has a size


def row(t: Text, label: str, value: str, style: str = "", width: int = WIDTH) -> None:
    """`label  value`; a value too long for the section's width goes under its label, indented,
    rather than wrapping mid-number."""
    t.append(f"{label:<13}" if 13 + cell_len(value) <= width else f"{label}\n  ", style="dim")
    t.append(value + "\n", style=style)


def phase_text(live: LiveSnapshot | None, last: dict | None, c: dict, w: int) -> Text:
    t = Text()
    if live is None:
        reason = (last or {}).get("finish_reason")
        mark = {"stop": "✓", "length": "✓", "cancelled": "■", "error": "✗"}.get(reason, "·")
        t.append(f"{mark} last reply: {reason}" if reason else "idle", style="dim")
        return t
    p = live.phase
    if p == "queued":
        t.append("○ QUEUED ", style="bold")
        t.append(fmt.ms(live.phase_ms))
    elif p == "prefill":
        t.append("● PREFILL ", style=f"bold {c['prefill']}")
        t.append(f"{fmt.ms(live.phase_ms)}\n")
        # a long forward under way counts its tokens by the layers it ran ("~")
        done = f"~{int(live.prefill_done):,}" if live.layers else f"{live.computed:,}"
        count = f"{done}/{live.total:,} prompt tok"
        t.append(count)
        if live.cached:
            cached = f"({live.cached:,} cached)"
            t.append(" " if cell_len(count + cached) < w else "\n")
            t.append(cached, style=c["cached"])
        t.append("\n")
        total = max(1, live.total)
        cached, done = fmt.bar([live.cached / total, (live.prefill_done - live.cached) / total], w)
        t.append("█" * cached, style=c["cached"])
        t.append("█" * done, style=c["prefill"])
        t.append("░" * (w - cached - done) + "\n", style="dim")
        if live.prefill_tok_s is None and live.prefill_left_ms is not None:
            t.append(f"~{fmt.seconds(live.prefill_left_ms)} left (predicted)", style=c["prefill"])
        elif live.prefill_tok_s is None:
            t.append("measuring the prefill rate…", style="dim")
        else:
            t.append(f"{fmt.rate(live.prefill_tok_s)} · ~{fmt.seconds(live.prefill_left_ms)} left", style=c["prefill"])
        if live.layers:
            t.append(f"\nforward at layer {live.layers_done} of {live.layers}", style="dim")
    elif p == "decode":
        t.append("● DECODE ", style=f"bold {c['decode']}")
        t.append(f"{fmt.rate(live.decode_tok_s)}\n")
        t.append(f"{live.output_tokens:,} tok · TTFT {fmt.ms(live.ttft_ms)}")
    else:
        mark = {"done": "✓ done", "cancelled": "■ cancelled", "error": "✗ error"}.get(p, p)
        t.append(mark, style="bold")
    return t

def latency_text(live: LiveSnapshot | None, last: dict | None, c: dict, w: int) -> Text:
    m = last or {}
    if live is not None and live.metrics is None:
        m = {"ttft_ms": live.ttft_ms, "decode_tok_s": live.decode_tok_s, "itl_ms": live.itl_ms,
             "prefill_tok_s": None, "tpot_ms": (sum(live.itl_ms) / len(live.itl_ms)) if live.itl_ms else None}
    t = Text()
    row(t, "TTFT", fmt.ms(m.get("ttft_ms")), c["prefill"])
    row(t, "prefill", fmt.rate(m.get("prefill_tok_s")), c["prefill"])
    if m.get("cached_prompt_tokens"):      # the rate counts computed tokens only: say how many were not
        row(t, "cached", f"{m['cached_prompt_tokens']:,} of {m.get('prompt_tokens') or 0:,} tok",
             c["cached"], width=w)
    row(t, "decode", fmt.rate(m.get("decode_tok_s")), c["decode"])
    row(t, "TPOT", fmt.ms(m.get("tpot_ms")), c["decode"])
    itl = m.get("itl_ms") or []
    t.append(f"{'ITL':<13}", style="dim")
    t.append((fmt.sparkline(itl, w - 13) or fmt.NA) + "\n", style=c["decode"])
    t.append(f"{'tok/s':<13}", style="dim")
    t.append(fmt.sparkline([1000 / v for v in itl if v], w - 13) or fmt.NA, style=c["decode"])
    return t

def timeline_text(live: LiveSnapshot | None, last: dict | None, c: dict, w: int) -> Text:
    t = Text()
    m = last or {}
    pre = m.get("ttft_ms")
    dec = m.get("decode_ms") or 0.0
    if live is not None and live.metrics is None:
        if live.ttft_ms is None:
            pre, dec = live.phase_ms, 0.0
        else:
            pre, dec = live.ttft_ms, live.phase_ms
    if pre is None:
        t.append(fmt.NA, style="dim")
        return t
    total = max(pre + dec, 1e-9)
    a, b = fmt.bar([pre / total, dec / total], w)
    a = max(a, 1)
    b = min(b, w - a)
    t.append("▇" * a, style=c["prefill"])
    t.append("▇" * b, style=c["decode"])
    t.append("\n")
    pause, stream = f"pause {fmt.ms(pre)}", f"stream {fmt.ms(dec)}"
    t.append(pause, style=c["prefill"])
    t.append(" · " if cell_len(pause + stream) + 3 <= w else "\n")
    t.append(stream, style=c["decode"])
    return t

def kv_text(s: dict, c: dict, w: int, conv_tokens: int) -> Text:
    t = Text()
    total = s.get("kv_blocks_total")
    if not total:
        t.append(fmt.NA, style="dim")
        return t
    used, cached = s.get("kv_blocks_used") or 0, s.get("kv_blocks_cached") or 0
    free = max(0, total - used - cached)
    u, k = fmt.bar([used / total, cached / total], w)
    t.append("█" * u, style=c["kv"])
    t.append("█" * k, style=c["cached"])
    t.append("░" * (w - u - k) + "\n", style="dim")
    t.append(f"{used:,} used", style=c["kv"])
    t.append(" · ")
    t.append(f"{cached:,} cached", style=c["cached"])
    # the free count on a line of its own where the three do not fit the section's width
    counts = f"{used:,} used · {cached:,} cached · {free:,} free"
    t.append(f"\n{free:,} free\n" if len(counts) > w else f" · {free:,} free\n")
    row(t, "memory", f"{fmt.size(s.get('kv_bytes_used'))} / {fmt.size(s.get('kv_bytes_total'))}", width=w)
    bpt = s.get("kv_bytes_per_token")
    row(t, "per token", fmt.size(bpt))
    share = None
    if bpt and s.get("kv_bytes_total") and conv_tokens:
        share = 100 * conv_tokens * bpt / s["kv_bytes_total"]
    row(t, "this chat", f"{conv_tokens:,} tok ({fmt.pct(share) if share is None or share >= 1 else '<1%'})",
         width=w)
    t.append(f"{'hit rate':<13}", style="dim")
    hr = s.get("prefix_hit_rate")
    t.append(fmt.pct(None if hr is None else 100 * hr))
    return t

def batch_text(s: dict) -> Text:
    t = Text()
    row(t, "running", fmt.count(s.get("running")))
    row(t, "waiting", fmt.count(s.get("waiting")))
    t.append(f"{'step':<13}", style="dim")
    t.append(fmt.ms(s.get("step_ms")))
    if s.get("sliced_step_ms") is not None:
        # the last prompt slice beside running streams: what the step budget planned, what it took
        t.append(f"\n{'sliced step':<13}", style="dim")
        t.append(f"{fmt.ms(s['sliced_step_ms'])} (planned {fmt.ms(s.get('sliced_step_planned_ms'))})")
    if (s.get("device") or "").startswith("cuda"):
        t.append(f"\n{'decode':<13}", style="dim")
        t.append(graph_words(s))
    return t


def graph_words(s: dict) -> str:
    """How decode steps launch on a GPU: replayed from a CUDA graph (the last batch's rows in the
    graph's padded size) or op by op."""
    state = s.get("graph_state") or "off"
    if state != "on":
        return f"eager (CUDA graphs {state})"
    rows, size = s.get("graph_rows"), s.get("graph_size")
    if rows is None:
        return "CUDA graphs ready"
    return f"graph, {rows} rows" + (f" in {size}" if size != rows else "")

def spec_text(last: dict | None, caps: dict, toggles: dict) -> Text:
    t = Text()
    if not caps.get("spec"):
        t.append("unavailable", style="dim")
        return t
    method = toggles.get("spec", "off")
    if method == "off":
        t.append("off", style="dim")
        return t
    m = last or {}
    drafted, accepted = m.get("spec_drafted") or 0, m.get("spec_accepted") or 0
    row(t, "method", method)
    row(t, "acceptance", fmt.pct(100 * accepted / drafted if drafted else None))
    # Per verify forward: the drafts it accepted plus the token the target adds, so never more
    # than k + 1. (Output tokens over non-draft tokens overstated it: drafts accepted past a
    # stop or the length limit are counted as accepted but never appended.)
    per_verify = m.get("spec_mean_accepted")
    t.append(f"{'per verify':<13}", style="dim")
    t.append(f"{per_verify + 1:.2f} tok" if per_verify is not None else fmt.NA)
    return t


def memory_rows(t: Text, s: dict, host: bool) -> None:
    """What the memory above holds: the model (its int8 copies included) and the KV pool, and on
    a CPU the rest of the process (activations, buffers, Python, libraries)."""
    model, kv, rss = s.get("model_bytes"), s.get("kv_bytes_total"), s.get("rss_bytes")
    row(t, "  model", fmt.size(model or None))
    row(t, "  KV pool", fmt.size(kv or None))
    if host:
        other = rss - model - kv if rss and model and kv and rss >= model + kv else None
        row(t, "  other", fmt.size(other))


class DeviceSection:
    """The device's use with its recent history, the machine's CPU beside pdchat's own, and the
    machine-busy warning: the one section with state between refreshes."""

    def __init__(self) -> None:
        self.history: deque[float] = deque(maxlen=WIDTH)
        self._sampled_at: float | None = None
        self.machine_busy = MachineBusy()

    def text(self, s: dict, c: dict, w: int, now: float | None, warning: str) -> Text:
        """The device's use and history, then the machine's CPU beside pdchat's own (both % of all
        the machine's CPUs) and a warning when other processes keep the machine busy."""
        t = Text()
        device = s.get("device") or fmt.NA
        gpu = device.startswith("cuda")
        machine, own = s.get("cpu_util_pct"), s.get("process_cpu_pct")
        util = s.get("device_util_pct") if gpu else machine
        # one sample per 0.2 s of the backend's clock (a fake clock that stands still adds none)
        if util is not None and (now is None or self._sampled_at is None or now - self._sampled_at >= 0.2):
            self.history.append(util)
            self._sampled_at = now
        t.append(f"{(s.get('device_name') or device)}\n", style=f"bold {c['gpu']}")
        row(t, "GPU util" if gpu else "machine CPU", fmt.pct(util), c["gpu"])
        spark = fmt.sparkline(list(self.history) + [100.0], w - 13)[:-1] if self.history else ""
        t.append(" " * 13 + (spark or fmt.NA) + "\n", style=c["gpu"])
        if gpu:
            row(t, "memory", f"{fmt.size(s.get('device_mem_used'))} / {fmt.size(s.get('device_mem_total'))}",
                 width=w)
            memory_rows(t, s, host=False)
            p = s.get("device_power_w")
            row(t, "power", fmt.NA if p is None else f"{p:,.0f} W")
            clock = s.get("sm_clock_mhz")
            row(t, "SM clock", fmt.NA if clock is None else f"{clock:,.0f} MHz")
            row(t, "machine CPU", fmt.pct(machine))
        row(t, "pdchat CPU", fmt.NA if own is None else f"{fmt.pct(own)} of machine")
        row(t, "pdchat RSS", fmt.size(s.get("rss_bytes")))
        if not gpu:
            memory_rows(t, s, host=True)
        t.append(f"{'weights/step':<13}", style="dim")
        t.append(fmt.size(s.get("weight_bytes")))
        others = self.machine_busy.update(now, machine, own)
        if others is not None:
            t.append(f"\nmachine busy: others {fmt.pct(others)}\ntimings will be noisy", style=f"bold {warning}")
        return t
