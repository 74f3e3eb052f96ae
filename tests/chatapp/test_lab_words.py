"""Every lab verdict reads as words, never as raw keys ("decode edge 1.81", "ttft trend -0.943")."""
from __future__ import annotations

from pdchat.bench import lab_claims as c
from pdchat.chatapp.reporting.lab_words import SENTENCES, in_words

VERDICTS = [
    c.prefill_linear([16, 256, 1024], [40.0, 660.0, 2640.0]),
    c.decode_slow_growth([64, 320, 576], [18.8, 20.1, 21.5]),
    c.prefill_vs_decode(1905.0, 20.0),
    c.int8_memory_bound(2.93, 0.96),
    c.int8_memory_bound(None, None, "no int8 kernel here"),
    c.kv_bytes(30, 3, 64, 4, engine_bytes_per_token=46080, tensor_bytes_per_slot=46080.0, blocks_used=7,
               block_size=16, bytes_used=7 * 16 * 46080, tokens_held=100),
    c.prefix_cache(147.0, 3399.0, 1793, 1760),
    c.batching([1, 4, 16], [50.0, 120.0, 225.0], [20.0, 33.0, 70.0]),
    c.chunked_prefill([16, 32, 1728], [10700.0, 8000.0, 3100.0], [7.2, 10.0, 169.3]),
    c.disaggregation(colocated_gap=3.3, disaggregated_gap=1.1, colocated_ttft_ms=6570.0, disaggregated_ttft_ms=4600.0,
                     transfer_ms=12.0, transfer_bytes=79_534_080, slow_ttft_ms=5420.0, slow_transfer_ms=806.0,
                     slow_link_gbps=0.1, slow_link_ms=10.0),
    c.disaggregation(colocated_gap=3.3, disaggregated_gap=1.1, colocated_ttft_ms=4000.0, disaggregated_ttft_ms=4600.0,
                     transfer_ms=12.0, transfer_bytes=79_534_080, slow_ttft_ms=5420.0, slow_transfer_ms=806.0,
                     slow_link_gbps=0.1, slow_link_ms=10.0),
    c.disaggregation(colocated_gap=3.3, disaggregated_gap=1.1, colocated_ttft_ms=6570.0, disaggregated_ttft_ms=4600.0,
                     transfer_ms=None, transfer_bytes=None, slow_ttft_ms=5420.0, slow_transfer_ms=None,
                     slow_link_gbps=0.1, slow_link_ms=10.0),
    c.spec_vs_acceptance([0.2, 0.6], [0.9, 1.4]),
    c.spec_vs_acceptance([0.5], [1.1]),
]


def test_every_claim_has_a_sentence_without_raw_keys():
    assert {v["id"] for v in VERDICTS} == set(SENTENCES)
    for v in VERDICTS:
        words = in_words(v)
        assert words and "_" not in words, words
        assert "trend" not in words and "edge" not in words, words


def test_every_rule_reads_as_words_not_as_a_formula():
    for v in VERDICTS:
        rule = v["rule"]
        assert not any(sign in rule for sign in ("<=", ">=", "==", "R²", "rank correlation", "_")), rule
    rules = {v["id"]: v["rule"] for v in VERDICTS}
    assert rules["prefill_vs_decode"] == "a 1,000-token prefill takes as long as 5 to 10 decode tokens"
    assert rules["int8_memory_bound"] == "int8 makes decode faster, and decode gains at least 1.25× as much as prefill"


def test_the_sentences_carry_the_numbers():
    words: dict[str, str] = {}
    for v in VERDICTS:
        words.setdefault(v["id"], in_words(v))
    assert words["int8_memory_bound"] == "int8 makes decode 2.93× as fast and prefill 0.96×: decode gains 3.05× as much"
    assert words["prefill_vs_decode"] == ("a 1,000-token prefill (1,905 ms) takes as long as 95 decode tokens "
                                          "(20 ms each)")
    assert "newcomer's TTFT steadily falls (10,700 ms → 3,100 ms)" in words["chunked_prefill"]
    assert "worst stall steadily rises (7.2× → 169.3× their TPOT)" in words["chunked_prefill"]
    lead, slower_anyway, unmeasured = (in_words(v) for v in VERDICTS if v["id"] == "disaggregation")
    assert lead == (
        "disaggregated, the stream's worst gap is 1.1× its TPOT (colocated, chunked: 3.3×); the newcomer's TTFT is "
        "4,600 ms (colocated, chunked: 6,570 ms), its 75.8 MB of K/V handed over in 12 ms; over a 0.1 GB/s, 10 ms "
        "link the hand-off takes 794 ms longer and the TTFT changes by +820 ms; below 0.04 GB/s the hand-off alone "
        "would cost the newcomer more than colocated slices")
    assert slower_anyway.endswith("; even without the hand-off the newcomer waits longer than colocated")
    assert unmeasured == "no K/V hand-off was measured"
    assert in_words(VERDICTS[-1]) == "fewer than two measured points"
    assert in_words(VERDICTS[4]) == "no int8 kernel here"


def test_a_claim_saved_by_another_version_falls_back_to_named_numbers():
    assert in_words({"id": "future_claim", "numbers": {"odd_ratio": 1.5}}) == "odd ratio 1.5"
    assert in_words({"id": "batching", "numbers": {"largest_batch": 4}}) == "largest batch 4"


def test_the_table_gives_each_verdict_its_sentence_rule_and_noise_note():
    import io

    from rich.console import Console

    from pdchat.chatapp.reporting.lab_report import verdict_table
    noisy = dict(VERDICTS[2], noisy="noisy: repeated rounds disagree by 40%")
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(verdict_table([noisy]))
    row = next(line for line in console.export_text().splitlines() if "1,000-token prompt" in line)
    assert ("a 1,000-token prefill (1,905 ms) takes as long as 95 decode tokens (20 ms each)  "
            "noisy: repeated rounds disagree by 40%  "
            "(confirmed when a 1,000-token prefill takes as long as 5 to 10 decode tokens)") in row
    assert "not confirmed" in row
