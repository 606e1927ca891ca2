"""Time to first token of two running servers, alternated request by request: each request a prompt of N words
that no earlier request began with (its first word is a fresh number, so no prefix cache helps), one token out,
non-streamed; per server and N the median of the rounds, and the ratio of the two medians.

    python bench/results/issue39-serial-work/ttft_ab.py 30,100 8 new=http://127.0.0.1:8124 old=http://127.0.0.1:8125
"""

import statistics
import sys
import time

import httpx


def ttft_ms(url: str, words: int) -> tuple[int, float]:
    """(prompt tokens, milliseconds) of one request whose prompt starts with a fresh number."""
    prompt = f"{time.time_ns()} " + " ".join(f"w{i}" for i in range(words))
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                  "max_tokens": 1, "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"], (time.perf_counter() - start) * 1000


def main() -> None:
    sizes, rounds = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2])
    servers = [s.split("=", 1) for s in sys.argv[3:]]  # name=url
    for words in sizes:
        times: dict[str, list[float]] = {name: [] for name, _ in servers}
        tokens = 0
        for _ in range(rounds):
            for name, url in servers:
                tokens, ms = ttft_ms(url, words)
                times[name].append(ms)
        medians = {name: statistics.median(v) for name, v in times.items()}
        first = servers[0][0]
        for name, v in times.items():
            print(f"{tokens} prompt tokens  {name:6s} median {medians[name]:7.1f} ms  vs {first} "
                  f"{medians[name] / medians[first]:.3f}  {[round(x) for x in v]}", flush=True)


if __name__ == "__main__":
    main()
