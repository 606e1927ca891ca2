"""Finished Responses API conversations kept in memory for `previous_response_id`, least recently used first out.

Only the messages are kept (what the next turn's prompt needs), not the response objects: a continuation
re-renders its prompt from them. One event loop uses the store, so it has no lock.
"""

from __future__ import annotations

from collections import OrderedDict

from edgespec.server.chat_input import ChatInput, Message
from edgespec.server.errors import APIError


def conversation_after(chat: ChatInput, instructions: str | None, reply: Message) -> tuple[Message, ...]:
    """What a continuation of this response should see: the request's messages without the system message
    its `instructions` became (instructions do not carry over to the next response, per the API), then the
    reply (the assistant's text and calls, ResponsesRenderer.assistant_message())."""
    messages = chat.messages[1:] if instructions else chat.messages  # to_chat_input put them first
    return (*messages, reply)


class ResponseStore:
    """A bounded LRU map from response id to the conversation up to and including that response."""

    def __init__(self, max_entries: int = 256):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[Message, ...]] = OrderedDict()

    def put(self, response_id: str, messages: tuple[Message, ...]) -> None:
        """Keep the conversation of a finished response, forgetting the least recently used beyond the bound."""
        self._entries[response_id] = tuple(messages)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[Message, ...]:
        """The stored conversation; a 400 naming previous_response_id when it is unknown or was evicted."""
        try:
            messages = self._entries[response_id]
        except KeyError:
            raise APIError(400, f"previous response {response_id!r} was not found: this server keeps the last "
                                f"{self.max_entries} responses in memory", "previous_response_id",
                           "previous_response_not_found") from None
        self._entries.move_to_end(response_id)  # a conversation in use stays
        return messages

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries
