"""Pilot tests with the scripted FakeBackend: every chat action, checked through UI and store."""
from __future__ import annotations

import pytest

from tests.doubles.fake_backend import FakeBackend
from pdchat.chatapp.tui.screens import replies as replies_module
from pdchat.chatapp.tui.store import Store
from pdchat.chatapp.tui.widgets.messages import MessageView
from pdchat.chatapp.tui.widgets.toggles import TogglesBox

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

SIZE = (160, 48)


def views(app):
    return [(v.role, v.status, v.content) for v in app.chat.query(MessageView)]


def panel_text(app, section: str) -> str:
    return str(app.chat.query_one(f"#tm-{section}").render())


async def test_send_streams_reply_with_summary_and_saves_it(make_app):
    app = make_app(FakeBackend(replies=["Hello **world**.\n\n```py\nx = 1\n```"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi there")
        await idle(pilot)
        assert views(app) == [("user", "done", "hi there"),
                              ("assistant", "done", "Hello **world**.\n\n```py\nx = 1\n```")]
        reply = list(app.chat.query(MessageView))[-1]
        summary = str(reply.query_one(".message-summary").render())
        # fake clock: 20 prompt tokens at 0.5 ms + 2 ms queue; 32 ms per token after the first
        assert summary == "TTFT 12 ms · 20 prompt tok · 7 tok @ 31.2 tok/s · TPOT 32 ms · fake-model on cpu"
        assert app.chat.query_one("#input").text == ""
        msgs = app.store.messages(app.chat.conv_id)
        assert [m.role for m in msgs] == ["user", "assistant"]
        assert msgs[1].metrics["output_tokens"] == 7 and msgs[1].status == "done"
        assert app.store.conversation(app.chat.conv_id).title == "hi there"
        await pilot.pause(0.3)
        assert "31.2 tok/s" in panel_text(app, "latency")


async def test_ctrl_j_inserts_newline_instead_of_sending(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        box = app.chat.query_one("#input")
        box.focus()
        await pilot.press("a", "ctrl+j", "b")
        assert box.text == "a\nb"
        assert app.backend.requests == []


async def test_cancel_keeps_partial_reply_marked_cancelled(make_app):
    backend = FakeBackend(hold="decode:3", replies=["one two three four five six"])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "count")
        await wait_for(pilot, backend.held.is_set)
        await pilot.pause(0.2)
        assert "DECODE" in panel_text(app, "phase")
        await pilot.press("escape")
        await idle(pilot)
        assert views(app)[-1] == ("assistant", "cancelled", "one two three")
        msg = app.store.messages(app.chat.conv_id)[-1]
        assert (msg.status, msg.content, msg.metrics["finish_reason"]) == ("cancelled", "one two three", "cancelled")
        header = str(list(app.chat.query(MessageView))[-1].query_one(".message-header").render())
        assert "cancelled" in header


async def test_quitting_mid_reply_saves_the_partial_text(make_app, monkeypatch):
    monkeypatch.setattr(replies_module, "SAVE_S", float("inf"))   # no periodic saves: only the exit path writes
    backend = FakeBackend(hold="decode:3", replies=["one two three four five six"])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "count")
        await wait_for(pilot, backend.held.is_set)
        conv = app.chat.conv_id
        await pilot.press("ctrl+q")
    assert backend.generations[-1].cancelled.is_set()
    msg = app.store.messages(conv)[-1]
    assert (msg.role, msg.content, msg.status) == ("assistant", "one two three", "interrupted")


async def test_regenerate_replaces_last_reply(make_app):
    backend = FakeBackend(replies=["first answer", "second answer"])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "question")
        await idle(pilot)
        await pilot.press("ctrl+r")
        await idle(pilot)
        assert views(app) == [("user", "done", "question"), ("assistant", "done", "second answer")]
        assert [m.content for m in app.store.messages(app.chat.conv_id)] == ["question", "second answer"]
        assert backend.requests[1][0] == [{"role": "user", "content": "question"}]


async def test_edit_last_message_and_resend(make_app):
    backend = FakeBackend(replies=["a1", "a2", "a3"])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        await idle(pilot)
        await send(pilot, "secnod")
        await idle(pilot)
        await pilot.press("ctrl+e")
        box = app.chat.query_one("#input")
        assert box.text == "secnod"
        box.text = "second"
        await pilot.press("enter")
        await idle(pilot)
        assert [c for _, _, c in views(app)] == ["first", "a1", "second", "a3"]
        assert backend.requests[-1][0] == [{"role": "user", "content": "first"},
                                           {"role": "assistant", "content": "a1"},
                                           {"role": "user", "content": "second"}]


async def test_copy_message_and_code_block(make_app):
    reply = "Use this:\n\n```python\nprint(1)\n```\n\nand this:\n\n```sh\nls -la\n```"
    app = make_app(FakeBackend(replies=[reply]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "code please")
        await idle(pilot)
        await pilot.press("ctrl+y")
        await pilot.press("ctrl+o")
        assert app.clipboard_calls == [reply, "ls -la"]
        list(app.chat.query(MessageView))[0].focus()      # the user's message
        await pilot.press("ctrl+y")
        assert app.clipboard_calls[-1] == "code please"


async def test_export_writes_markdown(make_app, tmp_path):
    app = make_app(FakeBackend(replies=["The answer is **42**."]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is the answer?")
        await idle(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        path = app.chat.last_export
        assert path.parent == tmp_path / "exports"
        text = path.read_text()
        assert text.startswith("# What is the answer?\n")
        assert "## You\n\nWhat is the answer?\n" in text
        assert "## Assistant\n\nThe answer is **42**.\n" in text
        assert "*TTFT " in text and "4 tok @ 31.2 tok/s" in text


async def test_toggles_call_backend_update(make_app):
    backend = FakeBackend()
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.chat.query_one(TogglesBox).display
        await pilot.click("#tg-prefix_cache")
        await pilot.click("#tg-kv_cache")
        await pilot.click("#tg-chunk_size-on")
        await pilot.pause()
        assert backend.updates == [{"prefix_cache": False}, {"kv_cache": False}, {"chunk_size": None}]
        assert app.store.get_setting("toggles")["prefix_cache"] is False
        # the next reply feels it: KV cache off makes each fake token 4x slower
        await send(pilot, "hello")
        await idle(pilot)
        assert app.store.messages(app.chat.conv_id)[-1].metrics["tpot_ms"] == pytest.approx(128.0)
        await pilot.click("#tg-chunk_size-on")
        await pilot.pause()
        assert backend.updates[-1] == {"chunk_size": "auto"}


async def test_unavailable_feature_is_shown_and_refused(make_app):
    backend = FakeBackend(capabilities={"spec": False, "quant": False})
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.pause(0.3)
        assert "unavailable" in panel_text(app, "spec")
        assert app.chat.query_one("#tg-spec").disabled
        assert not await app.apply_toggles({"spec": "ngram"})
        assert backend.updates == [] and app.toggles.spec == "off"


async def test_a_toggle_the_engine_turns_off_itself_follows_with_its_reason(make_app):
    backend = FakeBackend()
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert await app.apply_toggles({"spec": "draft"})
        await pilot.pause()                                          # the toggle box has shown it
        saved = app.store.get_setting("toggles")
        backend.decide("speculative decoding turned off: self-draft decoded 20.0 tok/s per request against 30.0",
                       spec="off")
        app.chat.refresh_panel()
        await pilot.pause()
        assert app.toggles.spec == "off"
        assert app.chat.query_one("#tg-spec").value == "off"
        assert backend.updates == [{"spec": "draft"}]                 # following sends nothing back
        said = [n.message for n in app._notifications if n.severity == "warning"]
        assert said == ["speculative decoding turned off: self-draft decoded 20.0 tok/s per request against 30.0"]
        assert app.store.get_setting("toggles") == saved            # the user's choice stays saved
        app.chat.refresh_panel()                                     # each notice is told once
        assert len([n for n in app._notifications if n.severity == "warning"]) == 1


async def test_switching_conversations(make_app):
    backend = FakeBackend(replies=["reply A", "reply B"])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "chat A")
        await idle(pilot)
        first = app.chat.conv_id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert views(app) == []
        await send(pilot, "chat B")
        await idle(pilot)
        assert [c for _, _, c in views(app)] == ["chat B", "reply B"]
        await app.chat.open_conversation(first)
        await pilot.pause()
        assert [c for _, _, c in views(app)] == ["chat A", "reply A"]
        titles = [c.title for c in app.store.conversations()]
        assert sorted(titles) == ["chat A", "chat B"]
        app.chat.query_one("#search").value = "chat B"
        await pilot.pause()
        assert len(app.chat.query(".conv-item")) == 1


async def test_engine_error_becomes_notification(make_app):
    app = make_app(FakeBackend(load_error="no such model: nope"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None)
        assert not app.ready
        assert any("no such model" in n.message for n in app._notifications)
        await send(pilot, "hello?")
        await pilot.pause()
        assert app.chat.query_one("#input").text == "hello?"     # kept for later
        assert app.is_running


async def test_restart_restores_history_and_settings(make_app, tmp_path):
    db = tmp_path / "data" / "pdchat.db"
    app = make_app(FakeBackend(replies=["remembered"]), store=Store(db))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "remember me")
        await idle(pilot)
        await app.apply_toggles({"prefix_cache": False})
        app.theme = "pdchat-light"
        await pilot.pause()
    app.store.close()
    app2 = make_app(FakeBackend(), store=Store(db))
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: len(views(app2)) == 2)
        assert [c for _, _, c in views(app2)] == ["remember me", "remembered"]
        assert app2.toggles.prefix_cache is False and app2.theme == "pdchat-light"
        summary = str(list(app2.chat.query(MessageView))[-1].query_one(".message-summary").render())
        assert summary.startswith("TTFT ")


async def test_corrupt_database_is_moved_aside_with_notice(make_app, tmp_path):
    db = tmp_path / "data" / "pdchat.db"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"this is not a database" * 100)
    app = make_app(FakeBackend(), store=Store(db))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert any("moved to pdchat.db.corrupt-" in n.message for n in app._notifications)
        await send(pilot, "fresh start")
        await idle(pilot)
    aside = list(db.parent.glob("pdchat.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not a database")


async def test_gpu_device_panel(make_app):
    app = make_app(FakeBackend(gpu=True))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.pause(0.3)
        text = panel_text(app, "device")
        assert "NVIDIA H100 80GB HBM3" in text and "GPU util     87%" in text
        assert "12.5 GB / 80.0 GB" in text and "312 W" in text and "SM clock     1,980 MHz" in text
        assert "decode       CUDA graphs ready" in panel_text(app, "batch")       # no reply yet
        app2_text = None
    app2 = make_app(FakeBackend(gpu=False))
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.pause(0.3)
        app2_text = panel_text(app2, "device")
        assert "machine CPU  38%" in app2_text and "812.0 MB" in app2_text and "GPU" not in app2_text


class ListingBackend(FakeBackend):
    def models(self) -> list[str]:
        return ["fake-model", "other-model"]


async def test_model_picker_lists_models_and_switches(make_app):
    made = []

    def factory(model: str) -> FakeBackend:
        made.append(model)
        return ListingBackend(model=model)

    app = make_app(ListingBackend(), backend_factory=factory)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await pilot.pause(0.1)
        from textual.widgets import OptionList
        options = app.screen.query_one(OptionList)
        assert [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)] == \
            ["fake-model", "other-model"]
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.ready and app.backend.model == "other-model")
        assert made == ["other-model"] and app.sub_title == "other-model"
        await pilot.press("f4")
        await pilot.pause(0.1)
        app.screen.query_one("#model-input").focus()
        app.screen.query_one("#model-input").value = "random:tiny"
        await pilot.press("enter")
        await wait_for(pilot, lambda: made[-1] == "random:tiny")


async def test_each_reply_records_what_made_it(make_app):
    # The summary line, the database and the export say which model, device and non-default
    # toggles produced a reply: a reply made in naive mode says so even after KV cache is back on.
    backend = FakeBackend(replies=["first", "second"])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await app.apply_toggles({"kv_cache": False, "chunk_size": None}, quiet=True)
        await send(pilot, "one")
        await idle(pilot)
        await app.apply_toggles({"kv_cache": True}, quiet=True)
        await send(pilot, "two")
        await idle(pilot)
        first, second = [m for m in app.store.messages(app.chat.conv_id) if m.role == "assistant"]
        device = backend.stats()["device"]
        assert first.metrics["made_with"] == {"model": backend.model, "device": device,
                                              "changed": {"kv_cache": False, "chunk_size": None}}
        assert second.metrics["made_with"]["changed"] == {"chunk_size": None}
        views = [v for v in app.chat.query(MessageView) if v.role == "assistant"]
        summary = str(views[0].query_one(".message-summary").render())
        assert f"{backend.model} on {device}, KV cache off, prefill chunk off" in summary
        assert "KV cache" not in str(views[1].query_one(".message-summary").render())
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "KV cache off" in app.chat.last_export.read_text()


async def test_new_chat_reuses_an_empty_one(make_app):
    app = make_app(FakeBackend())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert len(app.store.conversations()) == 1
        await send(pilot, "hello")
        await idle(pilot)
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert len(app.store.conversations()) == 2


async def test_the_chat_follows_the_stream_until_the_user_scrolls_up(make_app):
    long_reply = "\n\n".join(f"Paragraph {i} of a long reply." for i in range(40))
    backend = FakeBackend(replies=[long_reply, long_reply], hold="decode:200")
    app = make_app(backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        box = app.chat.query_one("#messages")
        await send(pilot, "tell me")
        await wait_for(pilot, backend.held.is_set)
        await pilot.pause(0.2)
        assert box.max_scroll_y > 0 and box.scroll_y == box.max_scroll_y      # following
        backend.release()
        await idle(pilot)
        await pilot.pause(0.2)
        # the end of the reply and its summary line are on screen
        assert box.scroll_y == box.max_scroll_y
        summary = [v for v in app.chat.query(MessageView) if v.role == "assistant"][-1].query_one(".message-summary")
        assert summary.region.y < 24 and summary.region.height > 0
        # scrolled up by the user: a new reply does not pull the view down...
        backend.held.clear()
        backend.hold = "decode:200"
        await send(pilot, "again")
        await wait_for(pilot, backend.held.is_set)
        box.scroll_home(animate=False)
        await pilot.pause(0.1)
        backend.release()
        await idle(pilot)
        await pilot.pause(0.2)
        assert box.scroll_y == 0
        # ...until Ctrl+End, which jumps to the end and follows again
        await pilot.press("ctrl+end")
        await pilot.pause(0.2)
        assert box.scroll_y == box.max_scroll_y > 0


async def test_an_empty_chat_shows_the_welcome_and_the_help_explains_the_numbers(make_app):
    app = make_app(FakeBackend())
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        welcome = app.chat.query_one("#welcome")
        assert "Ctrl+T" in welcome.source and "prefix cache" in welcome.source
        assert welcome.region.height > 0                      # on screen at 80x24
        await send(pilot, "hello")
        await idle(pilot)
        assert not app.chat.query("#welcome")                 # gone with the first message
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.chat.query("#welcome")                     # back for a new, empty chat
        await pilot.press("f1")
        await pilot.pause()
        help_text = app.screen.query_one("Markdown").source
        for term in ("TTFT", "TPOT", "ITL", "KV cache", "Prefix cache", "Chunked prefill", "Neighbours"):
            assert f"| {term} |" in help_text, term


def test_the_panel_never_shows_more_tokens_per_verify_than_a_verify_can_give():
    from pdchat.chatapp.tui.widgets.panel_sections import spec_text
    # 18 drafts accepted over 5 verifies with k = 4, but the reply stopped after 20 tokens: the
    # drafts accepted past the stop were never appended. A verify gives at most k + 1 = 5 tokens.
    last = {"spec_drafted": 20, "spec_accepted": 18, "spec_steps": 5, "spec_mean_accepted": 3.6,
            "output_tokens": 20}
    text = spec_text(last, {"spec": True}, {"spec": "ngram"}).plain
    assert "per verify   4.60 tok" in text and "tok/step" not in text


def test_the_batch_section_shows_the_last_sliced_step_planned_and_measured():
    from pdchat.chatapp.tui.widgets.panel_sections import batch_text
    stats = {"running": 2, "waiting": 0, "step_ms": 28.0}
    assert "sliced step" not in batch_text(stats).plain           # no prompt was sliced yet
    text = batch_text(stats | {"sliced_step_ms": 91.0, "sliced_step_planned_ms": 84.0}).plain
    assert text.splitlines()[-1] == f"{'sliced step':<13}91 ms (planned 84 ms)"


@pytest.mark.parametrize("reason, mark", [("stop", "✓"), ("length", "✓"), ("cancelled", "■"), ("error", "✗")])
def test_the_last_reply_is_marked_by_how_it_ended(reason, mark):
    from pdchat.chatapp.tui.widgets.panel_sections import phase_text
    text = phase_text(None, {"finish_reason": reason}, {}, 30).plain
    assert text == f"{mark} last reply: {reason}"


async def test_everything_is_reachable_on_a_narrow_terminal(make_app):
    backend = FakeBackend(replies=["first answer", "second answer"])
    app = make_app(backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "first chat")
        await idle(pilot)
        first = app.chat.conv_id
        await pilot.press("ctrl+n")
        await send(pilot, "second chat")
        await idle(pilot)
        sidebar = app.chat.query_one("#sidebar")
        assert not sidebar.display or sidebar.region.width == 0              # hidden at 80 columns
        # Ctrl+F shows the list and types into a visible box; choosing a chat hides it again
        await pilot.press("ctrl+f")
        await pilot.pause()
        search = app.chat.query_one("#search")
        assert sidebar.region.width > 0 and app.focused is search and search.region.width > 0
        await pilot.press("escape")
        await pilot.pause()
        assert sidebar.region.width == 0
        # the palette can open any conversation
        from pdchat.chatapp.tui.palette import palette_commands
        opener = next(c for c in palette_commands(app) if c.title == "Open conversation: first chat")
        opener.callback()
        await wait_for(pilot, lambda: app.chat.conv_id == first)
        await pilot.pause(0.2)
        assert "first answer" in [v.content for v in app.chat.query(MessageView)]


async def test_a_streamed_reply_parses_its_fragments_with_one_kept_parser(make_app, monkeypatch):
    import textual.widgets._markdown as textual_markdown
    from pdchat.chatapp.tui.widgets import messages

    built = []

    class Counted(textual_markdown.MarkdownIt):
        def __init__(self, *args, **kwargs):
            built.append(args)
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(textual_markdown, "MarkdownIt", Counted)   # Textual's default, one per fragment
    monkeypatch.setattr(messages, "MarkdownIt", Counted)
    monkeypatch.setattr(messages, "_parsers", messages.threading.local())
    words = " ".join(f"word{i}" for i in range(40))
    app = make_app(FakeBackend(replies=[f"{words}\n\n- a list\n- of items"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi there")
        await idle(pilot)
        reply = list(app.chat.query(MessageView))[-1]
        assert reply.status == "done" and reply.content.endswith("- of items")
    assert 1 <= len(built) <= 3      # one per thread that parsed (the UI's, Textual's workers)
