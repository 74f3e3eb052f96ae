"""One request in the engine, seen from the server's event loop.

A RequestStream is a blocking iterator; a pump thread per request moves its events onto the loop
(an executor would not do: a few thousand-token streams would hold every worker of the default
pool and starve the handlers). The pump reads until the FinishEvent even after the client has
gone, so every request is accounted for exactly once, when the engine is really done with it.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable

from pdchat.engine import Completion, FinishEvent, RequestStream, TokenEvent


class Flight:
    def __init__(self, stream: RequestStream, on_finish: Callable[[Completion], None], *, tokens: bool):
        self.stream = stream
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[TokenEvent | FinishEvent] = asyncio.Queue()
        self.completion: asyncio.Future[Completion] = self._loop.create_future()
        self._on_finish = on_finish
        self._tokens = tokens
        threading.Thread(target=self._pump, name=f"pdchat-serve-{stream.request_id}", daemon=True).start()

    def _pump(self) -> None:
        for ev in self.stream:
            if not (isinstance(ev, FinishEvent) or (self._tokens and isinstance(ev, TokenEvent))):
                continue                  # progress events have no place in the OpenAI API
            try:
                self._loop.call_soon_threadsafe(self._deliver, ev)
            except RuntimeError:          # the loop is closed: the server shut down
                return

    def _deliver(self, ev: TokenEvent | FinishEvent) -> None:
        self._events.put_nowait(ev)
        if isinstance(ev, FinishEvent):
            self.completion.set_result(ev.completion)
            self._on_finish(ev.completion)

    async def events(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        while True:
            ev = await self._events.get()
            yield ev
            if isinstance(ev, FinishEvent):
                return

    def cancel(self) -> None:
        """Stop generating and free the KV blocks; a no-op once the request has finished."""
        if not self.completion.done():
            self.stream.cancel()
