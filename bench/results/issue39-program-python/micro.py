"""What the speculative program's bookkeeping costs a step, in microseconds (medians of 7 timings of 20000 calls):
the draft-length choice (DraftLength.choose) for a drafter alone and beside 15 other sequences, an n-gram
lookup, and a feature drafter's copy of one hidden state with and without entering inference mode.

    python bench/results/issue39-program-python/micro.py
"""

import statistics
import time

import torch

from edgespec.decoding.draft_cost import DraftCosts, DraftLength, PassCosts
from edgespec.decoding.drafters import NgramDrafter


def timed(f, calls: int = 20000) -> float:
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return round(statistics.median(runs), 2)


passes = PassCosts()
for rows in (1, 2, 3, 4, 5, 9, 16, 17, 18, 20):  # a table like a served one's: each row 15% of a one-row pass
    passes.observe(rows, 0.004 * (1 + 0.15 * (rows - 1)))
drafts = DraftCosts()
drafts.observe("eagle", 1, 0.0008)
length = DraftLength(passes, drafts, 4, 0, 16)
for i in range(30):
    length.update("ngram", 4, i % 3)
    length.update("eagle", 2, i % 2)
tokens = list(range(100)) + [5, 6, 7] * 3 + list(range(200, 400))
lookup = NgramDrafter(3, 3)
lookup.propose(tokens, 4)
g = torch.zeros(500, 576)
with torch.inference_mode():
    hidden = torch.randn(1, 576)  # as the target's pass returns it


@torch.inference_mode()
def copy_in_inference_mode():
    g[100:101] = hidden


def copy():
    g[100:101] = hidden


print("choose, n-gram drafter alone:", timed(lambda: length.choose("ngram", 200)))
print("choose, eagle drafter alone:", timed(lambda: length.choose("eagle", 200)))
print("choose, n-gram drafter beside 15 sequences:", timed(lambda: length.choose("ngram", 200, 15, 15)))
print("n-gram lookup of 16 drafts:", timed(lambda: lookup.propose(tokens, 16)))
print("feature copy in inference mode:", timed(copy_in_inference_mode))
print("feature copy:", timed(copy))
