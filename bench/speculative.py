"""Speculative decoding's bar in one command: `edgespec bench` (bench/run.py) on each prompt set, in-process
and over N local workers, naive and every drafter alternating prompt by prompt.

    python -m bench.speculative --out bench/results/issue6-speculative [--limit N] [--workers 2]

Writes DIR/SETUP/SET/results.json and .png per run (the bench's own files), and DIR/speculative.json and
DIR/speculative.png: each drafter's ratio to naive per setup and prompt set, and how far the workers' ratio
is from the in-process one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgespec.bench.compare import SHARED_PROMPTS, compare, report

SETS = {"extraction20": Path(__file__).parent / "prompts" / "extraction20.jsonl",
        "vicuna80": SHARED_PROMPTS / "vicuna80.jsonl"}


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
    drafters = [f"speculative:{d}" for d in args.drafters.split(",")]
    skip = (["--layerskip", args.layerskip], ["speculative:layerskip"]) if args.layerskip else ([], [])
    setups = {"in_process": (skip[0], drafters + skip[1]),
              f"{args.workers}_workers": (["--local-workers", str(args.workers)], drafters)}
    sets = {name: SETS[name] for name in args.prompt_sets.split(",")}
    summary = compare(out, setups, sets, args.max_tokens, args.limit,
                      args.setups.split(",") if args.setups else list(setups))
    report(out, "speculative", "speculative decoding, SmolLM2-135M-Instruct, greedy", summary, sets, setups)


if __name__ == "__main__":
    main()
