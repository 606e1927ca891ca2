"""What the kernels' two threads do at the same moments of a batch step: reads `perf script -F tid,time,ip,sym`
of a `perf record -e cpu-clock -F 20000` of step_loop.py, keeps the last SECONDS, pairs each sample of the
calling thread (the most sampled) with the pool thread's (the next) within 30 us, and prints the shares of the
pairs by what each thread was in (AMX matmul, attention, the pool's wait for work, other), then what the calling
thread ran while the pool thread waited.

    perf script -i perf.data -F tid,time,ip,sym | python bench/results/issue39-step-threads/timeline.py SECONDS
"""

import bisect
import collections
import sys


def kind(sym: str) -> str:
    if "State_impl" in sym:  # the pool thread's loop: spinning or asleep in await(), between calls
        return "waiting"
    if "group_amx" in sym or "pair_words" in sym or "run_groups" in sym:
        return "matmul"
    if "attend" in sym:
        return "attention"
    return "other"


def main() -> None:
    seconds = float(sys.argv[1])
    samples = []
    for line in sys.stdin:
        parts = line.split(None, 3)
        if len(parts) == 4:
            samples.append((parts[0], float(parts[1].rstrip(":")), parts[3].strip()))
    caller, pool = (tid for tid, _ in collections.Counter(s[0] for s in samples).most_common(2))
    end = max(t for _, t, _ in samples)
    mine = [(t, s) for tid, t, s in samples if tid == caller and t > end - seconds]
    theirs = sorted((t, s) for tid, t, s in samples if tid == pool and t > end - seconds)
    times = [t for t, _ in theirs]
    pairs, while_waiting = collections.Counter(), collections.Counter()
    for t, sym in mine:
        i = bisect.bisect_left(times, t)
        near = [j for j in (i - 1, i) if 0 <= j < len(times) and abs(times[j] - t) < 30e-6]
        other = kind(theirs[near[0]][1]) if near else "unpaired"  # not running: asleep, or off its core
        pairs[(kind(sym), other)] += 1
        if other == "waiting":
            while_waiting[sym] += 1
    n = len(mine)
    print(f"{n} samples of the calling thread; (calling thread, pool thread): share %")
    for (a, b), v in pairs.most_common():
        print(f"  {a:10s} {b:10s} {100 * v / n:5.1f}")
    print("the calling thread while the pool thread waited: share % of all its samples")
    for sym, v in while_waiting.most_common(12):
        print(f"  {100 * v / n:5.2f} {sym[:110]}")


if __name__ == "__main__":
    main()
