"""The Home LLM leaderboard's `assist-mini` evaluation, its harness unmodified, against edgespec through Home
Assistant's Ollama integration (issue 38).

    python -m edgespec.bench.assist_mini --harness DIR --harness-python PY --synthetic-home DIR --out DIR
        [--leaderboard DIR] [--harness-rev REV] [--count N] [--categories C] [--work DIR] [-- serve flags]

The harness is allenporter/home-assistant-datasets (DIR: a checkout or an exported tree of it; PY: the python of
a virtual environment where `pip install -r requirements_dev.txt` was run in DIR, which brings Home Assistant,
pytest-homeassistant-custom-component and the harness). Its assist-mini tasks need the synthetic-home custom
component (allenporter/home-assistant-synthetic-home: DIR holds its `custom_components/`), which the harness
imports from PYTHONPATH as its own CI does. Nothing of either is changed: this starts `edgespec serve`, writes the
one thing the harness asks its user to write (a model YAML naming the `ollama` domain and the server's URL, in a
work folder that holds only it), and runs the harness's own two commands there, as its scripts do:

    pytest DIR/home_assistant_datasets/tool/assist/collect --models=ID --dataset=DIR/datasets/assist-mini/ \\
        --model_output_dir=reports/assist-mini/<Home Assistant version>
    pytest DIR/home_assistant_datasets/tool/assist/eval --model_output_dir=reports/assist-mini/<version>

Writes OUT/assist_mini.json (the harness's score row as its reports.yaml gives it, the text of that file, the
tasks, times, the server's policy per request read from its /metrics, the tools the model called, and the
leaderboard's rows read from the harness's own reports: every reports.yaml under --leaderboard, default
DIR/reports/assist-mini, and per model the best one as the leaderboard's build keeps), the harness's report files
under OUT/harness/, the logs, and OUT/assist_mini.png. Arguments after `--` go to `edgespec serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from edgespec.bench.distributed import start
from edgespec.bench.plot import plot_leaderboard

DATASET = "assist-mini"
HARNESS_REPORTS = ["reports.yaml", "reports-by-category.yaml", "reports-by-test-name.yaml",
                   "reports-by-model-test-name.yaml", "reports-token-stats.yaml", "report.csv"]


def harness_package_version(python: str, package: str) -> str:
    """A package's version in the harness's environment (its scripts name the output folder by Home Assistant's)."""
    return subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                          check=True, capture_output=True, text=True).stdout.strip()


def model_config(model_id: str, url: str, model: str) -> dict:
    """The harness's model entry: a Home Assistant config entry for the `ollama` domain (as the leaderboard's
    local models are configured: the Assist API, a context of 8192) naming edgespec's URL and served model."""
    return {"model_id": model_id, "domain": "ollama",
            "description": f"edgespec serving {model} through its Ollama-compatible API",
            "categories": ["local"],
            "config_entry_data": {"url": url, "model": model},
            "config_entry_options": {"llm_hass_api": "assist", "num_ctx": 8192}}


def run_pytest(python: str, args: list[str], cwd: Path, env: dict, log: Path) -> dict:
    """One pytest run of the harness: its exit status, its last summary line and its wall time."""
    began = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=cwd, env=env,
                            stdout=f, stderr=subprocess.STDOUT).returncode
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"\b(passed|failed|skipped|error)\b.* in ", ln)), "")
    return {"returncode": rc, "summary": summary, "seconds": round(time.monotonic() - began, 1)}


def leaderboard_rows(reports: Path) -> list[dict]:
    """Every row of every reports.yaml under the leaderboard's dataset folder, with its Home Assistant version."""
    rows = []
    for report in sorted(reports.glob("*/reports.yaml")):
        for row in yaml.safe_load(report.read_text()) or []:
            rows.append({"model_id": row["model_id"], "version": report.parent.name, "good": row["good"],
                         "total": row["total"], "good_percent": row.get("good_percent")})
    return rows


def best_rows(rows: list[dict]) -> list[dict]:
    """Per model the row with the highest good/total, as the leaderboard's build (compute_best_scores) keeps."""
    best: dict[str, dict] = {}
    for row in rows:
        score = row["good"] / row["total"] if row["total"] else 0.0
        if row["model_id"] not in best or score > best[row["model_id"]]["score"]:
            best[row["model_id"]] = {**row, "score": score}
    return sorted(best.values(), key=lambda r: r["score"], reverse=True)


def server_figures(url: str) -> dict:
    """What the server did, from its /metrics: requests by route and status, requests by the decoding policy it
    ran them with (its time-to-first-token counts), tokens prompted, reused from the prefix cache and generated."""
    text = httpx.get(url + "/metrics", timeout=30).text
    figures: dict = {"requests_by_route": {}, "requests_by_policy": {}, "ttft_s_sum": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "edgespec_requests_total":
                figures["requests_by_route"][f"{sample.labels['route']} {sample.labels['status']}"] = int(sample.value)
            elif sample.name == "edgespec_time_to_first_token_seconds_count":
                figures["requests_by_policy"][sample.labels["policy"]] = int(sample.value)
            elif sample.name == "edgespec_time_to_first_token_seconds_sum":
                figures["ttft_s_sum"] += sample.value
            elif sample.name in ("edgespec_generated_tokens_total", "edgespec_prompt_tokens_total",
                                 "edgespec_prefix_cache_hits", "edgespec_prefix_cache_reused_tokens"):
                key = sample.name.removeprefix("edgespec_").removesuffix("_total")
                figures[key] = figures.get(key, 0) + int(sample.value)
    answered = sum(figures["requests_by_policy"].values())
    figures["mean_ttft_s"] = round(figures.pop("ttft_s_sum") / answered, 2) if answered else None
    return figures


def turns(outputs: Path) -> dict:
    """What the model did, read from the harness's model outputs: turn times, tries, and the tools it called."""
    durations, tries, tools, turns_with_call, timed_out = [], Counter(), Counter(), 0, 0
    for path in sorted(outputs.glob("*.yaml")):
        if path.name.startswith("_"):
            continue
        output = yaml.load(path.read_text(), Loader=yaml.CSafeLoader) or {}
        context = output.get("context", {})
        # the harness's answer when every try ran past its 40 s limit (agent/retryable.py)
        timed_out += str(output.get("response", "")).startswith("Timeout (after")
        if "duration_ms" in context:
            durations.append(context["duration_ms"])
        tries[str(context.get("tries"))] += 1
        called = [e["data"].get("tool_name") for e in context.get("conversation_trace", [])
                  if e.get("event_type") == "tool_call"]
        turns_with_call += bool(called)
        tools.update(str(name) for name in called)
    durations.sort()
    return {"outputs": len(durations), "turns_with_a_tool_call": turns_with_call, "tool_calls": dict(tools),
            "tries": dict(tries), "timed_out_every_try": timed_out,
            "median_turn_ms": durations[len(durations) // 2] if durations else None,
            "max_turn_ms": durations[-1] if durations else None}


def chart(result: dict, path: Path) -> None:
    """Our score among the leaderboard's best row per model, each labelled with its Home Assistant version and n."""
    score, served = result["score"], result["server"]["served_model"]
    ours = (f"edgespec: {served} ({result['harness']['homeassistant']}, n={score['total']})",
            100 * score["good"] / score["total"])
    rows = [(f"{r['model_id']} ({r['version']}, n={r['total']})", 100 * r["score"])
            for r in result["leaderboard"]["best_per_model"]]
    options = " ".join(result["server"]["serve_args"]) or "its defaults"
    plot_leaderboard(path, "assist-mini, the leaderboard's harness unmodified: edgespec through Home Assistant's "
                     f"Ollama integration\n(serve {options}) beside the leaderboard's best row per model", rows, ours)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--harness", type=Path, required=True, help="home-assistant-datasets checkout (or export)")
    p.add_argument("--harness-python", required=True, help="python of the harness's virtual environment")
    p.add_argument("--synthetic-home", type=Path, required=True, help="folder holding custom_components/synthetic_home")
    p.add_argument("--leaderboard", type=Path, help=f"the leaderboard's reports/{DATASET} (default: the harness's)")
    p.add_argument("--harness-rev", default="", help="the harness's commit, recorded with the result")
    p.add_argument("--synthetic-home-rev", default="", help="the synthetic home's commit, recorded")
    p.add_argument("--leaderboard-rev", default="", help="the leaderboard reports' commit, recorded")
    p.add_argument("--model-id", default="edgespec", help="the model id the harness records")
    p.add_argument("--count", help="the harness's --count (runs per task; default: the dataset card's)")
    p.add_argument("--categories", help="the harness's --categories (default: all)")
    p.add_argument("--work", type=Path, help="where the harness runs and writes its outputs (default: a temporary "
                   "folder, removed at the end)")
    p.add_argument("--out", type=Path, required=True)
    args, serve_args = p.parse_known_args(argv)
    serve_args = [a for a in serve_args if a != "--"]
    harness = args.harness.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()
    ha_version = harness_package_version(args.harness_python, "homeassistant")
    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="assist-mini-"))
    outputs = work / "reports" / DATASET / ha_version  # as the harness's scripts name it (they create it too)
    outputs.mkdir(parents=True, exist_ok=True)
    (work / "models").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(args.synthetic_home.resolve())}
    dataset_args = [f"--dataset={harness}/datasets/{DATASET}/"]
    dataset_args += [f"--count={args.count}"] if args.count else []
    dataset_args += [f"--categories={args.categories}"] if args.categories else []
    # a first start compiles the CPU kernels (20-90 s alone, minutes on a busy shared machine)
    proc, url = start(["--log-level", "warning", *serve_args], args.out / "server.log", timeout_s=900)
    try:
        served = httpx.get(url + "/api/tags", timeout=30).json()["models"][0]["name"]
        config = model_config(args.model_id, url, served)
        (work / "models" / f"{args.model_id}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        console.print(f"edgespec at {url} serves {served}; harness in {work}, Home Assistant {ha_version}")
        collect = run_pytest(args.harness_python, [
            f"{harness}/home_assistant_datasets/tool/assist/collect", f"--models={args.model_id}", *dataset_args,
            f"--model_output_dir={outputs}"], work, env, args.out / "collect.log")
        console.print(f"collect: {collect}")
        if collect["returncode"] not in (0, 1):  # 1: some task failed, still recorded; else it did not run
            raise RuntimeError(f"the harness's collection did not run; see {args.out / 'collect.log'}")
        server = server_figures(url)
    finally:
        proc.terminate()
        proc.wait(30)
    evaluation = run_pytest(args.harness_python, [
        f"{harness}/home_assistant_datasets/tool/assist/eval", f"--model_output_dir={outputs}"],
        work, env, args.out / "eval.log")
    console.print(f"eval: {evaluation}")
    if evaluation["returncode"] not in (0, 1):  # 1: some outputs were scored bad
        raise RuntimeError(f"the harness's evaluation did not run; see {args.out / 'eval.log'}")
    (args.out / "harness").mkdir(exist_ok=True)
    for name in HARNESS_REPORTS:
        if (outputs / name).exists():
            shutil.copy(outputs / name, args.out / "harness" / name)
    printed = (outputs / "reports.yaml").read_text()  # what the harness's eval_metrics script prints (cat)
    score = next(r for r in yaml.safe_load(printed) if r["model_id"] == args.model_id)
    board = leaderboard_rows(args.leaderboard or harness / "reports" / DATASET)
    result = {
        "score": score, "harness_reports_yaml": printed,
        "tasks": {"outputs_scored": score["total"], "runs_collected": collect["summary"],
                  "count": args.count or "the dataset card's", "categories": args.categories or "all"},
        "collect": collect, "eval": evaluation,
        "server": {"served_model": served, "serve_args": serve_args, **server,
                   "tool_choice": "auto (Home Assistant's Ollama integration sends tools; Ollama has no tool_choice)"},
        "model_turns": turns(outputs / args.model_id),
        "harness": {"path": str(harness), "rev": args.harness_rev, "synthetic_home_rev": args.synthetic_home_rev,
                    "homeassistant": ha_version,
                    "pytest_homeassistant_custom_component":
                        harness_package_version(args.harness_python, "pytest-homeassistant-custom-component"),
                    "ollama_client": harness_package_version(args.harness_python, "ollama"),
                    "model_config": config},
        "leaderboard": {"source": str(args.leaderboard or harness / "reports" / DATASET),
                        "rev": args.leaderboard_rev or args.harness_rev, "rows": board,
                        "best_per_model": best_rows(board)},
    }
    (args.out / "assist_mini.json").write_text(json.dumps(result, indent=1, default=str))
    chart(result, args.out / "assist_mini.png")
    console.print(printed)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
