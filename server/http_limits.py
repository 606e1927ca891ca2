"""Bounds on a request's head (request line and headers), enforced by the HTTP protocol before any app code runs,
and OpenAI error objects for what is refused there.

uvicorn's h11 protocol bounds the head by its `h11_max_incomplete_event_size`; its httptools protocol, which
it picks when httptools is installed (as `uvicorn[standard]` does: it streams faster), bounds nothing and keeps
every header a client sends. BoundedHttpToolsProtocol applies the same byte bound there, and a bound on the
number of headers, answering 431; it also answers a request it cannot parse with a JSON error object rather than
uvicorn's plain-text 400.
"""

from __future__ import annotations

import json
from http import HTTPStatus

MAX_HEADERS = 100  # Apache's LimitRequestFields; clients send about 10


def raw_error(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response (connection: close) carrying an OpenAI error object."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class _HeadTooLarge(Exception):
    pass


def _bounded_httptools():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with the head bounded to config.h11_max_incomplete_event_size bytes and
        MAX_HEADERS headers. The bytes are counted as headers are parsed, and as reads arrive while a head is
        incomplete (httptools keeps a partial header in memory until its end)."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._in_head, self._head_bytes, self._headers, self._too_large = True, 0, 0, False
            self._events = self._unparsed = 0  # heads begun and ended; bytes read into the current one

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._headers, self._events = 0, self._events + 1

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._headers += 1
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._headers > MAX_HEADERS or self._head_bytes > self._limit():
                self._too_large = True
                raise _HeadTooLarge  # the parser stops; uvicorn answers its parse error with send_400_response

        def _limit(self) -> int:
            limit = self.config.h11_max_incomplete_event_size
            return limit if limit is not None else 2**31

        def on_headers_complete(self) -> None:
            self._in_head, self._events = False, self._events + 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes, self._events = True, 0, self._events + 1

        def data_received(self, data: bytes) -> None:
            events = self._events
            super().data_received(data)
            if self.transport.is_closing():
                return
            # httptools holds a header's bytes until its end: a read that neither began nor ended a head but
            # fed one is all head
            self._unparsed = self._unparsed + len(data) if self._in_head and events == self._events else 0
            if self._unparsed > self._limit():
                self._too_large = True
                self.send_400_response("")

        def send_400_response(self, msg: str) -> None:
            if self._too_large:
                self.logger.warning("refused a request head of more than %d bytes or %d headers", self._limit(),
                                    MAX_HEADERS)
                raw = raw_error(431, f"the request's line and headers exceed {self._limit()} bytes or "
                                     f"{MAX_HEADERS} headers", "headers_too_large")
            else:
                raw = raw_error(400, msg, "invalid_http")
            if not self.transport.is_closing():
                self.transport.write(raw)
                self.transport.close()

    return BoundedHttpToolsProtocol


def uvicorn_http_options(max_header_bytes: int) -> dict:
    """Keyword arguments for uvicorn.run that bound request heads to max_header_bytes: the bounded httptools
    protocol where httptools is installed, else h11 with the same bound."""
    try:
        protocol = _bounded_httptools()
    except ImportError:
        protocol = "h11"
    return {"http": protocol, "h11_max_incomplete_event_size": max_header_bytes}
