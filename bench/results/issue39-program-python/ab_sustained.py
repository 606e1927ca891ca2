"""Two running servers side by side under steady use (bench.concurrency.sustained, 256 tokens a request): each
round, at each count, every setup's window in turn (the order reversed every other round); per setup the median
tokens/s, its ratio to the first setup's window of the same round (median, and each round's) and the median of
the windows' median times to first token.

    python bench/results/issue39-program-python/ab_sustained.py 16 6 12 \\
        old=http://127.0.0.1:8124=naive fill=http://127.0.0.1:8125=naive
"""

import statistics
import sys
from pathlib import Path

from edgespec.bench.concurrency import sustained
from edgespec.bench.prompts import load_prompts


def main() -> None:
    counts = [int(x) for x in sys.argv[1].split(",")]
    rounds, seconds = int(sys.argv[2]), float(sys.argv[3])
    setups = [a.split("=") for a in sys.argv[4:]]  # name=url=policy
    prompts = load_prompts(Path(__file__).parents[3] / "../shared/data/prompts/vicuna80.jsonl")
    windows: dict[tuple[int, str], list[dict]] = {}
    for r in range(rounds):
        for n in counts:
            for name, url, policy in setups if r % 2 == 0 else setups[::-1]:
                out = sustained(url, "SmolLM2-135M-Instruct", prompts, n, policy, 256, seconds)
                windows.setdefault((n, name), []).append(out)
                print(r, n, name, out, flush=True)
    base = setups[0][0]
    for n in counts:
        for name, _, _ in setups:
            runs = windows[(n, name)]
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs, windows[(n, base)], strict=True)]
            print(f"{n} streams {name:8s} median {statistics.median(x['tokens_per_s'] for x in runs):8.1f} tok/s  "
                  f"vs {base} {statistics.median(ratios):.3f} {[round(x, 3) for x in ratios]}  "
                  f"median ttft {statistics.median(x['median_ttft_ms'] for x in runs)} ms")


if __name__ == "__main__":
    main()
