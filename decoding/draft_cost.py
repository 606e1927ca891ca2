"""How many tokens to draft: the draft length that maximises expected tokens per second, from measured costs.

A verification pass of 1 + K tokens is not free on a CPU: on a 2-core EPYC with SmolLM2-135M in Q4_1 a pass
of 2 tokens cost 1.3-1.9x a single-token step and one of 6 about 3x (the int8 dot products grow with the
rows), and the EAGLE drafter costs about 1 ms per drafted token. On open chat, where its drafts are accepted
about 28% of the time, a fixed K made speculative decoding 0.7-0.9x as fast as naive decoding. So each step
chooses K (0 included: a plain single-token step) by

    rate(K) = E[tokens] / E[seconds] = (1 + a + ... + a^K) / (pass(1 + K) + K * draft)

with a the drafter's acceptance per token so far in this request (each draft kept given the ones before it,
so the kept count is geometric), pass(T) the measured seconds of a target pass of T tokens and draft the
measured seconds per drafted token. Which K is drafted never changes what is emitted: the rule stays exact.
"""

from __future__ import annotations

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0  # an unseen drafter counts as 2 drafts, one kept
PRIOR_SLOPE = 0.3  # an unmeasured pass size: each token beyond the first adds 30% of a single-token step
EMA = 0.2  # weight of a new measurement
PROBE_EVERY = 16  # steps that drafted nothing before one draft of one token re-measures the acceptance


class PassCosts:
    """Seconds per target pass by its token rows, every sequence's in the step (an average over recent passes);
    shared by the requests of one policy, since the cost is the model's and the machine's, not the prompt's."""

    def __init__(self):
        self.seconds: dict[int, float] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def get(self, tokens: int) -> float | None:
        """Measured seconds for a pass of `tokens`, else interpolated between the nearest measured sizes, else
        extrapolated from the largest smaller one; None before any pass was measured."""
        if tokens in self.seconds:
            return self.seconds[tokens]
        below = [t for t in self.seconds if t < tokens]
        above = [t for t in self.seconds if t > tokens]
        if below and above:
            lo, hi = max(below), min(above)
            return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (tokens - lo) / (hi - lo)
        if below:
            lo = max(below)
            return self.seconds[lo] + (tokens - lo) * PRIOR_SLOPE * self.seconds[min(self.seconds)]
        if above:
            return self.seconds[min(above)]
        return None


class DraftCosts:
    """One drafter's measured seconds per drafted token, shared like PassCosts."""

    def __init__(self):
        self.per_token: dict[str, float] = {}

    def observe(self, name: str, drafted: int, seconds: float) -> None:
        if drafted:
            old = self.per_token.get(name)
            new = seconds / drafted
            self.per_token[name] = new if old is None else (1 - EMA) * old + EMA * new

    def get(self, name: str) -> float:
        return self.per_token.get(name, 0.0)


def prior_costs() -> tuple[PassCosts, DraftCosts]:
    """Costs that depend on nothing measured. A seeded sampled request must draft the same K at the same step
    every time it is sent (a different K draws its randomness differently, so the answer would change), and
    measured costs differ from run to run; it weighs K by these instead, and by its own acceptance."""
    passes = PassCosts()
    passes.observe(1, 1.0)
    return passes, DraftCosts()


class DraftLength:
    """One request's choice of K per drafter: the acceptance it has seen from each, the shared costs, and
    K's bounds: k_start before any pass was measured, k_min..k_max after. fixed: a request's own `k`."""

    def __init__(self, passes: PassCosts, drafts: DraftCosts, k_start: int, k_min: int, k_max: int,
                 fixed: int | None = None):
        self.passes, self.drafts, self.fixed = passes, drafts, fixed
        self.k_start, self.k_min, self.k_max = k_start, k_min, k_max
        self.kept: dict[str, int] = {}
        self.rejected: dict[str, int] = {}  # verifications that rejected a draft of this drafter
        self.idle: dict[str, int] = {}  # steps since this drafter last drafted

    def acceptance(self, name: str) -> float:
        kept, rejected = self.kept.get(name, 0), self.rejected.get(name, 0)
        return (kept + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (kept + rejected + PRIOR_WEIGHT)

    def choose(self, name: str, budget: int, besides: int = 0) -> int:
        """Tokens to ask drafter `name` for (at most `budget`); besides: the other sequences' rows expected in
        the same step (a draft's rows lengthen a shared step for all of them)."""
        if self.fixed is not None:
            return min(self.fixed, budget)
        k = self.best(name, min(self.k_max, budget), besides)
        if k == 0 and budget > 0 and self.idle.get(name, 0) >= PROBE_EVERY:
            k = 1  # a stale low acceptance must not switch drafting off for good
        return k

    def best(self, name: str, k_max: int, besides: int = 0) -> int:
        if not self.passes.seconds:  # the process's first step
            return min(self.k_start, k_max)
        if besides + 1 not in self.passes.seconds:  # a plain step next: the baseline every K is weighed against
            return 0
        a, per_draft = self.acceptance(name), self.drafts.get(name)
        best_k, best_rate, expected = 0, 0.0, 0.0
        for k in range(0, k_max + 1):
            expected += a ** k  # 1 + a + ... + a^k
            seconds = self.passes.get(besides + 1 + k)
            assert seconds is not None  # a pass was measured (above)
            rate = expected / (seconds + k * per_draft)
            if rate > best_rate and k >= min(self.k_min, k_max):
                best_k, best_rate = k, rate
        return best_k

    def update(self, name: str, proposed: int, accepted: int) -> None:
        """After a verification of `proposed` drafts from `name`, `accepted` of them kept."""
        if proposed == 0:
            self.idle[name] = self.idle.get(name, 0) + 1
            return
        self.idle[name] = 0
        self.kept[name] = self.kept.get(name, 0) + accepted
        if accepted < proposed:
            self.rejected[name] = self.rejected.get(name, 0) + 1
