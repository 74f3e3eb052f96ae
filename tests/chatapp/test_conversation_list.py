"""The conversation list and the footer a new user sees: F1 Help always in view, the open chat
marked, titles that start alike told apart, and no pile of empty "New chat" rows."""
from __future__ import annotations

import time

import pytest
from textual.widgets import Footer, ListView
from textual.widgets._footer import FooterKey

from pdchat.chatapp.tui.palette import ACTIONS
from pdchat.chatapp.tui.screens.chat import BINDINGS
from pdchat.chatapp.tui.store import Store
from pdchat.chatapp.tui.widgets.conversations import when
from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

SIZES = [(80, 24), (160, 48)]
LONG_A = "Explain the KV cache to me in simple words, please"
LONG_B = "Explain the KV cache to me in simple words, again"


def items(app) -> list:
    return list(app.chat.query(".conv-item"))


def current_items(app) -> list[int]:
    return [i.conv_id for i in items(app) if i.has_class("-current")]


def seeded_store(path, titles: list[str]) -> Store:
    """A database whose conversations each hold one message, oldest first."""
    store = Store(path)
    for title in titles:
        conv = store.create_conversation(title)
        store.add_message(conv.id, "user", f"about {title}")
    return store


@pytest.mark.parametrize("size", SIZES)
async def test_the_footer_always_shows_f1_help(make_app, size):
    app = make_app()
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await pilot.pause()
        footer = app.chat.query_one(Footer)
        [help_key] = [k for k in footer.query(FooterKey) if k.action == "help"]
        [palette_key] = footer.query(".-command-palette")
        assert help_key.key == "f1" and "Help" in help_key.render().plain
        # wholly inside the visible footer, neither scrolled off its end nor under "^p palette"
        assert footer.region.contains_region(help_key.region) and footer.scroll_x == 0
        assert not help_key.region.overlaps(palette_key.region)


def test_every_key_of_the_chat_screen_is_also_in_the_palette():
    # At 80 columns the footer cannot show every key: the palette (Ctrl+P) must reach them all.
    assert {b.action for b in BINDINGS} <= {action for _, _, action in ACTIONS}


@pytest.mark.parametrize("size", SIZES)
async def test_the_open_conversation_stays_highlighted(make_app, tmp_path, size):
    store = seeded_store(tmp_path / "data" / "pdchat.db", ["first", "second", "third"])
    app = make_app(store=store)
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: app.chat.conv_id is not None and current_items(app))
        newest = app.chat.conv_id
        assert app.store.conversation(newest).title == "third"       # the most recent one opens
        assert current_items(app) == [newest]
        first = next(c.id for c in app.store.conversations() if c.title == "first")
        await app.chat.open_conversation(first)
        await wait_for(pilot, lambda: current_items(app) == [first])
        # a refresh (search typed, then cleared) keeps the mark and the list's cursor on it
        search = app.chat.query_one("#search")
        search.value = "ir"
        await pilot.pause()
        search.value = ""
        await wait_for(pilot, lambda: len(items(app)) == 3 and current_items(app) == [first])
        lv = app.chat.query_one("#conv-list", ListView)
        await wait_for(pilot, lambda: lv.highlighted_child is not None)
        assert lv.highlighted_child.conv_id == first
        if size[0] < 110:                     # the hidden list, shown by Ctrl+F, shows the mark too
            await pilot.press("ctrl+f")
            await pilot.pause()
        marked = next(i for i in items(app) if i.has_class("-current"))
        assert marked.region.width > 0 and marked.styles.text_style.bold


@pytest.mark.parametrize("size", SIZES)
async def test_titles_that_start_alike_look_different(make_app, tmp_path, size):
    store = seeded_store(tmp_path / "data" / "pdchat.db", [LONG_A, LONG_B])
    app = make_app(store=store)
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: len(items(app)) == 2)
        await pilot.press("ctrl+f")                 # at 80 columns the list shows only then
        await pilot.pause()
        for item in items(app):
            title = item.query_one(".conv-title")
            assert str(title.render()) == app.store.conversation(item.conv_id).title
            assert title.region.height == 2          # wrapped, not cut at the sidebar's width
            stamp = str(item.query_one(".conv-when").render())
            assert stamp == when(app.store.conversation(item.conv_id).updated)


def test_when_says_the_time_today_and_the_date_before():
    now = time.mktime((2026, 11, 24, 15, 0, 0, 0, 0, -1))
    assert when(time.mktime((2026, 11, 24, 9, 5, 0, 0, 0, -1)), now) == "09:05"
    assert when(time.mktime((2026, 3, 3, 14, 32, 0, 0, 0, -1)), now) == "3 Mar 14:32"
    assert when(time.mktime((2024, 3, 3, 14, 32, 0, 0, 0, -1)), now) == "3 Mar 2024"


async def test_a_title_with_brackets_shows_as_typed(make_app, tmp_path):
    store = seeded_store(tmp_path / "data" / "pdchat.db", ["what does [b] mean?"])
    app = make_app(store=store)
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: len(items(app)) == 1)
        assert str(items(app)[0].query_one(".conv-title").render()) == "what does [b] mean?"


def empty_chats(store: Store) -> int:
    return sum(1 for c in store.conversations() if not store.messages(c.id))


@pytest.mark.parametrize("size", SIZES)
async def test_empty_chats_never_pile_up(make_app, tmp_path, size):
    db = tmp_path / "data" / "pdchat.db"
    for _ in range(3):                        # launch, Ctrl+N twice, quit; three times
        app = make_app(FakeBackend(), store=Store(db))
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+n")
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert empty_chats(app.store) == 1
        app.store.close()
    store = Store(db)
    assert store.conversations() == []        # the next launch finds none left over
    store.close()


@pytest.mark.parametrize("size", SIZES)
async def test_launch_opens_the_latest_chat_with_messages(make_app, tmp_path, size):
    db = tmp_path / "data" / "pdchat.db"
    store = seeded_store(db, ["older", "talked"])
    store.create_conversation()               # left empty by an earlier run, and newer
    store.close()
    app = make_app(FakeBackend(), store=Store(db))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: app.chat.conv_id is not None)
        assert app.store.conversation(app.chat.conv_id).title == "talked"
        assert sorted(c.title for c in app.store.conversations()) == ["older", "talked"]
        await wait_for(pilot, lambda: len(items(app)) == 2)


def test_only_unused_chats_are_dropped(tmp_path):
    store = seeded_store(tmp_path / "a.db", ["talked"])
    unused = store.create_conversation()
    store.create_conversation("renamed on purpose")
    store.create_conversation(settings={"system": "be brief"})
    kept = store.create_conversation()
    store.drop_empty(keep=kept.id)
    assert store.conversation(unused.id) is None
    assert sorted(c.title for c in store.conversations()) == ["New chat", "New chat", "renamed on purpose", "talked"]
    assert store.conversation(kept.id) is not None
    store.close()


@pytest.mark.parametrize("size", SIZES)
async def test_leaving_an_empty_chat_drops_it(make_app, size):
    app = make_app(FakeBackend(replies=["an answer"]))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await send(pilot, "a real question")
        await idle(pilot)
        talked = app.chat.conv_id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert empty_chats(app.store) == 1 and app.chat.conv_id != talked
        await app.chat.open_conversation(talked)
        await pilot.pause()
        assert empty_chats(app.store) == 0 and [c.id for c in app.store.conversations()] == [talked]
        assert [i.conv_id for i in items(app)] == [talked]


async def test_a_launch_with_no_chat_shows_the_welcome_and_creates_none(make_app, tmp_path):
    db = tmp_path / "data" / "pdchat.db"
    Store(db).create_conversation()           # an empty one from an earlier run
    app = make_app(FakeBackend(), store=Store(db))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.pause()
        assert app.chat.conv_id is None and app.chat.query("#welcome")
        assert app.store.conversations() == []


async def test_a_chat_deleted_under_the_app_takes_the_message_into_a_new_one(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+n")
        await pilot.pause(0.1)
        empty = app.chat.conv_id
        other = Store(tmp_path / "data" / "pdchat.db")      # a second pdchat starting on the same data
        other.close()
        assert app.store.conversation(empty) is None
        await send(pilot, "still here?")
        await idle(pilot)
        assert app.chat.conv_id != empty
        assert [m.content for m in app.store.messages(app.chat.conv_id)][0] == "still here?"


async def test_a_reply_updates_its_row_in_place_and_the_cursor_follows_the_open_chat(make_app, tmp_path):
    """A reply's start and end mark its row (● while it streams) without remounting the list: a
    rebuild mounted every row again while the model prefilled. Opening another chat moves the mark
    and the list's cursor to it, on the same rows."""
    store = seeded_store(tmp_path / "data" / "pdchat.db", ["first", "second"])
    backend = FakeBackend(hold="decode:1", replies=["fine, thanks"])
    app = make_app(backend, store=store)
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: app.chat.conv_id is not None and current_items(app))
        rows = items(app)

        def title(row) -> str:
            return str(row.query_one(".conv-title").render())

        assert [title(r) for r in rows] == ["second", "first"]
        await send(pilot, "hello")
        await wait_for(pilot, backend.held.is_set)
        await wait_for(pilot, lambda: title(rows[0]) == "● second")
        assert items(app) == rows                  # the same widgets, updated
        backend.generations[-1].released.set()
        await idle(pilot)
        await wait_for(pilot, lambda: title(rows[0]) == "second")
        first = rows[1].conv_id
        await app.chat.open_conversation(first)
        lv = app.chat.query_one("#conv-list", ListView)
        await wait_for(pilot, lambda: current_items(app) == [first] and lv.highlighted_child is rows[1])
        assert items(app) == rows
