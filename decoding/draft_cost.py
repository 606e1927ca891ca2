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

Beside other sequences a draft's rows lengthen the shared step for all of them, so the rate weighed is the
step's, every sequence's tokens over its seconds:

    rate(K) = (others + 1 + a_1 + ... + a_1 ... a_K) / (pass(besides + 1 + K) + K * draft)

with `others` the other sequences (a token each) and `besides` their rows. With a request's own rate alone
(the numerator without `others`) the default policy beside 15 other streams computed 1.356 rows per token it
made (naive: 1.09, the prompts' rows included) and made 0.714x naive's aggregate; weighing the step's (with
PassCosts' speed and DraftLength.could_pay, below), 1.0 rows and 0.889x (fresh servers, 256 tokens a stream:
bench/results/issue39-load-rate/ab_servers.txt).
"""

from __future__ import annotations

import bisect

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0  # an unseen drafter counts as 2 drafts, one kept
PRIOR_SLOPE = 0.3  # an unmeasured pass size: each token beyond the first adds 30% of a single-token step
EMA = 0.2  # weight of a new measurement
PROBE_EVERY = 16  # steps that drafted nothing before one draft of one token re-measures the acceptance


class PassCosts:
    """Seconds per target pass by its token rows, every sequence's in the step; shared by the requests of one
    policy, since the cost is the model's and the machine's, not the prompt's. Fed the steps whose every row had
    its logits (a prompt's chunk costs less a row: decoding/speculative.py).

    A pass's seconds are the machine's speed times the size's own cost (`shape`): every pass moves the speed,
    and a size's cost moves only by its ratio to the pass just before it of another size, the two timed a step
    apart. This machine's speed drifts by up to 2x within a minute and a size is timed only when a step has
    that many rows: with an average per size, the sizes timed in different minutes disagreed (one server's
    table: 19 rows 35.1 ms, 17 rows 39.8, bench/results/issue39-load-rate/passes-table.txt), and a draft looked
    cheap whenever its size had last been timed in a faster minute than the plain step's."""

    def __init__(self):
        self.shape: dict[int, float] = {}  # rows -> seconds at speed 1
        self.sizes: list[int] = []  # the measured sizes, ascending (each step's draft-length choice reads ~17)
        self.speed = 1.0
        self.last: tuple[int, float] | None = None  # the latest pass's (rows, seconds)
        self.number: int | None = None  # the latest pass's number, where given

    def measured(self, tokens: int | None = None) -> bool:
        """Whether a pass of `tokens` rows (any pass, for None) was timed."""
        return bool(self.shape) if tokens is None else tokens in self.shape

    def observe(self, tokens: int, seconds: float, number: int | None = None) -> None:
        """A pass of `tokens` rows took `seconds`; `number`: the engine's number of the pass, which every
        sequence in it observes: counted once (beside 15 other streams the speed's average otherwise moved 16
        times a pass, 97% of the way to the latest pass instead of 20%)."""
        if number is not None:
            if number == self.number:
                return
            self.number = number
        last, self.last = self.last, (tokens, seconds)
        if tokens not in self.shape:
            bisect.insort(self.sizes, tokens)
            self.shape[tokens] = seconds / self.speed if last is None else self.shape[last[0]] * seconds / last[1]
            return
        if last is not None and last[0] != tokens:  # its ratio to the pass before, both at one speed
            self.shape[tokens] += EMA * (self.shape[last[0]] * seconds / last[1] - self.shape[tokens])
        self.speed *= (seconds / (self.speed * self.shape[tokens])) ** EMA

    def get(self, tokens: int) -> float | None:
        """Seconds for a pass of `tokens` at the machine's present speed: its size's measured cost, else one
        interpolated between the nearest measured sizes, else extrapolated from the largest one along the line
        through the smallest and the largest (PRIOR_SLOPE while only one size is measured); None before any pass
        was measured. The line, not a fixed slope: a size is measured only once it is drafted, and 0.3 of a step
        per row where a row costs 0.1-0.15 here
        (the 2-core Zen 5 EPYC: a pass of 9 rows about 2x one row) kept a fresh server's n-gram drafts at the
        lengths it had measured: 2.97x naive on copy-heavy prompts, against 3.6-3.7x once longer passes had
        been timed."""
        if not self.sizes:
            return None
        return self.speed * self._shape(tokens)

    def _shape(self, tokens: int) -> float:
        if tokens in self.shape:
            return self.shape[tokens]
        i = bisect.bisect(self.sizes, tokens)  # sizes[:i] are smaller
        if i == 0:
            return self.shape[self.sizes[0]]
        lo = self.sizes[i - 1]
        if i < len(self.sizes):
            hi = self.sizes[i]
            return self.shape[lo] + (self.shape[hi] - self.shape[lo]) * (tokens - lo) / (hi - lo)
        first = self.sizes[0]
        slope = (self.shape[lo] - self.shape[first]) / (lo - first) if lo > first else PRIOR_SLOPE * self.shape[first]
        return self.shape[lo] + (tokens - lo) * max(0.0, slope)


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

    def choose(self, name: str, budget: int, besides: int = 0, others: int = 0) -> int:
        """Tokens to ask drafter `name` for (at most `budget`); besides: the other sequences' rows expected in
        the same step, others: how many sequences those are (a draft's rows lengthen a shared step for all of
        them, so the step's tokens are weighed, not this request's alone)."""
        if self.fixed is not None:
            return min(self.fixed, budget)
        k = self.best(name, min(self.k_max, budget), besides, others)
        if k == 0 and budget > 0 and self.idle.get(name, 0) >= PROBE_EVERY and self.could_pay(name, besides, others):
            k = 1  # a stale low acceptance must not switch drafting off for good
        return k

    def could_pay(self, name: str, besides: int = 0, others: int = 0) -> bool:
        """Whether one draft, were it always kept, would pay in the step (best's rate): where not even that
        pays, a probe of the acceptance costs the step for nothing. Beside 15 other streams each probed every
        PROBE_EVERY + 1 steps, so about every step carried a 17th row, and 17 rows cost a tile pass more than
        16 (29.5 against 39.8 ms in one server's table, bench/results/issue39-load-rate/passes-table.txt)."""
        plain, longer = self.passes.get(besides + 1), self.passes.get(besides + 2)
        if plain is None or longer is None:
            return True
        return (others + 2) / (longer + self.drafts.get(name)) > (others + 1) / plain

    def best(self, name: str, k_max: int, besides: int = 0, others: int = 0) -> int:
        if not self.passes.measured():  # the process's first step
            return min(self.k_start, k_max)
        if not self.passes.measured(besides + 1):  # a plain step next: the baseline every K is weighed against
            return 0
        per_draft, rates = self.drafts.get(name), self._by_depth(name, k_max)
        best_k, best_rate, expected, reach = 0, 0.0, float(others), 1.0
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
