"""Compare works for any toggle: the chooser lists every other value of every engine toggle the
backend has, the compared reply runs with it and the toggles go back after; F6 shows the last two
replies side by side."""
from __future__ import annotations

import pytest

from pdchat.chatapp.tui.screens.compare import ABTable, CompareChooser, ab_rows, compare_choices
from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

TOGGLES = {"kv_cache": True, "prefix_cache": True, "chunk_size": "auto", "quant": "none", "spec": "off",
           "neighbours": 0}
ALL = {"kv_cache": True, "prefix_cache": True, "chunk_size": True, "quant": True, "spec": True}


def test_choices_cover_every_other_value_of_the_available_toggles():
    labels = [label for label, _ in compare_choices(TOGGLES, ALL)]
    assert labels == ["KV cache: on → off", "prefix cache: on → off", "prefill chunk: auto → off",
                      "quantization: none → int8", "quantization: none → int4", "speculative: off → ngram",
                      "speculative: off → draft"]
    changes = [c for _, c in compare_choices({**TOGGLES, "chunk_size": None, "kv_cache": False}, ALL)]
    assert {"chunk_size": "auto"} in changes and {"kv_cache": True} in changes
    assert all("quant" not in c for _, c in compare_choices(TOGGLES, {**ALL, "quant": False}))


def test_ab_rows_give_both_values_and_which_way_is_better():
    a = {"ttft_ms": 1000.0, "prefill_tok_s": 100.0, "decode_tok_s": 40.0, "tpot_ms": 25.0, "prompt_tokens": 500,
         "cached_prompt_tokens": 0, "output_tokens": 20, "made_with": {"model": "m", "device": "cpu", "changed": {}}}
    b = {**a, "ttft_ms": 100.0, "cached_prompt_tokens": 480, "decode_tok_s": 40.5, "spec_acceptance": 0.5,
         "made_with": {"model": "m", "device": "cpu", "changed": {"kv_cache": False}}}
    rows = {r[0]: r[1:] for r in ab_rows(a, b)}
    assert rows["made with"] == ("m on cpu", "m on cpu, KV cache off", "")
    assert rows["TTFT"] == ("1,000 ms", "100 ms", "0.10× better")
    assert rows["decode"] == ("40.0 tok/s", "40.5 tok/s", "1.01×")          # within 5%: no verdict
    assert rows["cached tokens"] == ("0", "480", "")
    assert rows["acceptance"] == ("n/a", "50%", "")


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_compare_runs_the_chosen_toggle_once_and_f6_shows_both(make_app, size):
    app = make_app(FakeBackend())
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await send(pilot, "a question")
        await idle(pilot)
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareChooser))
        labels = [label for label, _ in app.screen.choices]
        await pilot.press(*["down"] * labels.index("KV cache: on → off"), "enter")
        await wait_for(pilot, lambda: len(app.backend.requests) == 2)
        await idle(pilot)
        assert app.backend.updates[:2] == [{"kv_cache": False}, {"kv_cache": True}]    # put back after
        assert app.toggles.kv_cache is True
        replies = [m for m in app.store.messages(app.chat.conv_id) if m.role == "assistant"]
        assert replies[-1].metrics["made_with"]["changed"] == {"kv_cache": False}
        assert app.backend.requests[1][0] == app.backend.requests[0][0]     # the same prompt again
        await pilot.press("f6")
        await wait_for(pilot, lambda: isinstance(app.screen, ABTable))
        table = app.screen.query_one("#ab-table")
        assert table.region.width > 0 and table.region.bottom <= size[1]
        text = "\n".join(" ".join(str(c) for c in r) for r in ab_rows(app.screen.a, app.screen.b))
        assert "KV cache off" in text and "TPOT" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, ABTable)


async def test_f6_with_one_reply_explains_what_it_needs(make_app):
    app = make_app(FakeBackend())
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await send(pilot, "a question")
        await idle(pilot)
        await pilot.press("f6")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, ABTable)
        assert any("two finished replies" in n.message for n in app._notifications)
