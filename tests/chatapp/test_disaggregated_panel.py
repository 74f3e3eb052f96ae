"""Disaggregated prefill/decode in the chat app: the reply's "transfer" phase (live state and the
phase line), the finished reply's KV transfer rows, the timeline's third segment, the Workers
section, the toggle applied through the panel, the palette and the local engine (a remote one cannot),
and the A/B table's row."""
from __future__ import annotations

import pytest
from rich.text import Text

from pdchat.chatapp.backends.base import Done, Phase, Settings, Token
from pdchat.chatapp.backends.local import LocalBackend
from pdchat.chatapp.backends.remote import RemoteBackend
from pdchat.chatapp.tui.live import LiveReply
from pdchat.chatapp.tui.palette import palette_commands
from pdchat.chatapp.tui.screens.compare import ab_rows
from pdchat.chatapp.tui.widgets import panel_sections as sections
from pdchat.engine import settings
from pdchat.themes.palette import DEFAULT_ROLES
from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for
from .loopback import MODEL, wait_until

C = DEFAULT_ROLES
W = 30
FINISHED = {"ttft_ms": 30.0, "kv_transfer_ms": 10.0, "kv_transfer_bytes": 138240, "decode_ms": 60.0,
            "prefill_tok_s": 500.0, "decode_tok_s": 40.0, "tpot_ms": 25.0, "itl_ms": [25.0]}
WORKERS = {"disaggregate": True, "prefill_worker": "busy", "prefill_queue": 2, "prefill_cores": "0,1",
           "decode_cores": "2,3", "running": 3, "waiting": 1, "kv_link": "socket", "kv_link_gbps": 2.5,
           "kv_link_ms": 5.0, "kv_transfers": 7, "kv_transferred_bytes": 3 * 1024 ** 2,
           "last_kv_transfer_bytes": 512 * 1024, "last_kv_transfer_ms": 12.5}


def styled(t: Text) -> list[tuple[str, str]]:
    """The text's runs with their style, in order."""
    return [(t.plain[s.start:s.end], str(s.style)) for s in sorted(t.spans, key=lambda s: s.start)]


def rows(t: Text) -> dict[str, str]:
    """A section's `label  value` rows by label."""
    return {line[:13].rstrip(): line[13:] for line in t.plain.split("\n")}


# ---- the live reply ----------------------------------------------------------------------------
def fed(now: float, *events) -> LiveReply:
    live = LiveReply(1, 1, now=lambda: now)
    for ev in events:
        live.feed(ev)
    return live


QUEUED, PREFILL = Phase("queued", 0, 100, 0, 10.0), Phase("prefill", 0, 100, 0, 10.001)
TRANSFER = Phase("transfer", 99, 100, 0, 10.050)


def test_live_reply_knows_the_transfer_phase_and_its_times():
    snap = fed(10.055, QUEUED, PREFILL, TRANSFER).snapshot()
    assert (snap.phase, snap.computed, snap.total) == ("transfer", 99, 100)
    assert snap.phase_ms == pytest.approx(5.0) and snap.transfer_ms == pytest.approx(5.0)
    assert snap.pause_ms == pytest.approx(50.0)                    # queue and prefill, before the hand-off
    assert snap.prefill_tok_s is None and snap.prefill_left_ms is None


def test_after_the_first_token_the_transfer_is_fixed_and_the_pause_is_the_rest_of_the_ttft():
    snap = fed(10.2, QUEUED, PREFILL, TRANSFER, Phase("decode", 100, 100, 0, 10.060),
               Token("a", 10.061, 0), Token("b", 10.071, 1)).snapshot()
    assert snap.phase == "decode" and snap.ttft_ms == pytest.approx(61.0)
    assert snap.transfer_ms == pytest.approx(10.0) and snap.pause_ms == pytest.approx(51.0)


def test_the_hand_off_ends_when_the_engine_computes_the_last_prompt_token():
    """The engine's events: the worker's prefill, the transfer, then "prefill" again once the K/V
    are in the pool (the last prompt token is computed here): the transfer is that span alone,
    as the finished reply's kv_transfer_ms, not the span up to the first token."""
    last = Phase("prefill", 99, 100, 0, 10.064)
    snap = fed(10.07, QUEUED, PREFILL, TRANSFER, last).snapshot()
    assert snap.phase == "prefill" and snap.transfer_ms == pytest.approx(14.0)
    snap = fed(10.2, QUEUED, PREFILL, TRANSFER, last, Token("a", 10.110, 0)).snapshot()
    assert snap.transfer_ms == pytest.approx(14.0) and snap.pause_ms == pytest.approx(110.0 - 14.0)


def test_a_reply_prefilled_here_has_no_transfer_times():
    snap = fed(10.2, QUEUED, PREFILL, Token("a", 10.1, 0), Done("a", "stop")).snapshot()
    assert snap.transfer_ms is None and snap.pause_ms is None


# ---- the sections --------------------------------------------------------------------------------
def test_phase_line_says_the_kv_is_crossing():
    snap = fed(10.0536, QUEUED, PREFILL, TRANSFER).snapshot()
    t = sections.phase_text(snap, None, C, 40)
    assert t.plain == "● TRANSFERRING KV 3.6 ms\n100 prompt tok prefilled by the worker"
    assert styled(t)[0] == ("● TRANSFERRING KV ", f"bold {C['kv']}")
    narrow = sections.phase_text(snap, None, C, W)          # where both do not fit, a line each
    assert narrow.plain.split("\n")[1:] == ["100 prompt tok", "prefilled by the worker"]


def test_finished_reply_shows_kv_transfer_rows_only_when_there_was_one():
    r = rows(sections.latency_text(None, FINISHED, C, W))
    assert (r["KV transfer"], r["KV moved"]) == ("10 ms", "135.0 KB")
    colocated = {k: v for k, v in FINISHED.items() if not k.startswith("kv_")}
    assert "KV" not in sections.latency_text(None, colocated, C, W).plain
    assert "KV" not in sections.latency_text(None, {**colocated, "kv_transfer_ms": None}, C, W).plain


def test_timeline_has_pause_transfer_and_stream():
    t = sections.timeline_text(None, FINISHED, C, W)
    # the TTFT (30 ms) holds the hand-off (10 ms): pause 20, transfer 10, stream 60 of 90 ms, in 30 cells
    assert styled(t)[:3] == [("▇" * 7, C["prefill"]), ("▇" * 3, C["kv"]), ("▇" * 20, C["decode"])]
    assert t.plain.split("\n")[1:] == ["pause 20 ms · transfer 10 ms", "stream 60 ms"]


def test_a_short_transfer_still_gets_a_cell_and_the_bar_keeps_its_width():
    t = sections.timeline_text(None, {**FINISHED, "ttft_ms": 1000.1, "kv_transfer_ms": 0.1}, C, W)
    bar = t.plain.split("\n")[0]
    # 1000 + 0.1 + 60 ms: 28, 0 and 2 cells; the hand-off's cell comes from the longest segment
    assert len(bar) == W and [s for s, _ in styled(t)[:3]] == ["▇" * 27, "▇", "▇▇"]


def test_timeline_without_a_transfer_keeps_two_segments():
    t = sections.timeline_text(None, {"ttft_ms": 30.0, "decode_ms": 60.0}, C, W)
    assert t.plain.split("\n")[1] == "pause 30 ms · stream 60 ms"
    assert [style for _, style in styled(t)[:2]] == [C["prefill"], C["decode"]]


def test_live_timeline_during_the_transfer():
    snap = fed(10.08, QUEUED, PREFILL, TRANSFER).snapshot()
    t = sections.timeline_text(snap, None, C, W)
    assert t.plain.split("\n")[1:] == ["pause 50 ms · transfer 30 ms", "stream 0.0 ms"]


def test_workers_section_shows_both_sides_the_link_and_the_hand_offs():
    assert not sections.workers_shown({}) and not sections.workers_shown({"prefill_worker": None})
    assert not sections.workers_shown({"disaggregate": False, "prefill_worker": "off"})
    assert sections.workers_shown(WORKERS)
    assert sections.workers_shown({"disaggregate": False, "prefill_worker": "busy"})   # still stopping
    assert sections.workers_text(WORKERS, C, 40).plain.split("\n") == [
        "prefill      busy", "  queued     2", "  cores      0,1",
        "decode       3 running", "  waiting    1", "  cores      2,3",
        "link         socket · 2.5 GB/s · +5.0 ms", "hand-offs    7 · 3.0 MB", "last         512.0 KB in 12 ms"]
    # a link too long for a narrow section goes under its label, as every row's value
    assert "\nlink\n  socket · 2.5 GB/s · +5.0 ms\n" in sections.workers_text(WORKERS, C, W).plain
    plain = {**WORKERS, "kv_link": "shm", "kv_link_gbps": None, "kv_link_ms": 0.0, "last_kv_transfer_bytes": None,
             "last_kv_transfer_ms": None}
    r = rows(sections.workers_text(plain, C, 40))
    assert (r["link"], r["last"]) == ("shm", "n/a in n/a")


def test_ab_table_has_a_kv_transfer_row_only_when_a_reply_had_one():
    a = {"ttft_ms": 100.0, "made_with": {}}
    b = {"ttft_ms": 80.0, "kv_transfer_ms": 5.0, "made_with": {}}
    assert {r[0]: r[1:] for r in ab_rows(a, b)}["KV transfer"] == ("n/a", "5.0 ms", "")
    assert "KV transfer" not in {r[0] for r in ab_rows(a, a)}


# ---- the app ----------------------------------------------------------------------------------
def section(app, name: str) -> str:
    return str(app.chat.query_one(f"#tm-{name}").render())


@pytest.mark.anyio
async def test_the_toggle_shows_the_workers_and_a_reply_crosses_in_the_panel(make_app):
    app = make_app(FakeBackend(hold="transfer"))
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        workers = app.chat.query_one("#tm-workers")
        assert not workers.display
        assert await app.apply_toggles({"disaggregate": True})
        assert app.backend.toggles["disaggregate"] is True and workers.display
        assert rows(Text(section(app, "workers")))["prefill"] == "idle"
        await send(pilot, "hello")
        await wait_for(pilot, app.backend.held.is_set)
        await wait_for(pilot, lambda: "TRANSFERRING KV" in section(app, "phase"))
        assert "prefill      busy\n  queued     1\n" in section(app, "workers")
        assert "transfer 0.0 ms" in section(app, "timeline")
        app.backend.release()
        await idle(pilot)
        m = app.store.messages(app.chat.conv_id)[-1].metrics         # saved and read back
        assert (m["kv_transfer_bytes"], m["kv_transfer_ms"]) == (15 * 9216, 4.0)
        latency = rows(Text(section(app, "latency")))
        assert (latency["KV transfer"], latency["KV moved"]) == ("4.0 ms", "135.0 KB")
        assert "transfer 4.0 ms" in section(app, "timeline")
        assert "hand-offs    1 · 135.0 KB" in section(app, "workers")
        assert "KV transfer 135.0 KB in 4.0 ms" in str(app.chat.query(".message-summary").last().render())
        assert await app.apply_toggles({"disaggregate": False})
        assert not workers.display


@pytest.mark.anyio
async def test_the_palette_flips_disaggregation(make_app):
    app = make_app(FakeBackend())
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        [cmd] = [c for c in palette_commands(app) if c.title == "Toggle disaggregate"]
        assert cmd.help == settings.get("disaggregate").help
        await cmd.callback()
        assert app.backend.updates == [{"disaggregate": True}] and app.toggles.disaggregate is True


@pytest.mark.anyio
async def test_a_remote_backend_cannot_disaggregate_and_says_so(make_app):
    remote = RemoteBackend("http://127.0.0.1:9")
    caps = remote.capabilities
    remote.close()
    assert caps["disaggregate"] is False
    app = make_app(FakeBackend(capabilities=caps))                  # what the app gets from a remote one
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        [cmd] = [c for c in palette_commands(app) if c.title == "Toggle disaggregate"]
        assert cmd.help.endswith("(unavailable in this engine)")
        assert not await app.apply_toggles({"disaggregate": True})
        assert app.backend.updates == [] and app.toggles.disaggregate is False
        await pilot.pause(0.2)
        assert [n.message for n in app._notifications] == ["disaggregate is unavailable in this engine."]


# ---- the local engine ---------------------------------------------------------------------------
def test_local_backend_turns_disaggregation_on_at_run_time_and_streams_the_transfer():
    backend = LocalBackend(model=MODEL, device="cpu", telemetry=False, kv_link_ms=5.0)
    backend.load(lambda line: None)
    try:
        assert backend.capabilities["disaggregate"] and backend.stats()["prefill_worker"] == "off"
        backend.update(disaggregate=True)
        wait_until(lambda: backend.stats()["prefill_worker"] == "idle", timeout=120, what="the prefill worker")
        events = list(backend.stream([{"role": "user", "content": "hello " * 40}],
                                     Settings(max_tokens=4, temperature=0)))
        phases = [e for e in events if isinstance(e, Phase)]
        kinds = [p.phase for p in phases]
        assert kinds.count("transfer") == 1
        i = kinds.index("transfer")
        # the worker's prefill, the hand-off, then the last prompt token here (a "prefill" again),
        # then the first token; the events' clock is the metrics' (the live timeline measures it)
        assert "prefill" in kinds[:i] and kinds[i + 1] == "prefill"
        transfer, after = phases[i], phases[i + 1]
        first_token = next(e for e in events if isinstance(e, Token))
        assert phases[i - 1].t <= transfer.t <= after.t <= first_token.t
        done = events[-1]
        assert done.metrics["kv_transfer_ms"] >= 5.0 and done.metrics["kv_transfer_bytes"] > 0
        assert (after.t - transfer.t) * 1000 == pytest.approx(done.metrics["kv_transfer_ms"], abs=0.01)
        s = backend.stats()
        assert (s["kv_link_ms"], s["kv_link_gbps"], s["kv_transfers"]) == (5.0, None, 1)
        assert s["kv_transferred_bytes"] == s["last_kv_transfer_bytes"] == done.metrics["kv_transfer_bytes"]
        assert s["last_kv_transfer_ms"] == pytest.approx(done.metrics["kv_transfer_ms"])
        backend.update(disaggregate=False)
        assert backend.stats()["prefill_worker"] == "off"
    finally:
        backend.close()


def test_workers_section_shows_what_a_remote_split_exports():
    remote = {"disaggregate": 1, "running": 5, "kv_transfer_gbps": 12.25, "kv_transfer_queue": 2,
              "last_kv_transfer_ms": 7.5}
    assert sections.workers_shown(remote)
    r = rows(sections.workers_text(remote, C, 40))
    assert (r["prefill"], r["speed"], r["arriving"], r["last"]) == ("n/a", "12.25 GB/s", "2", "n/a in 7.5 ms")
    assert "mean" not in r and "mean" not in rows(sections.workers_text(WORKERS, C, 40))
