"""End to end: the app on the real engine and the real default model; text and metrics appear."""
from __future__ import annotations

import pytest

from pdchat.chatapp.backends.base import Settings
from pdchat.chatapp.backends.local import LocalBackend
from pdchat.chatapp.tui.widgets.messages import MessageView

from .helpers import send, wait_for

pytestmark = pytest.mark.anyio


async def test_chat_with_real_engine(make_app):
    backend = LocalBackend(model="smollm2-135m", device="cpu")   # fetched and converted on first use
    app = make_app(backend, settings=Settings(max_tokens=12, temperature=0.0))
    try:
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: app.ready or app.load_error, timeout=300)
            assert app.load_error is None
            assert backend.capabilities["prefix_cache"] is True
            await send(pilot, "What is the capital of France?")
            await wait_for(pilot, lambda: not app.chat.live, timeout=120)
            await pilot.pause(0.3)
            reply = list(app.chat.query(MessageView))[-1]
            msg = app.store.messages(app.chat.conv_id)[-1]
            assert msg.role == "assistant" and msg.status == "done"
            m = msg.metrics
            assert m["output_tokens"] >= 1 and m["prompt_tokens"] > 0
            assert m["ttft_ms"] > 0 and m["finish_reason"] in ("stop", "length")
            assert reply.content == msg.content
            assert "Paris" in msg.content
            assert str(reply.query_one(".message-summary").render()).startswith("TTFT ")
            kv = str(app.chat.query_one("#tm-kv").render())
            assert "per token" in kv and "n/a" not in kv.split("per token")[1].split("\n")[0]
            # a toggle reaches the engine
            await app.apply_toggles({"prefix_cache": False})
            assert backend.engine.config.prefix_cache is False
    finally:
        backend.close()
