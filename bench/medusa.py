"""Medusa's bar in one command: `edgespec bench` (bench/run.py) on vicuna80 and the WizardLM test set, in-process
and over N local workers, naive and `medusa` (the shipped heads and tree) alternating prompt by prompt.

    python -m bench.medusa --out bench/results/issue7-medusa [--wizardlm 80] [--workers 2] [--also speculative]

The WizardLM set is sorted by skill, so its first N prompts would be mostly maths: --wizardlm N takes N
prompts evenly spread over it (written to DIR/wizardlm_spread.jsonl).

Writes DIR/SETUP/SET/results.json and .png per run, and DIR/medusa.json and DIR/medusa.png: each policy's
ratio to naive and tokens per step per setup and set, and the workers' ratio over the in-process one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgespec.bench.compare import SHARED_PROMPTS, compare, report

SETS = {"vicuna80": SHARED_PROMPTS / "vicuna80.jsonl", "wizardlm": SHARED_PROMPTS / "wizardlm_testset.jsonl"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--limit", type=int, help="first N prompts of each set")
    p.add_argument("--wizardlm", type=int, default=80, help="WizardLM prompts, evenly spread over the set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--also", default="", help="more bench policies to run beside medusa, e.g. speculative")
    p.add_argument("--prompt-sets", default=",".join(SETS))
    p.add_argument("--setups", help="run only these (in_process, N_workers); the others' results are read from DIR")
    args = p.parse_args(argv)
    out = Path(args.out)
    policies = ["medusa", *filter(None, args.also.split(","))]
    setups = {"in_process": ([], policies), f"{args.workers}_workers": (["--local-workers", str(args.workers)],
                                                                         policies)}
    out.mkdir(parents=True, exist_ok=True)
    sets = {name: SETS[name] for name in args.prompt_sets.split(",")}
    if "wizardlm" in sets:
        rows = SETS["wizardlm"].read_text().splitlines()
        step = max(1, len(rows) / args.wizardlm)
        sets["wizardlm"] = out / "wizardlm_spread.jsonl"
        sets["wizardlm"].write_text("\n".join(rows[int(i * step)] for i in range(min(args.wizardlm, len(rows))))
                                    + "\n")
    summary = compare(out, setups, sets, args.max_tokens, args.limit,
                      args.setups.split(",") if args.setups else list(setups))
    report(out, "medusa", "Medusa, SmolLM2-135M-Instruct, greedy", summary, sets, setups)


if __name__ == "__main__":
    main()
