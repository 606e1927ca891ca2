"""Renders a generation (ChatDeltas) as a Responses API response: the whole object, or the SSE events of a
stream, in the order and shapes that the OpenAI SDK's `responses.stream()` and Home Assistant accept.

The stream and the whole object come from one state machine, so the `response.completed` object, the
`output_item.done` items and a non-streamed response always agree (the SDK raises when a done item or the
response id differs from what it accumulated).
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from edgespec.server.chat_input import ChatDelta, Message, ToolCall
from edgespec.server.errors import APIError
from edgespec.server.responses_protocol import ResponsesRequest

Usage = tuple[int, int, int]  # (input_tokens, output_tokens, cached_tokens)


def _hex() -> str:
    return uuid.uuid4().hex


def _usage(usage: Usage, reasoning_tokens: int) -> dict:
    input_tokens, output_tokens, cached = usage
    # cache_write_tokens is required by the SDK's model; this server has no explicit cache writes to report
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def _text_echo(req: ResponsesRequest) -> dict:
    """`text` as the response echoes it: the request's, with the defaults the SDK's model needs."""
    text = copy.deepcopy(req.text) if req.text else {}
    fmt = text.get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema" and not fmt.get("name"):
        fmt = {**fmt, "name": "response"}
    return {**text, "format": fmt}


class ResponsesRenderer:
    """Builds one response. Streaming: start(), then delta() for each ChatDelta but the last, then finish()
    with the last (or failed() on an error); each returns the events to send, every one with `type` and a
    `sequence_number` counting from 0. Whole: response(deltas). `id` is the response's id, assistant_message()
    the turn to store for previous_response_id."""

    def __init__(self, model: str, req: ResponsesRequest, prompt_tokens: int):
        self.model, self.req, self.prompt_tokens = model, req, prompt_tokens
        self.id = "resp_" + _hex()
        self.created_at = int(time.time())
        self._seq = 0
        self._output: list[dict] = []  # the items so far; a finished one is final
        self._open: dict | None = None  # the message item whose text is streaming, if any
        self._thought: dict | None = None  # the reasoning item whose text is streaming, if any
        self._reasoning_tokens = 0  # the tokens of the steps that only thought
        self._texts: list[str] = []
        self._calls: list[ToolCall] = []
        self._tokens = 0
        self._status = "in_progress"
        self._extra: dict[str, Any] = {}  # usage, incomplete_details, error, decoding... once known

    # streaming

    def start(self) -> list[dict]:
        """response.created and response.in_progress, each with the response as it stands (no output)."""
        return [self._event("response.created", response=self.snapshot()),
                self._event("response.in_progress", response=self.snapshot())]

    def delta(self, d: ChatDelta) -> list[dict]:
        """The events of one step: its thinking into the reasoning item (opened on the first thought, closed on
        the answer's first text or call), its text into the open message item (opened on the first text), then
        each call completed in it as a whole function_call item (closing the message item first)."""
        self._tokens += d.tokens
        events = self._think(d.reasoning) if d.reasoning else []
        if self._thought is not None and not d.content and not d.calls:
            self._reasoning_tokens += d.tokens
        elif self._thought is not None:
            events += self._close_thought("completed")
        if d.content:
            if self._open is None:
                events += self._open_message()
            part = self._open["content"][0]
            part["text"] += d.content
            self._texts.append(d.content)
            events.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                      output_index=len(self._output) - 1, content_index=0, delta=d.content,
                                      logprobs=[]))
        for call in d.calls:
            events += self._close_message("completed")
            events += self._call(call)
        return events

    def finish(self, d: ChatDelta, usage: Usage | None = None) -> list[dict]:
        """The last step's events, closing what is open, then response.completed, or response.incomplete when
        the generation ran out of tokens (finish_reason "length"). usage: (input, output, cached) tokens; by
        default the prompt's count, the deltas' tokens and the statistics' cached_prompt_tokens."""
        events = self.delta(d)
        incomplete = d.finish_reason == "length"
        events += self._close_thought("incomplete" if incomplete else "completed")
        if not any(item["type"] != "reasoning" for item in self._output):  # an empty answer is still a message,
            events += self._open_message()  # so that output_text is ""
        events += self._close_message("incomplete" if incomplete else "completed")
        if usage is None:
            usage = (self.prompt_tokens, self._tokens, (d.stats or {}).get("cached_prompt_tokens") or 0)
        self._status = "incomplete" if incomplete else "completed"
        self._extra = {"completed_at": int(time.time()), "usage": _usage(usage, self._reasoning_tokens),
                       "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                       "decoding": d.stats}
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, self._event(kind, response=self.snapshot())]

    def failed(self, err: APIError) -> list[dict]:
        """response.failed, for an error after the stream started (the status line is already sent)."""
        self._status = "failed"
        # the SDK's ResponseError.code is an enumeration: the server's own code goes in the message
        code = f" ({err.code})" if err.code else ""
        self._extra = {"error": {"code": "server_error", "message": err.message + code}}
        return [self._event("response.failed", response=self.snapshot())]

    # whole

    def response(self, deltas: list[ChatDelta], usage: Usage | None = None) -> dict:
        """The finished response object for all the deltas of a generation (the last carries finish_reason)."""
        for d in deltas[:-1]:
            self.delta(d)
        self.finish(deltas[-1] if deltas else ChatDelta(finish_reason="stop"), usage)
        return self.snapshot()

    def assistant_message(self) -> Message:
        """The answer so far as one assistant turn: its text and its calls."""
        return Message("assistant", "".join(self._texts), tuple(self._calls))

    def snapshot(self) -> dict:
        """The response object as it stands (a copy: events keep what they carried)."""
        req, extra = self.req, self.req.model_extra or {}
        metadata = extra.get("metadata")
        obj = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self._status,
            "model": self.model, "output": copy.deepcopy(self._output), "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": copy.deepcopy(req.tools),
            "tool_choice": copy.deepcopy(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "text": _text_echo(req), "previous_response_id": req.previous_response_id, "reasoning": None,
            "store": req.store, "truncation": "disabled", "usage": None,
            "metadata": copy.deepcopy(metadata) if isinstance(metadata, dict) else {},
        }
        if isinstance(extra.get("user"), str):
            obj["user"] = extra["user"]
        obj.update(copy.deepcopy(self._extra))
        return obj

    # items

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _open_message(self) -> list[dict]:
        item = {"id": "msg_" + _hex(), "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        self._output.append(item)
        self._open = item
        index = len(self._output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        item["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=copy.deepcopy(part))]

    def _close_message(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index, part = self._output.index(item), item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=copy.deepcopy(part)),
                self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _think(self, text: str) -> list[dict]:
        # a reasoning item (the Responses API's own shape for a model's thinking), its text streamed as deltas
        events = []
        if self._thought is None:
            self._thought = {"id": "rs_" + _hex(), "type": "reasoning", "summary": [], "content": [],
                             "status": "in_progress"}
            self._output.append(self._thought)
            events.append(self._event("response.output_item.added", output_index=len(self._output) - 1,
                                      item=copy.deepcopy(self._thought)))
            self._thought["content"].append({"type": "reasoning_text", "text": ""})
        self._thought["content"][0]["text"] += text
        return [*events, self._event("response.reasoning_text.delta", item_id=self._thought["id"],
                                     output_index=self._output.index(self._thought), content_index=0, delta=text)]

    def _close_thought(self, status: str) -> list[dict]:
        item, self._thought = self._thought, None
        if item is None:
            return []
        item["status"] = status
        index = self._output.index(item)
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _call(self, call: ToolCall) -> list[dict]:
        # added carries empty arguments: Home Assistant appends the deltas to the added item's arguments
        item = {"id": "fc_" + _hex(), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        self._output.append(item)
        self._calls.append(call)
        index = len(self._output) - 1
        added = self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        item.update(arguments=call.arguments, status="completed")
        where = {"item_id": item["id"], "output_index": index}
        return [added, self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self._event("response.function_call_arguments.done", **where, name=call.name,
                            arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]
