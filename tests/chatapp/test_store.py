"""Store: schema/migrations, settings, search, corruption handling, kill -9 while streaming."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from tests.doubles.fake_backend import FakeBackend
from pdchat.chatapp.tui.store import MIGRATIONS, Store

from .helpers import ready, send, wait_for


def test_schema_version_wal_and_roundtrip(tmp_path):
    s = Store(tmp_path / "a.db")
    assert s.schema_version == len(MIGRATIONS)
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    c = s.create_conversation("Title", {"temperature": 0.2})
    m = s.add_message(c.id, "assistant", "x", metrics={"ttft_ms": 1.5, "itl_ms": [1.0, 2.0]})
    s.update_message(m.id, content="xyz", status="done")
    s.set_setting("theme", "pdchat-light")
    s.close()
    s = Store(tmp_path / "a.db")
    assert s.notice is None
    [conv] = s.conversations()
    assert (conv.title, conv.settings) == ("Title", {"temperature": 0.2})
    [msg] = s.messages(conv.id)
    assert (msg.content, msg.status, msg.metrics["itl_ms"]) == ("xyz", "done", [1.0, 2.0])
    assert s.get_setting("theme") == "pdchat-light" and s.get_setting("missing", 7) == 7
    assert [c.title for c in s.conversations("xyz")] == ["Title"]
    assert s.conversations("nothing like it") == []
    s.delete_conversation(conv.id)
    assert s.messages(conv.id) == []


def test_every_reply_metric_is_saved_and_read_back(tmp_path):
    # metrics are one JSON value: a new RequestMetrics field (the KV hand-off's) needs no migration
    from pdchat.engine.metrics import RequestMetrics
    metrics = RequestMetrics(ttft_ms=30.0, kv_transfer_bytes=138240, kv_transfer_ms=4.25).to_dict()
    s = Store(tmp_path / "a.db")
    c = s.create_conversation()
    s.add_message(c.id, "assistant", "x", metrics=metrics)
    s.close()
    s = Store(tmp_path / "a.db")
    [msg] = s.messages(c.id)
    assert msg.metrics == metrics
    assert (msg.metrics["kv_transfer_bytes"], msg.metrics["kv_transfer_ms"]) == (138240, 4.25)
    s.close()


def test_old_schema_is_migrated(tmp_path):
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (0)")
    db.commit()
    db.close()
    s = Store(tmp_path / "old.db")
    assert s.schema_version == len(MIGRATIONS) and s.notice is None
    s.create_conversation()


def test_a_new_migration_upgrades_a_database_with_data(tmp_path, monkeypatch):
    from pdchat.chatapp.tui import store as store_module
    path = tmp_path / "v1.db"
    s = Store(path)
    c = s.create_conversation("Kept", {"temperature": 0.3})
    s.add_message(c.id, "user", "hello")
    s.set_setting("theme", "dark")
    s.close()
    v2 = "ALTER TABLE messages ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0; CREATE INDEX pinned ON messages(pinned)"
    monkeypatch.setattr(store_module, "MIGRATIONS", [*MIGRATIONS, v2])
    s = Store(path)
    assert s.schema_version == len(MIGRATIONS) + 1 and s.notice is None
    [conv] = s.conversations()
    assert (conv.title, conv.settings) == ("Kept", {"temperature": 0.3})
    assert [m.content for m in s.messages(conv.id)] == ["hello"]
    assert s.get_setting("theme") == "dark"
    assert s.db.execute("SELECT pinned FROM messages").fetchall()[0][0] == 0
    s.close()


def test_a_failing_migration_changes_nothing(tmp_path, monkeypatch):
    from pdchat.chatapp.tui import store as store_module
    path = tmp_path / "v1.db"
    s = Store(path)
    conv = s.create_conversation("Kept")
    s.add_message(conv.id, "user", "hello")
    s.add_message(conv.id, "user", "again")
    s.close()
    # Fails on this database's data (two user messages), not on an empty one.
    broken = "ALTER TABLE messages ADD COLUMN half INTEGER; CREATE UNIQUE INDEX one_per_role ON messages(role)"
    monkeypatch.setattr(store_module, "MIGRATIONS", [*MIGRATIONS, broken])
    s = Store(path)                       # cannot open it: moved aside, a fresh one started
    assert s.notice and "moved to" in s.notice
    s.close()
    [aside] = tmp_path.glob("v1.db.corrupt-*")
    old = sqlite3.connect(aside)
    assert old.execute("SELECT version FROM schema_version").fetchone()[0] == len(MIGRATIONS)
    assert "half" not in [r[1] for r in old.execute("PRAGMA table_info(messages)")]      # rolled back
    assert old.execute("SELECT content FROM messages").fetchall() == [("hello",), ("again",)]
    old.close()


def test_corrupt_file_moved_aside(tmp_path):
    path = tmp_path / "c.db"
    path.write_bytes(b"garbage" * 1000)
    s = Store(path)
    assert s.notice and "moved to c.db.corrupt-" in s.notice
    assert s.conversations() == []
    [aside] = tmp_path.glob("c.db.corrupt-*")
    assert aside.read_bytes() == b"garbage" * 1000


WRITER = textwrap.dedent("""
    import sys, time
    from pdchat.chatapp.tui.store import Store
    s = Store(sys.argv[1])
    c = s.create_conversation("kill me")
    s.add_message(c.id, "user", "tell me a long story")
    m = s.add_message(c.id, "assistant", "", status="streaming")
    text = ""
    i = 0
    while True:
        i += 1
        text += f"word{i} "
        s.update_message(m.id, content=text)
        time.sleep(0.01)
""")


def test_kill_9_during_stream_keeps_partial_reply(tmp_path):
    path = tmp_path / "k.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    try:
        deadline = time.time() + 30
        seen = ""
        while time.time() < deadline:
            time.sleep(0.1)
            try:
                row = sqlite3.connect(path).execute(
                    "SELECT content FROM messages WHERE role='assistant'").fetchone()
            except sqlite3.Error:
                continue
            seen = row[0] if row else ""
            if seen.count("word") >= 20:
                break
        assert seen.count("word") >= 20, "writer made no progress"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    s = Store(path)
    assert s.notice is None
    [conv] = s.conversations()
    user, reply = s.messages(conv.id)
    assert user.content == "tell me a long story"
    assert reply.status == "interrupted"
    assert reply.content.startswith(seen.rstrip()) and reply.content.count("word") >= 20


@pytest.mark.anyio
async def test_app_saves_growing_reply_while_streaming(make_app):
    backend = FakeBackend(hold="decode:4", replies=["alpha beta gamma delta epsilon"])
    app = make_app(backend)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "stream")
        await wait_for(pilot, backend.held.is_set)
        conv = app.chat.conv_id

        def saved():
            other = Store(app.store.path)
            try:
                return other.messages(conv)[-1]
            finally:
                other.close()
        await wait_for(pilot, lambda: saved().content == "alpha beta gamma delta", timeout=3)
        # read by another connection, as after a crash: the reply is there, marked interrupted
        assert saved().status == "interrupted"
        backend.release()
