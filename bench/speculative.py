"""Speculative decoding's bar in one command: `edgespec bench` (bench/run.py) on each prompt set, in-process
and over N local workers, naive and every drafter alternating prompt by prompt.

    python -m bench.speculative --out bench/results/issue6-speculative [--limit N] [--workers 2]

Writes DIR/SETUP/SET/results.json and .png per run (the bench's own files), and DIR/speculative.json and
DIR/speculative.png: each drafter's ratio to naive per setup and prompt set, and how far the workers' ratio
is from the in-process one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.distributed import start
from bench.plot import bar_chart
from bench.run import run_bench

SETS = {"extraction20": Path(__file__).parent / "prompts" / "extraction20.jsonl",
        "vicuna80": Path(__file__).parents[2] / "shared" / "data" / "prompts" / "vicuna80.jsonl"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--drafters", default="ngram,eagle,eagle+ngram")
    p.add_argument("--layerskip", help="also the self-draft keeping these layers, e.g. 0-27 (in-process only)")
    p.add_argument("--prompt-sets", default=",".join(SETS))
    p.add_argument("--setups", help="run only these (in_process, N_workers); the others' results are read from DIR")
    args = p.parse_args(argv)
    out = Path(args.out)
    drafters = args.drafters.split(",")
    skip = (["--layerskip", args.layerskip], ["layerskip"]) if args.layerskip else ([], [])
    setups = {"in_process": (skip[0], drafters + skip[1]),
              f"{args.workers}_workers": (["--local-workers", str(args.workers)], drafters)}
    summary: dict = {"settings": {"max_tokens": args.max_tokens, "limit": args.limit, "workers": args.workers}}
    run = args.setups.split(",") if args.setups else list(setups)
    for setup, (extra, names) in setups.items():
        folder = out / setup
        folder.mkdir(parents=True, exist_ok=True)
        proc, url = start(["--log-level", "warning", *extra], folder / "server.log") if setup in run else (None, None)
        try:
            for name in args.prompt_sets.split(","):
                policies = ",".join(["naive", *(f"speculative:{d}" for d in names)])
                bench = argparse.Namespace(url=url, prompts=str(SETS[name]), policies=policies,
                                           max_tokens=args.max_tokens, limit=args.limit, api_key=None,
                                           transformers_baseline=False, out=str(folder / name))
                results = run_bench(bench) if proc else json.loads((folder / name / "results.json").read_text())
                summary.setdefault(name, {})[setup] = {
                    policy: {key: s[key] for key in ("ratio_to_naive", "median_decode_tokens_per_s",
                                                     "median_tokens_per_step", "median_acceptance_rate")}
                    for policy, s in results["policies"].items()}
        finally:
            if proc:
                proc.terminate()
                proc.wait(30)
    workers = f"{args.workers}_workers"
    for name in args.prompt_sets.split(","):
        rows = summary[name]
        rows["workers_ratio_over_in_process"] = {
            policy: round(s["ratio_to_naive"] / rows["in_process"][policy]["ratio_to_naive"], 3)
            for policy, s in rows[workers].items() if policy != "naive"}
    (out / "speculative.json").write_text(json.dumps(summary, indent=2) + "\n")
    panels = []
    for name in args.prompt_sets.split(","):
        for setup in setups:
            runs = summary[name][setup]
            panels.append((f"{name}, {setup}: ratio to naive", [p.split(":")[-1] for p in runs],
                           [runs[p]["ratio_to_naive"] for p in runs]))
    bar_chart(out / "speculative.png", "speculative decoding, SmolLM2-135M-Instruct, greedy", panels)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
