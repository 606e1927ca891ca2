"""Turning logits into the distribution a request samples from, and sampling it.

The order of operations (fixed, shared by every policy so that exact policies sample the same distribution
as naive): logit_bias, the repetition penalty and presence/frequency penalties over the tokens generated so far
(llama.cpp's order), the grammar's mask
(decoding/grammar.py: tokens it forbids get -inf), then temperature, top_k, top_p, min_p, renormalise.
Temperature 0 is the point mass on the argmax of the biased, penalised, masked logits.
"""

from __future__ import annotations

import torch

from edgespec.decoding.grammar import Grammar
from edgespec.decoding.types import SamplingParams, TokenLogprob


class Sampler:
    """Per-request sampling state: the seeded generator and the counts the penalties need."""

    def __init__(self, params: SamplingParams, vocab_size: int, grammar: Grammar | None = None):
        """grammar: what the output must match; the sampler then keeps the sequence's place in it."""
        self.params = params
        self.constraint = grammar.constraint() if grammar is not None else None
        self.vocab_size = vocab_size
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        # [V] tokens generated so far, kept where a penalty reads them (an update is a torch op per token)
        penalized = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
        self.counts = torch.zeros(vocab_size, dtype=torch.float32) if penalized else None
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            for token, value in params.logit_bias.items():
                self.bias[token] = value

    def observe(self, token_id: int) -> None:
        """Record a generated token (for the penalties, and the grammar's place)."""
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.constraint is not None:
            self.constraint.consume(token_id)

    def adjusted_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 -> logits after bias, penalties and the grammar's mask [V]."""
        p = self.params
        if self.bias is not None:
            logits = logits + self.bias
        counts = self.counts
        if counts is not None and p.repetition_penalty != 1.0:
            # llama.cpp's (and Ollama's repeat_penalty): a seen token's logit is divided by the penalty when
            # positive, multiplied by it when negative, so it always loses ground
            seen = counts > 0
            logits = torch.where(seen & (logits > 0), logits / p.repetition_penalty,
                                 torch.where(seen, logits * p.repetition_penalty, logits))
        if counts is not None and (p.presence_penalty or p.frequency_penalty):
            logits = logits - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 -> the probability vector [V] this request samples the next token from."""
        p = self.params
        logits = self.adjusted_logits(logits)
        if p.greedy:
            out = torch.zeros_like(logits)
            out[int(logits.argmax())] = 1.0
            return out
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
            drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= p.top_p
            probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()

    def sample(self, probs: torch.Tensor) -> int:
        """Draw a token id from probs [V]."""
        if self.params.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def choose(self, logits: torch.Tensor) -> int:
        """Sample the next token from raw logits [V] and record it."""
        # greedy: the argmax of probs() (the first of equal maxima, as torch's), without building the one-hot
        # vector; numpy's took 4 us where torch's took 28 (49152 logits, a Zen 5 EPYC)
        greedy = self.params.greedy
        token = int(self.adjusted_logits(logits).numpy().argmax()) if greedy else self.sample(self.probs(logits))
        self.observe(token)
        return token

    def choose_with_logprob(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """choose(), plus the token's log-probability when the request asked for logprobs."""
        token = self.choose(logits)
        return token, self.logprob(logits, token) if self.params.logprobs else None

    def logprob(self, logits: torch.Tensor, token_id: int) -> TokenLogprob:
        """Log-probability of `token_id` and the top alternatives under the model's raw distribution."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
        top: tuple[tuple[int, float], ...] = ()
        if self.params.top_logprobs:
            values, ids = torch.topk(logp, self.params.top_logprobs)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token_id, float(logp[token_id]), top)
