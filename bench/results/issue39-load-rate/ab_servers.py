"""Two running servers side by side: each round, at each stream count, a burst (bench.concurrency.burst) of
every setup back to back; per setup the median aggregate tok/s, its ratio to the first setup's burst of the same
round (median, and each round's), the rows the server computed per generated token (its /metrics:
edgespec_step_rows over edgespec_generated_tokens_total, over the burst) and, where the server counts it, its
programs' CPU time per generated token (edgespec_program_seconds; "n/a" on servers older than the counter).

    python bench/results/issue39-load-rate/ab_servers.py 16,8,4 5 256 \\
        naive=http://127.0.0.1:8124=naive new=http://127.0.0.1:8124=speculative \\
        oldnaive=http://127.0.0.1:8125=naive old=http://127.0.0.1:8125=speculative
"""

import statistics
import sys
from pathlib import Path

import httpx

from edgespec.bench.concurrency import burst
from edgespec.bench.prompts import load_prompts


def counters(url: str) -> tuple[float, float, float | None]:
    """(rows computed, tokens generated, programs' CPU seconds or None) so far."""
    rows = tokens = 0.0
    program = None
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("edgespec_step_rows "):
            rows += float(line.split()[-1])
        elif line.startswith("edgespec_generated_tokens_total"):
            tokens += float(line.split()[-1])
        elif line.startswith("edgespec_program_seconds "):
            program = float(line.split()[-1])
    return rows, tokens, program


def main() -> None:
    counts = [int(x) for x in sys.argv[1].split(",")]
    rounds, max_tokens = int(sys.argv[2]), int(sys.argv[3])
    setups = [s.split("=") for s in sys.argv[4:]]  # name=url=policy
    prompts = load_prompts(Path(__file__).parents[3] / "../shared/data/prompts/vicuna80.jsonl", max(counts))
    res: dict[tuple[str, int], list] = {}
    for _ in range(rounds):
        for n in counts:
            for name, url, policy in setups:
                rows0, tokens0, program0 = counters(url)
                b = burst(url, "SmolLM2-135M-Instruct", prompts[:n], policy, max_tokens)
                rows1, tokens1, program1 = counters(url)
                tokens = tokens1 - tokens0
                program = None if program0 is None or program1 is None else (program1 - program0) / tokens
                res.setdefault((name, n), []).append((b["aggregate_decode_tokens_per_s"], (rows1 - rows0) / tokens,
                                                      [r["text"] for r in b["runs"]], program))
    for n in counts:
        base = res[(setups[0][0], n)]
        for name, _, policy in setups:
            v = res[(name, n)]
            ratios = [a[0] / b[0] for a, b in zip(v, base, strict=True)]
            same = all(x[2] == y[2] for x, y in zip(v, base, strict=True))
            programs = [a[3] for a in v if a[3] is not None]
            program = f"{statistics.median(programs) * 1e6:.1f} us" if programs else "n/a"
            print(f"{n} streams {name:10s} {policy:12s} median {statistics.median(a[0] for a in v):7.1f} tok/s  "
                  f"vs {setups[0][0]} {statistics.median(ratios):.3f} {[round(x, 3) for x in ratios]}  "
                  f"rows/token {statistics.median(a[1] for a in v):.3f}  program/token {program}  "
                  f"same text {same}", flush=True)


if __name__ == "__main__":
    main()
