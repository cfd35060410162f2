"""The API's HTTP protocol: uvicorn's httptools protocol, with a deadline on each request's head.

uvicorn waits without limit for a request's head: its keep-alive timer runs only between a response
and the next request's first byte (each byte received stops it), and a new connection has none. A
client that opens connections and sends nothing, or a header line every few seconds (slowloris),
holds each connection and a file descriptor of the server for as long as it likes.

Here a connection closes when the head of its next request has not arrived whole
``head_read_timeout_seconds`` after the connection opened or the previous response ended. (The
body has a deadline of its own, kept by the application: ``service.edges``.) A request pipelined
behind a response has its head already, and a response being sent is not timed: an event stream
lives as long as it streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ckptconv.core.settings import get_settings


class HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that closes a connection whose next head is late (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_seconds = get_settings().head_read_timeout_seconds
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._head_arrived()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's head arrived already (uvicorn starts it)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._await_head()

    def _await_head(self) -> None:
        self._head_timer = self.loop.call_later(self._head_seconds, self._head_late)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()
