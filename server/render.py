"""Renders TokenEvents as OpenAI JSON: chat and text completions, whole or as stream chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from edgespec.decoding.types import TokenEvent, TokenLogprob


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
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
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
        """Chat streams open with the role; text completions have no such chunk."""
        if self.kind != "chat":
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, event: TokenEvent, include_usage: bool) -> dict | None:
        """The chunk for one event, or None when it carries nothing to show."""
        self.completion_tokens += len(event.token_ids)
        if not event.text and not event.finish_reason and self.top_logprobs is None:
            return None
        extra = {"usage": None} if include_usage else {}
        if event.stats is not None:
            extra["decoding"] = event.stats
        logprobs = self._logprobs(event.logprobs)
        if self.kind == "chat":
            delta = {"content": event.text} if event.text else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": event.finish_reason}
            return self._envelope("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason}
        return self._envelope("text_completion", [choice], **extra)

    def usage_chunk(self, stats: dict | None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        extra = {"decoding": stats} if stats else {}
        return self._envelope(obj, [], usage=usage(self.prompt_tokens, self.completion_tokens, stats), **extra)

    # whole responses

    def response(self, events: list[TokenEvent]) -> dict:
        text = "".join(e.text for e in events)
        n = sum(len(e.token_ids) for e in events)
        last = events[-1]
        logprobs = self._logprobs([lp for e in events for lp in e.logprobs])
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": last.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            obj = "text_completion"
        return self._envelope(obj, [choice], usage=usage(self.prompt_tokens, n, last.stats), decoding=last.stats)
