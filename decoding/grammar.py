"""Grammar-constrained decoding: a per-sequence token mask applied in the sampling step (llguidance).

Every policy samples through its request's Sampler (decoding/sampling.py), so a mask there constrains them
all alike: naive's token, speculative's target distributions and Medusa's tree descent all see the masked
logits. The matcher advances only on tokens that are accepted (Sampler.observe), so a draft the target
rejects never enters it and nothing has to be rolled back; a draft the grammar forbids has probability 0
under the masked target and is rejected by the acceptance rule like any other.

Costs measured on this machine's class (../shared/notes/tools.md): a mask 3.5-7.6 µs median, a grammar compiled
in 0.3-8 ms; the mask is applied with numpy (unpackbits and a where, about 0.2 ms, on the calling thread)
rather than llguidance.torch, whose torch.compile spent 9.9 s in gcc at its first call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch


class GrammarError(ValueError):
    """A grammar that does not compile, or a token the grammar does not allow."""


class Grammars:
    """Compiles grammars for one tokenizer. Its llguidance tokenizer (the vocabulary as byte strings) is built
    at the first grammar, not at start-up: 1.5 s for SmolLM2's 49,152 tokens, which a server that never sees
    a structured request need not spend."""

    # Grammars checked lately, by text: a client sends the same tools with every request (Home Assistant's six
    # tools make 8 grammars a request, one per tool for the route, each with every tool: 12-16 ms each to check).
    CACHED = 256

    def __init__(self, tokenizer, vocab_size: int):
        """tokenizer: the served model's Hugging Face tokenizer; vocab_size: the model's logits' width."""
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._checked: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()  # requests compile on threads of their own

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once, whichever request's thread gets here first
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(self._hf)
            return self._ll

    def compile(self, lark: str) -> Grammar:
        """A grammar in llguidance's lark dialect, checked; GrammarError says what is wrong with it."""
        with self._lock:
            grammar = self._checked.get(lark)
            if grammar is not None:
                self._checked.move_to_end(lark)
                return grammar
        # against the vocabulary too: a grammar that fails is the request's error, not a step's
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(lark, self.tokenizer)
        if failed:
            raise GrammarError("; ".join(messages) or "the grammar does not compile")
        grammar = Grammar(lark, self.tokenizer, self.vocab_size)
        with self._lock:
            self._checked[lark] = grammar
            if len(self._checked) > self.CACHED:
                self._checked.popitem(last=False)
        return grammar


@dataclass(frozen=True)
class Grammar:
    """A compiled-checked grammar; each sequence decoding under it gets a Constraint of its own."""

    text: str
    tokenizer: llguidance.LLTokenizer
    vocab_size: int

    def constraint(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """One sequence's place in a grammar: which tokens may come next, advanced token by token."""

    def __init__(self, grammar: Grammar):
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.vocab_size = grammar.vocab_size
        self._bits = llguidance.numpy.allocate_token_bitmask(1, grammar.tokenizer.vocab_size)  # int32 [1, V/32]
        self._allowed: np.ndarray | None = None  # bool [V] for the current state, built when first asked

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 -> logits [V] with the tokens the grammar forbids at -inf.

        In numpy, on the calling thread: a torch op this size is split over the process's threads, and while
        another process holds a core each such op waits for it (measured with a busy core: the bitmask's
        conversion and masked_fill 15.6 and 24.0 ms with 2 torch threads, 0.04 and 0.18 ms in one)."""
        out = np.where(self._allowed_now(), logits.numpy(), np.float32("-inf"))
        return torch.from_numpy(out)

    def _allowed_now(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next (only the end-of-sequence token once it is complete)."""
        if self._allowed is None:
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bits, 0)
            bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little").astype(bool)
            allowed = np.zeros(self.vocab_size, dtype=bool)
            n = min(len(bits), self.vocab_size)  # a vocabulary padded past the tokenizer's: never allowed
            allowed[:n] = bits[:n]
            self._allowed = allowed
        return self._allowed

    def consume(self, token: int) -> None:
        """Advance past an accepted token; a token the grammar forbids is a bug of the caller's."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: {self.matcher.get_error()}")
        self._allowed = None
