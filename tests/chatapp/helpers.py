"""Pilot helpers for the chat app tests."""
from __future__ import annotations

import asyncio


async def wait_for(pilot, predicate, timeout: float = 10.0) -> None:
    """Let the app run until predicate() is true (fails the test on timeout)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


async def ready(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.ready)


async def send(pilot, text: str) -> None:
    """Type a message into the input and press Enter."""
    chat = pilot.app.chat
    chat.query_one("#input").focus()
    chat.query_one("#input").text = text
    await pilot.press("enter")


async def idle(pilot) -> None:
    """Wait until no reply is in flight and the views are final."""
    chat = pilot.app.chat
    await wait_for(pilot, lambda: not chat.live)
    await pilot.pause(0.05)
