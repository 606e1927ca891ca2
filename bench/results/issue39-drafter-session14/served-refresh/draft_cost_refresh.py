"""How many tokens to draft: the draft length that maximises expected tokens per second, from measured costs.

A verification pass of 1 + K tokens is not free on a CPU: on a 2-core EPYC with SmolLM2-135M in Q4_1 a pass
of 2 tokens cost 1.3-1.9x a single-token step and one of 6 about 3x (the int8 dot products grow with the
rows), and the EAGLE drafter costs about 1 ms per drafted token. On open chat, where its drafts are accepted
about 28% of the time, a fixed K made speculative decoding 0.7-0.9x as fast as naive decoding. So each step
chooses K (0 included: a plain single-token step) by

    rate(K) = E[tokens] / E[seconds] = (1 + a_1 + a_1 a_2 + ... + a_1 ... a_K) / (pass(1 + K) + K * draft)

with a_i the drafter's acceptance at depth i so far in this request (draft i kept given the ones before it),
pass(T) the measured seconds of a target pass of T tokens and draft the measured seconds per drafted token.
Which K is drafted never changes what is emitted: the rule stays exact.

Acceptance by depth, not one rate for all (a geometric count): n-gram lookup's drafts come in runs, right
throughout where the output copies a span and wrong from the first where it does not, so a draft kept makes the
next likelier. On copy-heavy prompts (bench/prompts/extraction20.jsonl, n-gram drafts, a 2-core Zen 5 EPYC, one
server, non-streamed) one rate (0.92) and up to 8 drafts gave 577 tokens/s where a fixed 12 gave 708; by depth,
up to 16, 744 and 861 in two runs (a fixed 12: 922 between them). The eagle drafter's rates fall with depth
instead (0.43, then 0.39 and 0.37 given the drafts before, on held-out chat). A depth seen rarely leans on the
rate over all depths (PRIOR_WEIGHT verifications' worth).
"""

from __future__ import annotations

import bisect

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0  # an unseen drafter counts as 2 drafts, one kept
PRIOR_SLOPE = 0.3  # an unmeasured pass size: each token beyond the first adds 30% of a single-token step
EMA = 0.2  # weight of a new measurement
PROBE_EVERY = 16  # steps that drafted nothing before one draft of one token re-measures the acceptance
REFRESH_EVERY = 16  # passes of other sizes before a plain step re-times the baseline (see PassCosts.stale)


class PassCosts:
    """Seconds per target pass by its token rows, every sequence's in the step (an average over recent passes);
    shared by the requests of one policy, since the cost is the model's and the machine's, not the prompt's."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.sizes: list[int] = []  # the measured sizes, ascending (each step's draft-length choice reads ~17)
        self.timed = 0  # passes observed
        self.last: dict[int, int] = {}  # size -> the count of passes observed when it was last timed

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        if old is None:
            bisect.insort(self.sizes, tokens)
        self.seconds[tokens] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        self.timed += 1
        self.last[tokens] = self.timed

    def stale(self, tokens: int) -> bool:
        """Whether REFRESH_EVERY passes were timed since a pass of `tokens` last was. The machine's speed drifts
        (a shared 2-core Xeon: plain passes 4.1-9.7 ms within one minute), and a size timed only long ago is
        weighed against sizes timed now: where one draft was kept 43% of the time, plain passes timed in a fast
        minute and passes of 2 rows in a slow one (4.8 and 7.7 ms, medians) kept the eagle drafter to 1.13-1.16
        tokens a step, against 1.43 with one draft every step; passes within 3 steps of each other were
        5.1 and 6.0 ms."""
        return tokens in self.last and self.timed - self.last[tokens] >= REFRESH_EVERY

    def get(self, tokens: int) -> float | None:
        """Measured seconds for a pass of `tokens`, else interpolated between the nearest measured sizes, else
        extrapolated from the largest one along the line through the smallest and the largest (PRIOR_SLOPE
        while only one size is measured); None before any pass was measured. The line, not a fixed slope: a
        size is measured only once it is drafted, and 0.3 of a step per row where a row costs 0.1-0.15 here
        (the 2-core Zen 5 EPYC: a pass of 9 rows about 2x one row) kept a fresh server's n-gram drafts at the
        lengths it had measured: 2.97x naive on copy-heavy prompts, against 3.6-3.7x once longer passes had
        been timed."""
        if tokens in self.seconds:
            return self.seconds[tokens]
        if not self.sizes:
            return None
        i = bisect.bisect(self.sizes, tokens)  # sizes[:i] are smaller
        if i == 0:
            return self.seconds[self.sizes[0]]
        lo = self.sizes[i - 1]
        if i < len(self.sizes):
            hi = self.sizes[i]
            return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (tokens - lo) / (hi - lo)
        first = self.sizes[0]
        slope = (self.seconds[lo] - self.seconds[first]) / (lo - first) if lo > first else \
            PRIOR_SLOPE * self.seconds[first]
        return self.seconds[lo] + (tokens - lo) * max(0.0, slope)


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
        self.idle: dict[str, int] = {}  # steps since this drafter last drafted
        # per drafter and depth i (from 1): verifications whose draft i was judged (drafts before it kept), and
        # of those, the ones that kept it; their sums are the drafts kept and the verifications that rejected one
        self.judged: dict[str, list[int]] = {}
        self.kept_at: dict[str, list[int]] = {}

    def acceptance(self, name: str) -> float:
        """The rate over all depths: each draft kept given the ones before it."""
        kept = sum(self.kept_at.get(name, []))
        rejected = sum(self.judged.get(name, [])) - kept
        return (kept + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (kept + rejected + PRIOR_WEIGHT)

    def acceptance_at(self, name: str, depth: int) -> float:
        """The rate at `depth` (from 1), drawn toward the rate over all depths where it was judged rarely."""
        return self._by_depth(name, depth)[depth - 1]

    def _by_depth(self, name: str, depths: int) -> list[float]:
        # the rates at depths 1..depths (acceptance_at's)
        overall = self.acceptance(name)
        judged, kept = self.judged.get(name, []), self.kept_at.get(name, [])
        return [(kept[i] + overall * PRIOR_WEIGHT) / (judged[i] + PRIOR_WEIGHT) if i < len(judged) else overall
                for i in range(depths)]

    def choose(self, name: str, budget: int, besides: int = 0) -> int:
        """Tokens to ask drafter `name` for (at most `budget`); besides: the other sequences' rows expected in
        the same step (a draft's rows lengthen a shared step for all of them)."""
        if self.fixed is not None:
            return min(self.fixed, budget)
        if self.passes.stale(besides + 1):
            return 0  # a plain step re-times the baseline every K is weighed against
        k = self.best(name, min(self.k_max, budget), besides)
        if k == 0 and budget > 0 and self.idle.get(name, 0) >= PROBE_EVERY:
            k = 1  # a stale low acceptance must not switch drafting off for good
        return k

    def best(self, name: str, k_max: int, besides: int = 0) -> int:
        if not self.passes.seconds:  # the process's first step
            return min(self.k_start, k_max)
        if besides + 1 not in self.passes.seconds:  # a plain step next: the baseline every K is weighed against
            return 0
        per_draft, rates = self.drafts.get(name), self._by_depth(name, k_max)
        best_k, best_rate, expected, reach = 0, 0.0, 0.0, 1.0
        for k in range(0, k_max + 1):
            if k:
                reach *= rates[k - 1]  # draft k kept: a_1 ... a_k
            expected += reach
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
        judged, kept = self.judged.setdefault(name, []), self.kept_at.setdefault(name, [])
        judged.extend([0] * (proposed - len(judged)))
        kept.extend([0] * (proposed - len(kept)))
        reached = min(proposed, accepted + 1)  # drafts 1..accepted kept, the next one judged and rejected
        for i in range(reached):
            judged[i] += 1
            kept[i] += i < accepted
