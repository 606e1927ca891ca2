"""A request body counted as it arrives, for the controller's and the workers' apps alike (server/app.py's
_LimitsAndCounts, workers/app.py's _TokenAndLimits): both refuse a body over their limit with a 413, by its
Content-Length before the app runs, and, where there is none (a chunked body), as the app reads it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable


class CountedBody:
    """An ASGI `receive` that counts the request body's bytes: once they pass `limit`, `receive()` raises
    `error()` (the app stops reading there) and `exceeded` is set, for the app's send to answer 413 in place of
    whatever the app made of the aborted body."""

    def __init__(self, receive: Callable[[], Awaitable[dict]], limit: int, error: Callable[[], Exception]):
        self._receive, self.limit, self.error = receive, limit, error
        self.received, self.exceeded = 0, False

    async def receive(self) -> dict:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.exceeded = True
                raise self.error()
        return message
