"""Renders a generation's ChatDeltas as OpenAI JSON: chat and text completions, whole or as stream chunks, with
the calls a chat answer made (tool_calls, or the legacy function_call)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from edgespec.decoding.types import TokenLogprob
from edgespec.server.chat_input import ChatDelta, ToolCall
from edgespec.server.tool_output import content_or_none


def _byte_decoder(tokenizer) -> dict[str, int] | None:
    """Map from byte-level BPE symbols to bytes, for tokenizers whose decoder is ByteLevel."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def usage(prompt_tokens: int, completion_tokens: int, stats: dict | None = None) -> dict:
    cached = (stats or {}).get("cached_prompt_tokens") or 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class Renderer:
    """Builds the objects of one response; every chunk of a stream shares `id` and `created`."""

    kind: str  # "chat" or "text"
    model: str
    tokenizer: object
    prompt_tokens: int
    top_logprobs: int | None = None  # None: no logprobs requested
    legacy: bool = False  # calls asked through the legacy `functions`: answered as function_call
    echo: str | None = None  # a text completion's `echo`: the prompt's text, shown before the completion
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    _calls: int = 0  # tool calls streamed so far: the next one's index
    _text_offset: int = 0
    _byte_of: dict | None = None  # byte-level BPE symbol -> byte, built on first use

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: for a byte-level BPE token that ends inside a character, the partial
        bytes (its decoded text would only be a replacement character)."""
        if self._byte_of is None:
            self._byte_of = _byte_decoder(self.tokenizer) or {}
        byte_of = self._byte_of
        if byte_of:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(ch in byte_of for ch in piece):
                return [byte_of[ch] for ch in piece]
        return list(self._token_text(token_id).encode())

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def one(token_id: int, lp: float) -> dict:
            return {"token": self._token_text(token_id), "logprob": lp, "bytes": self._token_bytes(token_id)}

        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def _text_logprobs(self, entries: list[TokenLogprob]) -> dict:
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.top_logprobs is None:
            return None
        return self._chat_logprobs(entries) if self.kind == "chat" else self._text_logprobs(entries)

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    # streaming

    def first_chunk(self) -> dict | None:
        """Chat streams open with the role; text completions with the prompt when it is echoed, else nothing."""
        if self.kind != "chat":
            if self.echo is None:
                return None
            choice = {"index": 0, "text": self.echo, "logprobs": None, "finish_reason": None}
            return self._envelope("text_completion", [choice])
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def _call_deltas(self, calls: list[ToolCall]) -> list[dict]:
        # Each call in two deltas, its name then its arguments, as OpenAI streams them: clients join a call's
        # argument fragments by index (the legacy function_call has no index: one call only)
        out = []
        for call in calls:
            if self.legacy:
                out += [{"function_call": {"name": call.name, "arguments": ""}},
                        {"function_call": {"arguments": call.arguments}}]
                continue
            index, self._calls = self._calls, self._calls + 1
            out += [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]},
                    {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
        return out

    def chunks(self, delta: ChatDelta, include_usage: bool) -> list[dict]:
        """The chunks for one delta (none when it carries nothing to show); the finish reason and the
        statistics go on the last."""
        self.completion_tokens += delta.tokens
        extra = {"usage": None} if include_usage else {}
        logprobs = self._logprobs(delta.logprobs)
        if self.kind != "chat":
            if not delta.content and not delta.finish_reason and self.top_logprobs is None:
                return []
            choice = {"index": 0, "text": delta.content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
            return [self._envelope("text_completion", [choice], **extra, **self._stats(delta))]
        deltas = (([{"reasoning_content": delta.reasoning}] if delta.reasoning else [])
                  + ([{"content": delta.content}] if delta.content else []) + self._call_deltas(delta.calls))
        if not deltas and (delta.finish_reason or self.top_logprobs is not None):
            deltas.append({})  # the finish reason (or the logprobs of tokens that show nothing yet) alone
        out = []
        for i, d in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = {"index": 0, "delta": d, "logprobs": logprobs if i == 0 else None,
                      "finish_reason": delta.finish_reason if last else None}
            out.append(self._envelope("chat.completion.chunk", [choice], **extra,
                                      **(self._stats(delta) if last else {})))
        return out

    @staticmethod
    def _stats(delta: ChatDelta) -> dict:
        return {"decoding": delta.stats} if delta.stats is not None else {}

    def usage_chunk(self, stats: dict | None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        extra = {"decoding": stats} if stats else {}
        return self._envelope(obj, [], usage=usage(self.prompt_tokens, self.completion_tokens, stats), **extra)

    # whole responses

    def response(self, deltas: list[ChatDelta]) -> dict:
        text = "".join(d.content for d in deltas)
        n = sum(d.tokens for d in deltas)
        last = deltas[-1]
        logprobs = self._logprobs([lp for d in deltas for lp in d.logprobs])
        if self.kind != "chat":
            choice = {"index": 0, "text": (self.echo or "") + text, "logprobs": logprobs,
                      "finish_reason": last.finish_reason}
            return self._envelope("text_completion", [choice], usage=usage(self.prompt_tokens, n, last.stats),
                                  decoding=last.stats)
        calls = [c for d in deltas for c in d.calls]
        message = {"role": "assistant", "content": text if not calls else content_or_none(text)}
        if reasoning := "".join(d.reasoning for d in deltas):  # a reasoning model's thinking (server/reasoning.py)
            message["reasoning_content"] = reasoning
        if calls and self.legacy:
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": last.finish_reason}
        return self._envelope("chat.completion", [choice], usage=usage(self.prompt_tokens, n, last.stats),
                              decoding=last.stats)
