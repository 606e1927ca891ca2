"""Streaming a generation to an HTTP client: the first delta awaited before the response starts (so a request
that cannot start gets its status code), whole answers collected, and the two SSE framings (chat and text
completions' `data:` chunks ending [DONE]; the Responses API's typed events)."""

from __future__ import annotations

import json
import logging
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from edgespec.server.errors import APIError, internal_error
from edgespec.server.render import Renderer
from edgespec.server.responses_render import ResponsesRenderer

log = logging.getLogger(__name__)


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


async def started(deltas):
    """The deltas with their first one awaited before any response is sent, so that a request that cannot start
    (no room for its KV cache, say) gets a proper status code even when streamed."""
    try:
        first = await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise

    async def again():
        async with aclosing(deltas):
            yield first
            async for delta in deltas:
                yield delta

    return again()


async def collect(deltas, request: Request) -> list | None:
    """Every delta up to the finish, or None when the client left (generation stops)."""
    collected = []
    async with aclosing(deltas):
        async for delta in deltas:
            collected.append(delta)
            if delta.finish_reason is not None:
                return collected
            if await request.is_disconnected():
                return None
    return collected


async def respond(deltas, renderer: Renderer, req, request: Request):
    deltas = await started(deltas)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventSourceResponse(_sse(deltas, renderer, include_usage), sep="\n", ping=15)
    collected = await collect(deltas, request)
    if collected is None:
        return Response(status_code=499)  # nobody is listening: stop generating
    return JSONResponse(renderer.response(collected))


async def _sse(deltas, renderer: Renderer, include_usage: bool):
    """OpenAI stream framing: role chunk, content and call chunks, finish chunk, optional usage chunk, [DONE]."""
    async with aclosing(deltas):
        try:
            opening = renderer.first_chunk()
            if opening is not None:
                yield {"data": dumps(opening | ({"usage": None} if include_usage else {}))}
            stats = None
            async for delta in deltas:
                for chunk in renderer.chunks(delta, include_usage):
                    yield {"data": dumps(chunk)}
                if delta.finish_reason is not None:
                    stats = delta.stats
                    break
            if include_usage:
                yield {"data": dumps(renderer.usage_chunk(stats))}
        except APIError as exc:
            yield {"data": dumps(exc.body())}
        except Exception:  # the status line is sent: the client learns of a fault from an error event
            log.exception("unexpected error in a %s stream", renderer.kind)
            yield {"data": dumps(internal_error().body())}
    yield {"data": "[DONE]"}


async def response_events(deltas, renderer: ResponsesRenderer, keep):
    """The Responses API's stream: `event: TYPE` and its JSON, from response.created to response.completed (or
    .incomplete, or .failed on an error mid-stream); no [DONE]."""
    async with aclosing(deltas):
        events = renderer.start()
        try:
            async for delta in deltas:
                if delta.finish_reason is None:
                    events += renderer.delta(delta)
                else:
                    events += renderer.finish(delta)
                    keep()
                for event in events:
                    yield {"event": event["type"], "data": dumps(event)}
                events = []
        except Exception as exc:  # the status line is sent: the client learns of a fault from response.failed
            if not isinstance(exc, APIError):
                log.exception("unexpected error in a Responses stream")
                exc = internal_error()
            for event in [*events, *renderer.failed(exc)]:
                yield {"event": event["type"], "data": dumps(event)}
