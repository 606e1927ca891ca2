"""Speculative decoding: a drafter proposes K tokens, one forward pass of the target verifies them all, the
acceptance rule (decoding/verify.py) keeps a prefix plus one token, and the rejected positions are rolled
back on every stage. Exact: the output is distributed as naive decoding's (greedy: the same tokens).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from edgespec.decoding.draft_cost import DraftCosts, DraftLength, PassCosts, prior_costs
from edgespec.decoding.drafters import Drafter, DraftSource, NgramDrafter
from edgespec.decoding.sampling import Sampler
from edgespec.decoding.sequence import Prepared, run_alone, start
from edgespec.decoding.stats import StepStats, push_run
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.decoding.verify import verify
from edgespec.engine.engine import Engine
from edgespec.engine.program import Rows, SequenceView, Truncate
from edgespec.model.config import ModelConfig


class SpeculativePolicy:
    name = "speculative"
    options = frozenset({"drafter", "k"})
    lane = "layers"  # the engine's lane its jobs run on

    def __init__(self, models: dict[str, DraftSource] | None = None, default: str | None = None, k: int = 4,
                 k_min: int = 0, k_max: int = 16):
        """models: DraftModels or FeatureDraftModels by drafter name (draft checkpoints, layer-skipping
        self-drafts, trained feature drafters); default: the drafter of the plain `speculative` policy (the
        first model's behind n-gram lookup, NAME+ngram: the best measured on open chat and on copying alike;
        without models, n-gram lookup). k: the draft length before any pass was timed; then each step
        chooses it in k_min..k_max by measured cost (decoding/draft_cost.py)."""
        self.k, self.k_min, self.k_max = k, k_min, k_max
        self.passes, self.draft_costs = PassCosts(), DraftCosts()
        # a drafter name -> the drafters a request asks in turn, first with drafts wins
        self.drafters: dict[str, Callable[[SamplingParams, int], list[Drafter]]] = {
            "ngram": lambda params, capacity: [NgramDrafter()]}
        for name, m in (models or {}).items():
            self.drafters[name] = functools.partial(_model_drafts, m)
            self.drafters[f"{name}+ngram"] = functools.partial(_copies_then_model_drafts, m)
        self.default = default or (f"{next(iter(models))}+ngram" if models else "ngram")
        if self.default not in self.drafters:
            raise ValueError(f"unknown default drafter {self.default!r}; available: {', '.join(self.drafters)}")

    def check(self, options: dict) -> None:
        """Raise ValueError for option values this policy cannot use."""
        name = options.get("drafter", self.default)
        if name not in self.drafters:
            raise ValueError(f"unknown drafter {name!r}; available: {', '.join(sorted(self.drafters))}")
        k = options.get("k", self.k)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"k must be an integer from 1 to 32, got {k!r}")

    def capacity(self, request: GenerationRequest, cfg: ModelConfig) -> int:
        # the verification's 1 + K slots must fit after the last token
        return min(len(request.prompt_ids) + request.max_tokens + max(self.k_max, request.policy_options.get("k", 0)),
                   cfg.max_position_embeddings)

    def generate(self, request: GenerationRequest, engine: Engine, tokenizer):
        return run_alone(self, request, engine, tokenizer)

    def prepare(self, request: GenerationRequest, cfg: ModelConfig, seq: SequenceView, text: TextStream
                ) -> Prepared:
        options = request.policy_options
        # Built on the model thread: a drafter allocates tensors, and one parallel op on the event loop's thread
        # gives the process a second OpenMP team that then competes with the model thread's for the cores
        # (measured: naive decoding fell from 39 to 23 tokens/s for the rest of the process's life).
        name = options.get("drafter", self.default)
        chain = self.drafters[name](request.sampling, seq.capacity)
        observe = next((d.observe for d in chain if d.reads_features), None)  # reads the target's features
        seeded = request.sampling.seed is not None and not request.sampling.greedy
        costs = prior_costs() if seeded else (self.passes, self.draft_costs)  # seeded: the same K every time
        length = DraftLength(*costs, self.k, self.k_min, max(self.k_max, options.get("k", 0)), options.get("k"))
        sampler, stats = start(self.name, request, cfg, seq)
        stats.drafter = name
        program = self.program(request, seq, chain, observe, seeded, length, sampler, text, stats)
        return Prepared(program, stats)

    def program(self, request: GenerationRequest, seq: SequenceView, chain: list[Drafter], observe, seeded: bool,
                length: DraftLength, sampler: Sampler, text: TextStream, stats: StepStats):
        """The engine's program: the prompt, then per step the last token and the drafts (its plan), verified
        by the acceptance rule, the rejected slots truncated (its accept)."""
        prompt, want_logprobs = request.prompt_ids, request.sampling.logprobs
        cached = seq.length
        out = yield Rows(prompt[cached:], last_only=True, features=observe is not None)
        if observe:
            # seeded: the prompt's last feature alone, whatever the prefix cache held: a feature drafter that saw
            # more of the prompt on a cold cache drafts other tokens than on a warm one, and at temperature > 0
            # other drafts draw the seed's randomness otherwise (the same seeded request gave two answers)
            first = len(prompt) - 1 if seeded else cached
            observe(first, out.hidden[0, first - cached:])
        step = [sampler.choose_with_logprob(out.logits[0, -1])]
        tokens, besides = list(prompt), 0
        while True:
            emitted = [t for t, _ in step]
            tokens += emitted
            event = push_run(text, step, stats, seq.wire())
            yield event
            if event.finish_reason:
                return
            # the verification adds one token of its own, and its 1 + K slots must fit the cache
            budget = min(request.max_tokens - len(text.ids), seq.capacity - seq.length) - 1
            # Beside other sequences a model drafter's work runs alone between the shared steps (measured: 4
            # speculative streams 0.917x one stream's aggregate speed, naive ones 1.589x): draft only by lookup
            # then, and weigh K by the step's tokens, every sequence's (draft_cost.py). Not for seeded sampling,
            # whose answer must not depend on the load.
            others = 0 if seeded else seq.others_running()
            drafter, drafts, q = self._draft(chain, length, tokens, budget, stats, others, besides)
            start = seq.length
            out = yield Rows([emitted[-1], *drafts], features=observe is not None)
            verdict = verify(sampler, out.logits[0], drafts, q)  # logits [1, 1 + K, V]
            if observe:  # the accepted positions' hidden states [1 + accepted, H]
                observe(start, out.hidden[0, :1 + verdict.accepted])
            lps = [sampler.logprob(out.logits[0, j], t) if want_logprobs else None
                   for j, t in enumerate(verdict.tokens)]
            # what a step of that many rows costs here; the others' rows, what the next step will likely carry
            # (compute-bound here: 4 streams' extra rows cost about 2.5 ms each in a 19 ms step, so a draft
            # beside them pays only at high acceptance). Seeded sampling weighs K alone, whatever the load.
            # Steps whose every row had its logits only: a prompt's chunk beside the decoding rows has no head
            # rows and attends over a short prefix, and with such steps in the table larger passes looked cheaper
            # than smaller ones (16 n-gram streams' choices: a drafted row -1288 us against 590 without them,
            # 5397 rows drafted against 167; bench/results/issue39-prompt-rows). The others' rows: those with logits.
            if out.head_rows == out.rows:
                self.passes.observe(out.rows, out.seconds, out.number)
            besides = 0 if seeded else out.head_rows - (1 + len(drafts))
            if verdict.accepted < len(drafts):  # the rejected drafts' slots are written over next
                yield Truncate(start + 1 + verdict.accepted)
            stats.proposed += len(drafts)
            stats.accepted += verdict.accepted
            for d in chain:  # a drafter not asked drafted nothing this step
                length.update(d.name, len(drafts) if d is drafter else 0, verdict.accepted)
            step = list(zip(verdict.tokens, lps, strict=True))

    def _draft(self, chain: list[Drafter], length: DraftLength, tokens: list[int], budget: int, stats: StepStats,
               others: int = 0, besides: int = 0):
        """Ask the chain's drafters in turn for as many tokens as pays for each (possibly none): -> (the drafter
        whose drafts they are or None, drafts, their distributions [K, V] or None). others: the other sequences
        running (the drafters that compute on the model thread are skipped beside them), besides: their rows
        expected in the step."""
        for drafter in chain:
            if budget <= 0 or (others and drafter.on_model_thread):
                continue
            if drafter.on_model_thread:
                k = length.choose(drafter.name, budget, besides, others)
                if k == 0:
                    continue
                t0 = time.perf_counter()
                drafts, q = drafter.propose(tokens, k)  # on the model thread, in the program
                seconds = time.perf_counter() - t0
            else:
                # A lookup costs the same for any K (about a microsecond), so it goes first and K is chosen only
                # where it found drafts: most steps of open chat find none, and the choice costs 7-9 us
                # (bench/results/issue39-program-python). The drafts are a prefix of the longest lookup's.
                t0 = time.perf_counter()
                found, q = drafter.propose(tokens, min(length.k_max, budget))
                seconds = time.perf_counter() - t0
                k = length.choose(drafter.name, len(found), besides, others) if found else 0
                drafts, q = found[:k], None if q is None else q[:k]
            stats.drafter_s += seconds
            self.draft_costs.observe(drafter.name, k, seconds)
            if drafts:
                return drafter, drafts, q
        return None, [], None


def _model_drafts(model: DraftSource, params: SamplingParams, capacity: int) -> list[Drafter]:
    return [model.drafter(params, capacity)]


def _copies_then_model_drafts(model: DraftSource, params: SamplingParams, capacity: int) -> list[Drafter]:
    # n-gram lookup where the output is copying from earlier text (the last 3 tokens occurred before), else the
    # model's drafts
    return [NgramDrafter(max_n=3, min_n=3), model.drafter(params, capacity)]
