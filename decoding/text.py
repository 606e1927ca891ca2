"""From generated token ids to streamed text: incremental detokenisation, stop strings, stop tokens and
the token budget. Every policy feeds its accepted tokens through one of these, one token at a time, so a
stop string or max_tokens that falls inside a multi-token step is honoured exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pushed:
    """What one token added: visible text and, when the generation ends here, why."""

    text: str
    finish_reason: str | None = None


class TextStream:
    """Incremental detokeniser that holds back text which may still turn into a stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...], stop_token_ids: frozenset[int], max_tokens: int,
                 until=None):
        """until(stream), if given, is asked after every token (the stream's `finished` says whether it ended
        there anyway); True ends the generation at that token, with finish reason "length" (a budget shared
        with other streams: decoding/outline_points.py)."""
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = stop_token_ids
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # ids[_prefix_offset:_read_offset] were decoded already
        self._read_offset = 0
        self._held = ""  # decoded text not yet emitted (a possible start of a stop string)
        self.finished: str | None = None
        self.until = until

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self) -> str:
        # Decode a short window: tokens that merge across boundaries (bytes of one character, leading
        # spaces) decode right once their neighbours are there.
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def push(self, token_id: int) -> Pushed:
        """Add one generated token; returns the text that may be shown now and the finish reason."""
        pushed = self._push(token_id)
        if self.until is not None and self.until(self) and not pushed.finish_reason:
            return Pushed(pushed.text + self._finish("length", self._held + self._pending()).text, "length")
        return pushed

    def _push(self, token_id: int) -> Pushed:
        if self.finished:
            raise RuntimeError("push after the generation finished")
        if token_id in self.stop_token_ids:
            text = self._held + self._pending()  # the stop token's own text is not shown
            self.ids.append(token_id)
            return self._finish("stop", text)
        self.ids.append(token_id)
        self._held += self._new_text()
        hits = [at for s in self.stop if (at := self._held.find(s)) >= 0]
        if hits:  # cut at the earliest stop string, whichever of them it is
            return self._finish("stop", self._held[: min(hits)])
        if len(self.ids) >= self.max_tokens:
            return self._finish("length", self._held + self._pending())
        keep = self._stop_prefix_len(self._held)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return Pushed(out)

    def tail(self, n: int = 3) -> str:
        """The text of the last n tokens, whatever is held back (where a caller looks for a sentence end)."""
        return self._decode(self.ids[-n:])

    def _pending(self) -> str:
        """Text of tokens not yet emitted because they end inside a character (shown as-is at the end)."""
        window = self.ids[self._prefix_offset :]
        return self._decode(window)[len(self._decode(self.ids[self._prefix_offset : self._read_offset])) :]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        return max((partial_suffix(text, s) for s in self.stop), default=0)

    def _finish(self, reason: str, text: str) -> Pushed:
        self.finished = reason
        self._held = ""
        return Pushed(text, reason)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text to hold back: it may be the
    start of `tag`)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
