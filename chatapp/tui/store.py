"""SQLite persistence: conversations, messages (with metrics), settings.

WAL journal, a schema_version table and ordered migrations. A streaming reply is a message row
with status 'streaming' that is updated as it grows; one left in that state by a crash reads
back as 'interrupted'. A database that cannot be opened is moved aside (never deleted) and a
fresh one created; `notice` says so, for the UI to show. Chats left without a message are dropped
(at open, and by the chat screen when it leaves one), so unused "New chat" rows never pile up.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIGRATIONS = [
    # 1: the first schema
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        settings TEXT NOT NULL DEFAULT '{}',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        status TEXT NOT NULL DEFAULT 'done',
        metrics TEXT,
        created REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
]

NEW_CHAT = "New chat"          # a conversation's title until its first message names it


@dataclass
class Conversation:
    id: int
    title: str
    settings: dict[str, Any] = field(default_factory=dict)
    updated: float = 0.0


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str = "done"           # done | streaming | cancelled | error | interrupted
    metrics: dict[str, Any] | None = None


class Store:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.notice: str | None = None
        try:
            self.db = self._open()
        except sqlite3.DatabaseError as e:
            moved = self._move_aside()
            self.notice = (f"The chat database could not be read ({e}); it was moved to {moved.name} "
                           f"and a new one was started.")
            self.db = self._open()
        self.drop_empty()         # chats left empty by earlier runs: they would pile up at every launch

    # ---- opening ----------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            ok = db.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {ok}")
            self._migrate(db)
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        self.path.rename(target)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                side.rename(target.with_name(target.name + suffix))
        return target

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        version = row[0] if row else 0
        if row is None:
            db.execute("INSERT INTO schema_version VALUES (0)")
        for i, script in enumerate(MIGRATIONS[version:], start=version + 1):
            db.execute("BEGIN")
            try:
                for stmt in filter(str.strip, script.split(";")):
                    db.execute(stmt)
                db.execute("UPDATE schema_version SET version = ?", (i,))
                db.execute("COMMIT")
            except Exception:
                db.execute("ROLLBACK")
                raise

    @property
    def schema_version(self) -> int:
        return self.db.execute("SELECT version FROM schema_version").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    # ---- conversations ----------------------------------------------------------------------
    def create_conversation(self, title: str = NEW_CHAT, settings: dict | None = None) -> Conversation:
        now = time.time()
        cur = self.db.execute("INSERT INTO conversations (title, settings, created, updated) VALUES (?,?,?,?)",
                              (title, json.dumps(settings or {}), now, now))
        return Conversation(cur.lastrowid, title, settings or {}, now)

    def conversations(self, search: str | None = None) -> list[Conversation]:
        sql = "SELECT * FROM conversations"
        args: tuple = ()
        if search:
            sql += (" WHERE title LIKE ? OR id IN (SELECT conversation_id FROM messages WHERE content LIKE ?)")
            args = (f"%{search}%", f"%{search}%")
        rows = self.db.execute(sql + " ORDER BY updated DESC, id DESC", args).fetchall()
        return [Conversation(r["id"], r["title"], json.loads(r["settings"]), r["updated"]) for r in rows]

    def conversation(self, conv_id: int) -> Conversation | None:
        r = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        return Conversation(r["id"], r["title"], json.loads(r["settings"]), r["updated"]) if r else None

    def rename(self, conv_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conv_id))

    def set_conversation_settings(self, conv_id: int, settings: dict) -> None:
        self.db.execute("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(settings), conv_id))

    def delete_conversation(self, conv_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))

    def drop_empty(self, keep: int | None = None) -> None:
        """Delete the chats nobody used: no message, the default title and no settings of their
        own (a renamed or configured empty chat was meant to be kept). `keep` is spared."""
        self.db.execute("DELETE FROM conversations WHERE title = ? AND settings = '{}' AND id IS NOT ? "
                        "AND id NOT IN (SELECT conversation_id FROM messages)", (NEW_CHAT, keep))

    def _touch(self, conv_id: int) -> None:
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conv_id))

    # ---- messages ---------------------------------------------------------------------------
    def add_message(self, conv_id: int, role: str, content: str, status: str = "done",
                    metrics: dict | None = None) -> Message:
        cur = self.db.execute(
            "INSERT INTO messages (conversation_id, role, content, status, metrics, created) VALUES (?,?,?,?,?,?)",
            (conv_id, role, content, status, json.dumps(metrics) if metrics is not None else None, time.time()))
        self._touch(conv_id)
        return Message(cur.lastrowid, conv_id, role, content, status, metrics)

    def update_message(self, msg_id: int, content: str | None = None, status: str | None = None,
                       metrics: dict | None = None) -> None:
        sets, args = [], []
        if content is not None:
            sets.append("content = ?")
            args.append(content)
        if status is not None:
            sets.append("status = ?")
            args.append(status)
        if metrics is not None:
            sets.append("metrics = ?")
            args.append(json.dumps(metrics))
        if sets:
            self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, msg_id))

    def delete_message(self, msg_id: int) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (msg_id,))

    def messages(self, conv_id: int) -> list[Message]:
        rows = self.db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conv_id,)).fetchall()
        out = []
        for r in rows:
            status = "interrupted" if r["status"] == "streaming" else r["status"]
            out.append(Message(r["id"], r["conversation_id"], r["role"], r["content"], status,
                               json.loads(r["metrics"]) if r["metrics"] else None))
        return out

    # ---- settings ---------------------------------------------------------------------------
    def get_setting(self, key: str, default: Any = None) -> Any:
        r = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return json.loads(r[0]) if r else default

    def set_setting(self, key: str, value: Any) -> None:
        self.db.execute("INSERT INTO settings (key, value) VALUES (?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, json.dumps(value)))
