"""The telemetry panel's sections as text: phase, latency, timeline, KV cache, batch, workers
(disaggregated prefill and decode), speculative decoding, device. Pure rendering from (engine
stats dict, LiveSnapshot, last metrics) at a given width; widgets/telemetry.py puts them on screen."""
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
    elif p == "transfer":         # prefilled by the worker process: its K/V cross to the decode side
        t.append("● TRANSFERRING KV ", style=f"bold {c['kv']}")
        t.append(f"{fmt.ms(live.phase_ms)}\n")
        count, origin = f"{live.total:,} prompt tok", "prefilled by the worker"
        t.append(count + (" " if cell_len(count + origin) < w else "\n") + origin, style="dim")
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
    if m.get("kv_transfer_ms") is not None:      # a finished reply whose prompt another process prefilled
        row(t, "KV transfer", fmt.ms(m["kv_transfer_ms"]), c["kv"])
    if m.get("kv_transfer_bytes") is not None:
        row(t, "KV moved", fmt.size(m["kv_transfer_bytes"]), c["kv"])
    row(t, "decode", fmt.rate(m.get("decode_tok_s")), c["decode"])
    row(t, "TPOT", fmt.ms(m.get("tpot_ms")), c["decode"])
    itl = m.get("itl_ms") or []
    t.append(f"{'ITL':<13}", style="dim")
    t.append((fmt.sparkline(itl, w - 13) or fmt.NA) + "\n", style=c["decode"])
    t.append(f"{'tok/s':<13}", style="dim")
    t.append(fmt.sparkline([1000 / v for v in itl if v], w - 13) or fmt.NA, style=c["decode"])
    return t

def timeline_text(live: LiveSnapshot | None, last: dict | None, c: dict, w: int) -> Text:
    """The reply's wait and its stream: pause (TTFT) · stream, or where another process prefilled
    the prompt, pause · transfer (its K/V's hand-off, part of the TTFT) · stream."""
    t = Text()
    parts = _timeline_parts(live, last)
    if parts is None:
        t.append(fmt.NA, style="dim")
        return t
    roles = {"pause": c["prefill"], "transfer": c["kv"], "stream": c["decode"]}
    total = max(sum(v for _, v in parts), 1e-9)
    cells = fmt.bar([v / total for _, v in parts], w)
    for i in range(len(parts) - 1):          # a short pause or hand-off still shows: a cell from the longest
        if cells[i] == 0:
            cells[i] = 1
            if sum(cells) > w:
                cells[cells.index(max(cells))] -= 1
    for (name, _), n in zip(parts, cells):
        t.append("▇" * n, style=roles[name])
    t.append("\n")
    _words_in_lines(t, [(f"{name} {fmt.ms(v)}", roles[name]) for name, v in parts], w)
    return t


def _timeline_parts(live: LiveSnapshot | None, last: dict | None) -> list[tuple[str, float]] | None:
    """(segment, ms) of the reply in flight, or else of the last finished one; None before any."""
    m = last or {}
    pre, transfer, dec = m.get("ttft_ms"), m.get("kv_transfer_ms"), m.get("decode_ms") or 0.0
    if live is not None and live.metrics is None:
        transfer, dec = live.transfer_ms, live.phase_ms if live.ttft_ms is not None else 0.0
        if transfer is not None:
            pre = live.pause_ms
        else:
            pre = live.phase_ms if live.ttft_ms is None else live.ttft_ms
    elif pre is not None and transfer is not None:
        pre = max(0.0, pre - transfer)         # the TTFT holds the hand-off: the pause is the rest
    if pre is None:
        return None
    if transfer is None:
        return [("pause", pre), ("stream", dec)]
    return [("pause", pre), ("transfer", transfer), ("stream", dec)]


def _words_in_lines(t: Text, words: list[tuple[str, str]], w: int) -> None:
    """Styled words joined by " · ", a new line where the next would pass the section's width."""
    used = 0
    for i, (word, style) in enumerate(words):
        if i:
            fits = used + 3 + cell_len(word) <= w
            t.append(" · " if fits else "\n")
            used = used + 3 if fits else 0
        t.append(word, style=style)
        used += cell_len(word)


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


def workers_shown(s: dict) -> bool:
    """The workers section is for a disaggregated engine: on, or its prefill worker not yet gone."""
    return bool(s.get("disaggregate")) or (s.get("prefill_worker") or "off") != "off"


def workers_text(s: dict, c: dict, w: int) -> Text:
    """Disaggregated serving's two sides: the prefill worker (state, prompts sent to it, its
    cores), the decode side (this engine's batch, its cores), the link the K/V cross, and the
    hand-offs so far (count, bytes, the last one's time)."""
    t = Text()
    row(t, "prefill", s.get("prefill_worker") or fmt.NA, c["prefill"], width=w)
    row(t, "  queued", fmt.count(s.get("prefill_queue")))
    row(t, "  cores", s.get("prefill_cores") or fmt.NA, width=w)
    row(t, "decode", f"{fmt.count(s.get('running'))} running", c["decode"], width=w)
    row(t, "  waiting", fmt.count(s.get("waiting")))
    row(t, "  cores", s.get("decode_cores") or fmt.NA, width=w)
    row(t, "link", link_words(s), c["kv"], width=w)
    row(t, "hand-offs", f"{fmt.count(s.get('kv_transfers'))} · {fmt.size(s.get('kv_transferred_bytes'))}", c["kv"],
        width=w)
    # What a remote vLLM or SGLang split exports besides (metrics_parsers.py), where it does.
    for label, key, shown in (("mean", "kv_transfer_mean_ms", fmt.ms), ("speed", "kv_transfer_gbps", _gbps),
                              ("arriving", "kv_transfer_queue", fmt.count)):
        if s.get(key) is not None:
            row(t, label, shown(s[key]), c["kv"], width=w)
    t.append(f"{'last':<13}", style="dim")
    t.append(f"{fmt.size(s.get('last_kv_transfer_bytes'))} in {fmt.ms(s.get('last_kv_transfer_ms'))}", style=c["kv"])
    return t


def _gbps(value: float) -> str:
    return f"{value:.2f} GB/s"


def link_words(s: dict) -> str:
    """How the K/V cross: shm or socket, and the simulated bandwidth and latency where set."""
    words = [s.get("kv_link") or fmt.NA]
    if s.get("kv_link_gbps") is not None:
        words.append(f"{s['kv_link_gbps']:g} GB/s")
    if s.get("kv_link_ms"):
        words.append(f"+{fmt.ms(s['kv_link_ms'])}")
    return " · ".join(words)


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
