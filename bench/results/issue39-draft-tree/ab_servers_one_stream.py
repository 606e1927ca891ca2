"""Two running servers, one stream: each prompt to both (the order alternating), greedy, streamed, with one
policy; per server the median decode tok/s (bench/run.py's), the median of the per-prompt ratios to the first
server, and how many texts are equal.

    python bench/results/issue39-draft-tree/ab_servers_one_stream.py POLICY PROMPTS FIRST COUNT MAX_TOKENS \\
        new=http://127.0.0.1:8124 old=http://127.0.0.1:8125
"""

import statistics
import sys
from pathlib import Path

import httpx

from edgespec.bench.prompts import load_prompts
from edgespec.bench.run import stream_one


def main() -> None:
    policy, prompts_file, first, count, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    servers = dict(s.split("=", 1) for s in sys.argv[6:])
    prompts = load_prompts(Path(prompts_file), first + count)[first:]
    clients = {name: httpx.Client(base_url=url, timeout=600) for name, url in servers.items()}
    models = {name: c.get("/v1/models").json()["data"][0]["id"] for name, c in clients.items()}
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    names = list(servers)
    for i, prompt in enumerate(prompts):
        for name in names[i % 2:] + names[:i % 2]:
            runs[name].append(stream_one(clients[name], models[name], prompt, policy, max_tokens))
    base = names[0]
    for name, rs in runs.items():
        ratios = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rs, runs[base], strict=True)]
        print(f"{name}: median {statistics.median(r['decode_tokens_per_s'] for r in rs):.2f} tok/s, median ratio to "
              f"{base} {statistics.median(ratios):.3f}, texts equal to {base}'s "
              f"{sum(r['text'] == b['text'] for r, b in zip(rs, runs[base], strict=True))}/{len(rs)}, median tokens "
              f"a step {statistics.median((r['server'] or {}).get('tokens_per_step') or 1.0 for r in rs)}")


if __name__ == "__main__":
    main()
