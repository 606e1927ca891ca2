"""A shared n-gram pool replayed against the eagle drafter on the served greedy answers to vicuna80's prompts 0-39
(128 tokens: the benchmark's open chat). The pool holds every n-gram (n = 1..8) of the served answers to the
training prompts (served_answers.py) with the counts of what followed it; with --online, each vicuna answer is
added after its own positions are replayed (a server that learns from what it serves, each prompt seen once).
At each answer position it looks up the longest n >= 2 ending there (in the answer so far) and proposes the most
frequent follower. Printed: its first-draft accuracy against eagle's at the same positions by match length, the
follower's count and its share of the followers, and over all positions how often the pool is right where eagle
is wrong (what a second branch beside eagle's draft could add at depth 1).

    python bench/results/issue39-ngram-pool/pool_replay.py [--online] > bench/results/issue39-ngram-pool/pool_replay.txt
"""

import collections
import json
import pickle
import sys

from served_answers import WORK

MAXN = 8


class Pool:
    def __init__(self, rows: list[dict]):
        self.t: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
        for r in rows:
            self.add(r["answer"])

    def add(self, ids: list[int]) -> None:
        for e in range(1, len(ids)):
            for n in range(1, min(MAXN, e) + 1):
                self.t[tuple(ids[e - n:e])][ids[e]] += 1

    def look(self, ctx: list[int], nmin: int) -> tuple[int, int, int, int] | None:
        # (the follower, n, its count, all followers' count) for the longest n-gram ending ctx, n >= nmin
        for n in range(min(MAXN, len(ctx)), nmin - 1, -1):
            c = self.t.get(tuple(ctx[-n:]))
            if c:
                tok, cnt = c.most_common(1)[0]
                return tok, n, cnt, sum(c.values())
        return None


def main() -> None:
    online = "--online" in sys.argv
    corpus = [json.loads(line) for line in (WORK / "corpus256.jsonl").read_text().splitlines()]
    answers = pickle.loads((WORK / "eagle.pkl").read_bytes())[:40]  # eagle_positions.py's
    positions = sum(len(o["eagle"]) for o in answers)
    right = sum(t == truth for o in answers for (t, _), truth in zip(o["eagle"], o["ids"][o["start"]:], strict=True))
    print(f"{len(corpus)} corpus answers, {sum(len(r['answer']) for r in corpus)} tokens; online: {online}")
    print(f"vicuna 0-39: {positions} positions, eagle's first draft right {right / positions:.3f}")
    for nmin in (2, 3, 4, 5):
        pool = Pool(corpus)
        buckets: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        found = differ = rescue = 0
        for o in answers:
            ids, start = o["ids"], o["start"]
            for (e_tok, _), pos in zip(o["eagle"], range(start, len(ids)), strict=True):
                hit = pool.look(ids[start:pos], nmin)
                if hit is None:
                    continue
                tok, n, cnt, total = hit
                found += 1
                differ += tok != e_tok
                rescue += tok == ids[pos] != e_tok
                if nmin == 2:
                    share = ">=0.8" if cnt >= 0.8 * total else ">=0.5" if cnt >= 0.5 * total else "<0.5"
                    b = buckets[(min(n, 5), "count>=4" if cnt >= 4 else "count<4", "share" + share)]
                    b[0], b[1], b[2] = b[0] + 1, b[1] + (tok == ids[pos]), b[2] + (e_tok == ids[pos])
            if online:
                pool.add(ids[start:])
        if nmin == 2:
            print("match n (5: 5 or more), follower's count, its share: positions, pool right, eagle right there")
            for key in sorted(buckets):
                n, p, e = buckets[key]
                if n >= 10:
                    print(f"  {key}: {n}, pool {p / n:.3f}, eagle {e / n:.3f}")
        print(f"n >= {nmin}: a draft at {found} positions, {differ} unlike eagle's; right where eagle is wrong at "
              f"{rescue} ({rescue / positions:.4f} of all positions)")


if __name__ == "__main__":
    main()
