"""Policies against naive on prompt sets, in-process and over local workers: `edgespec bench` (bench/run.py)
once per setup and set, every policy alternating with naive prompt by prompt, and the summary the
speculative and Medusa benchmarks quote."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgespec.bench.distributed import start
from edgespec.bench.plot import bar_chart
from edgespec.bench.run import run_bench

SHARED_PROMPTS = Path(__file__).parents[2] / "shared" / "data" / "prompts"
KEYS = ("ratio_to_naive", "median_decode_tokens_per_s", "median_tokens_per_step", "median_acceptance_rate")


def compare(out: Path, setups: dict[str, tuple[list[str], list[str]]], sets: dict[str, Path], max_tokens: int,
            limit: int | None, run: list[str]) -> dict:
    """setups: name -> (serve arguments, bench policies besides naive). Setups not in `run` are read back from
    DIR/SETUP/SET/results.json of an earlier run. Returns per set and setup each policy's figures, and per set
    each policy's ratio over the first setup's ratio (workers against in-process)."""
    summary: dict = {"settings": {"max_tokens": max_tokens, "limit": limit}}
    for setup, (extra, names) in setups.items():
        folder = out / setup
        folder.mkdir(parents=True, exist_ok=True)
        proc, url = start(["--log-level", "warning", *extra], folder / "server.log") if setup in run else (None, None)
        try:
            for name, prompts in sets.items():
                bench = argparse.Namespace(url=url, prompts=str(prompts), policies=",".join(["naive", *names]),
                                           max_tokens=max_tokens, limit=limit, api_key=None,
                                           transformers_baseline=False, out=str(folder / name))
                results = run_bench(bench) if proc else json.loads((folder / name / "results.json").read_text())
                summary.setdefault(name, {})[setup] = {
                    policy: {key: s[key] for key in KEYS} for policy, s in results["policies"].items()}
        finally:
            if proc:
                proc.terminate()
                proc.wait(30)
    base, *others = setups
    for name in sets:
        rows = summary[name]
        for setup in others:
            rows[f"{setup}_ratio_over_{base}"] = {
                policy: round(s["ratio_to_naive"] / rows[base][policy]["ratio_to_naive"], 3)
                for policy, s in rows[setup].items() if policy != "naive"}
    return summary


def report(out: Path, name: str, title: str, summary: dict, sets, setups) -> None:
    """DIR/NAME.json with the summary and DIR/NAME.png with one panel of ratios to naive per set and setup."""
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    panels = []
    for prompt_set in sets:
        for setup in setups:
            runs = summary[prompt_set][setup]
            panels.append((f"{prompt_set}, {setup}: ratio to naive", [p.split(":")[-1] for p in runs],
                           [runs[p]["ratio_to_naive"] for p in runs]))
    bar_chart(out / f"{name}.png", title, panels)
    print(json.dumps(summary, indent=2))
