"""Each lab verdict's numbers in plain words ("decode gains 2.93x from int8, prefill 0.96x"), for
the terminal report and the Lab screen; the raw numbers stay in lab.json under their keys."""
from __future__ import annotations

from typing import Any, Callable

from pdchat.chatapp.format import size

NA = "n/a"


def _x(v: float | None) -> str:
    return NA if v is None else f"{v:.2f}×"


def _ms(v: float | None) -> str:
    return NA if v is None else f"{v:,.0f} ms" if abs(v) >= 10 else f"{v:.1f} ms"


def _delta_ms(v: float) -> str:
    return f"{v:+,.0f} ms" if abs(v) >= 10 else f"{v:+.1f} ms"


def _pct(v: float | None) -> str:
    return NA if v is None else f"{v:+.0%}"


def _direction(corr: float | None) -> str:
    """A rank correlation as words: how steadily y follows x."""
    if corr is None:
        return "no clear direction"
    strength = "steadily" if abs(corr) >= 0.8 else "mostly" if abs(corr) >= 0.4 else "barely"
    return f"{strength} {'rises' if corr > 0 else 'falls'}"


def _prefill_linear(n: dict[str, Any]) -> str:
    return (f"{n['ms_per_token']:.2f} ms per prompt token (≈{n['tokens_per_s'] or 0:,.0f} tok/s); a straight "
            f"line explains {n['r2']:.0%} of the {n['points']} lengths' spread")


def _decode_growth(n: dict[str, Any]) -> str:
    return (f"{_ms(n['tpot_at_start_ms'])} a token at position {n['first_position']:,}, "
            f"{_ms(n['tpot_at_end_ms'])} at {n['last_position']:,} ({_pct(n['growth'])})")


def _prefill_vs_decode(n: dict[str, Any]) -> str:
    return (f"a 1,000-token prefill ({_ms(n['prefill_1000_ms'])}) takes as long as "
            f"{n['decode_tokens_equivalent']:.0f} decode tokens ({_ms(n['tpot_ms'])} each)")


def _int8(n: dict[str, Any]) -> str:
    if "decode_speedup" not in n:
        return n.get("reason", NA)
    return (f"int8 makes decode {_x(n['decode_speedup'])} as fast and prefill {_x(n['prefill_speedup'])}: "
            f"decode gains {_x(n['decode_edge'])} as much")


def _kv(n: dict[str, Any]) -> str:
    return (f"2 × {n['layers']} layers × {n['kv_heads']} KV heads × {n['head_dim']} × {n['dtype_bytes']} bytes = "
            f"{n['formula_bytes_per_token']:,} bytes a token; the engine says {n['engine_bytes_per_token']:,}; "
            f"{n['tokens_held']:,} tokens held {n['blocks_used']} blocks of {n['block_size']}")


def _prefix(n: dict[str, Any]) -> str:
    return (f"TTFT {_ms(n['ttft_on_ms'])} with the cache vs {_ms(n['ttft_off_ms'])} without ({_x(n['ttft_ratio'])}); "
            f"{n['cached_prompt_tokens']:,} of {n['prompt_tokens']:,} prompt tokens came from it")


def _batching(n: dict[str, Any]) -> str:
    return (f"{n['largest_batch']} at once: {_x(n['throughput_gain'])} the tokens a second of one, each user's "
            f"TPOT {_x(n['tpot_rise'])}; throughput {_direction(n['throughput_trend'])} with the batch")


def _chunked(n: dict[str, Any]) -> str:
    return (f"as chunks grow, the newcomer's TTFT {_direction(n['ttft_trend'])} "
            f"({_ms(n['smallest_chunk_ttft_ms'])} → {_ms(n['largest_chunk_ttft_ms'])}) and the others' worst "
            f"stall {_direction(n['stall_trend'])} ({n['smallest_chunk_stall']:.1f}× → "
            f"{n['largest_chunk_stall']:.1f}× their TPOT)")


def _disaggregation(n: dict[str, Any]) -> str:
    if "transfer_ms" not in n:
        return n.get("reason", NA)
    be = n["break_even_gbps"]
    cost = (f"below {be:.2g} GB/s the hand-off alone would cost the newcomer more than colocated slices"
            if be is not None else "even without the hand-off the newcomer waits longer than colocated")
    return (f"disaggregated, the stream's worst gap is {n['disaggregated_gap_over_tpot']:.1f}× its TPOT "
            f"(colocated, chunked: {n['colocated_gap_over_tpot']:.1f}×); the newcomer's TTFT is "
            f"{_ms(n['disaggregated_ttft_ms'])} (colocated, chunked: {_ms(n['colocated_ttft_ms'])}), its "
            f"{size(n['transfer_bytes'])} of K/V handed over in {_ms(n['transfer_ms'])}; over a "
            f"{n['slow_link_gbps']:g} GB/s, {n['slow_link_ms']:g} ms link the hand-off takes "
            f"{_ms(n['transfer_rise_ms'])} longer and the TTFT changes by {_delta_ms(n['ttft_rise_ms'])}; {cost}")


def _spec(n: dict[str, Any]) -> str:
    if "trend" not in n:
        return n.get("reason", NA)
    return (f"over {n['points']} measured points the speed-up {_direction(n['trend'])} with acceptance; "
            f"best {_x(n['best_speedup'])}")


SENTENCES: dict[str, Callable[[dict[str, Any]], str]] = {
    "prefill_linear": _prefill_linear, "decode_slow_growth": _decode_growth, "prefill_vs_decode": _prefill_vs_decode,
    "int8_memory_bound": _int8, "kv_bytes": _kv, "prefix_cache": _prefix, "batching": _batching,
    "chunked_prefill": _chunked, "disaggregation": _disaggregation, "spec": _spec,
}


def number(value: Any) -> str:
    if value is None:
        return NA
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def numbers_line(numbers: dict[str, Any]) -> str:
    """Numbers by name, for a claim this version has no sentence for."""
    return ", ".join(f"{k.replace('_', ' ')} {number(v)}" for k, v in numbers.items())


def in_words(claim: dict[str, Any]) -> str:
    """The verdict's numbers as a sentence (a claim unknown here: its numbers by name)."""
    sentence = SENTENCES.get(claim.get("id", ""))
    numbers = claim.get("numbers", {})
    try:
        return sentence(numbers) if sentence else numbers_line(numbers)
    except (KeyError, TypeError, ValueError):      # a result saved by another version of pdchat
        return numbers_line(numbers)
