"""A generation's ChatDeltas as Ollama's chat and generate answers: NDJSON objects while streaming (message deltas,
then a last object with `done: true`, the done reason and the timings in nanoseconds), or one whole object."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from edgespec.server.chat_input import ChatDelta, ToolCall
from edgespec.server.errors import APIError, internal_error
from edgespec.server.ollama_model import now
from edgespec.server.streaming import dumps

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


def clock() -> int:
    return time.perf_counter_ns()


@dataclass
class Timings:
    """When one request arrived, asked for its generation (its set-up done: template, grammar) and got its first
    token; Ollama's durations are read from them, in nanoseconds. load_duration is the set-up: the model itself is
    loaded once, at start."""

    arrived: int = field(default_factory=clock)
    submitted: int = 0
    first: int = 0

    def durations(self) -> dict[str, int]:
        end = clock()
        submitted = self.submitted or end
        first = self.first or end
        return {"total_duration": end - self.arrived, "load_duration": submitted - self.arrived,
                "prompt_eval_duration": first - submitted, "eval_duration": end - first}


def done_reason(finish_reason: str | None) -> str:
    """Ollama's reasons: length when cut, else stop (a call too: Ollama has no reason of its own for it)."""
    return "length" if finish_reason == "length" else "stop"


def load_answer(kind: Literal["chat", "generate"], model: str) -> dict[str, Any]:
    """The answer to a chat without messages or a generate without a prompt: Ollama loads the model then; here it
    is always loaded."""
    body: dict[str, Any] = {"model": model, "created_at": now()}
    body |= {"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""}
    return body | {"done": True, "done_reason": "load"}


@dataclass
class OllamaRenderer:
    """Builds the objects of one chat (`message`) or generate (`response`) answer. model: the name the request
    used (Ollama echoes it). show_thinking: a reasoning model's thinking goes to `thinking` (else it is dropped:
    `think: false`). context: generate's final `context`, from the prompt's ids and the answer's text (None: raw,
    which returns none, as Ollama)."""

    kind: Literal["chat", "generate"]
    model: str
    prompt_tokens: int
    timings: Timings
    show_thinking: bool = True
    prompt_ids: list[int] | None = None
    encode: Callable[[str], list[int]] | None = None
    eval_count: int = 0
    _calls: int = 0  # calls rendered so far: the next one's index
    _text: list[str] = field(default_factory=list)

    def _calls_json(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"id": call.id, "function": {"index": self._calls, "name": call.name,
                                                    "arguments": json.loads(call.arguments)}})
            self._calls += 1
        return out

    def _part(self, content: str, thinking: str, calls: list[ToolCall]) -> dict[str, Any]:
        """The answer's part: a chat's message or generate's response (and thinking)."""
        thinking = thinking if self.show_thinking else ""
        if self.kind == "generate":
            return {"response": content} | ({"thinking": thinking} if thinking else {})
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = self._calls_json(calls)
        return {"message": message}

    def _object(self, part: dict[str, Any], done: bool) -> dict[str, Any]:
        return {"model": self.model, "created_at": now(), **part, "done": done}

    def _final(self, part: dict[str, Any], last: ChatDelta) -> dict[str, Any]:
        body = self._object(part, True) | {"done_reason": done_reason(last.finish_reason)}
        body |= self.timings.durations() | {"prompt_eval_count": self.prompt_tokens, "eval_count": self.eval_count}
        if self.prompt_ids is not None and self.encode is not None:
            body["context"] = self.prompt_ids + self.encode("".join(self._text))
        if last.stats is not None:
            body["decoding"] = last.stats  # this server's statistics, as in the OpenAI routes' answers
        return body

    def _count(self, delta: ChatDelta) -> None:
        self.eval_count += delta.tokens
        self._text.append(delta.content)

    def chunks(self, delta: ChatDelta) -> list[dict[str, Any]]:
        """The stream's objects for one delta: its content, thinking or calls (none when it shows nothing), and
        after the last the `done` object, whose message is empty, as Ollama's."""
        self._count(delta)
        out = []
        if delta.content or (delta.reasoning and self.show_thinking) or delta.calls:
            out.append(self._object(self._part(delta.content, delta.reasoning, delta.calls), False))
        if delta.finish_reason is not None:
            out.append(self._final(self._part("", "", []), delta))
        return out

    def whole(self, deltas: list[ChatDelta]) -> dict[str, Any]:
        """The answer in one object (stream: false)."""
        for delta in deltas:
            self._count(delta)
        calls = [c for d in deltas for c in d.calls]
        content = "".join(d.content for d in deltas)
        if calls and not content.strip():
            content = ""
        return self._final(self._part(content, "".join(d.reasoning for d in deltas), calls), deltas[-1])


async def ndjson(deltas: AsyncGenerator[ChatDelta, None], renderer: OllamaRenderer) -> AsyncIterator[str]:
    """Ollama's stream framing: one JSON object a line; a fault after the status line was sent is a last line
    {"error": ...}, which Ollama's clients raise."""
    async with aclosing(deltas):
        try:
            async for delta in deltas:
                for obj in renderer.chunks(delta):
                    yield dumps(obj) + "\n"
                if delta.finish_reason is not None:
                    break
        except Exception as exc:
            if not isinstance(exc, APIError):
                log.exception("unexpected error in an Ollama %s stream", renderer.kind)
                exc = internal_error()
            yield dumps({"error": exc.message}) + "\n"
