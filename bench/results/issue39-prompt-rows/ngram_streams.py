"""N streams at once of one policy against `edgespec serve` on port 8124 (non-streamed, greedy, 256 tokens, the
first N vicuna80 prompts); prints each answer's `decoding` statistics.

    python bench/results/issue39-prompt-rows/ngram_streams.py 16 speculative:ngram
"""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from edgespec.bench.prompts import load_prompts
from edgespec.bench.run import decoding_field


def main() -> None:
    n, policy = int(sys.argv[1]), sys.argv[2]
    prompts = load_prompts(Path(__file__).parents[3] / "../shared/data/prompts/vicuna80.jsonl", n)

    def one(prompt: str) -> dict:
        r = httpx.post("http://127.0.0.1:8124/v1/chat/completions", timeout=600, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": 256, "decoding": decoding_field(policy)})
        return r.json()["decoding"]

    with ThreadPoolExecutor(n) as pool:
        for stats in pool.map(one, prompts):
            print(stats)


if __name__ == "__main__":
    main()
