"""The served model's layer matmuls on every kernel path this CPU runs (model/kernels' `isas()`: portable, AVX2,
VNNI), for passes of R = 1, 2, 4, 8, 16 rows, timed in one run with the paths interleaved repeat by repeat, so a
load that changes during the run (a shared machine) moves every path alike and the ratios compare. Each path's
ratio to its own one-row pass is what a verification pass of R-1 drafts pays (issue 39's bar: 4 rows <= 1.3x,
8 rows <= 1.8x); the paths give the same bits (tests/test_kernels.py), so only time differs.

    python -m edgespec.bench.kernel_paths --out bench/results/issue39-pass-cost

Writes DIR/kernel_paths.json (medians of --repeats timings, milliseconds) and DIR/kernel_paths.png.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from edgespec.bench.plot import bar_chart
from edgespec.bench.versus import machine_info
from edgespec.model.config import ModelConfig
from edgespec.model.kernels import build_folder, isas, load
from edgespec.model.linear import Kernel, weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack
from edgespec.model.weights import open_source


def build_of(key: str):
    """The kernels' build `key` (its folder under model/kernels/build/: `python -m edgespec.model.kernels` builds a
    checkout's sources there) loaded as a module beside this process's own, for builds timed side by side."""
    so = next(build_folder(key).glob("*.so"))
    loader = importlib.machinery.ExtensionFileLoader(so.stem, str(so))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(so.stem, so, loader=loader))
    loader.exec_module(module)
    return module


def handles(mod, linears: list[Kernel]) -> list:
    """The linears' weights as `mod`'s own Linear handles (the same tensors, another build's code)."""
    out = []
    for m in linears:
        tensors = m.weight_tensors()
        a, b, c = (*tensors, *[tensors[0]] * (3 - len(tensors)))
        out.append(mod.Linear(m.KIND, a, b, c, m.bias, m.out_features))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--paths", default=",".join(isas()), help="kernel paths, comma-separated (default: all here)")
    ap.add_argument("--threads", type=int, default=0, help="the kernels' threads (default: torch's count)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    files = resolve_model(None)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format(args.weights)
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt)
    linears = [m for m in stack.modules() if isinstance(m, Kernel)]
    paths = args.paths.split(",")
    kernels = {p: handles(load(p), linears) for p in paths}
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[str, dict[int, list[float]]] = {p: {r: [] for r in rows} for p in paths}
    with torch.inference_mode():
        for r in rows:
            xs = [torch.randn(r, m.in_features) for m in linears]
            for i in range(args.repeats + 3):  # the first 3 warm up
                for p in paths:
                    # each build has its own pool of threads, which spin 200 us after a call (pool.cpp): let the
                    # last path's go to sleep first, or they take the cores from this one (2.3x at one row)
                    time.sleep(0.002)
                    t = time.perf_counter()
                    for k, x in zip(kernels[p], xs, strict=True):
                        k(x)
                    if i >= 3:
                        times[p][r].append(time.perf_counter() - t)
    result: dict = {"machine": machine_info() | {"threads": torch.get_num_threads()}, "weights": args.weights,
                    "repeats": args.repeats, "paths": {}}
    for p in paths:
        ms = {r: round(statistics.median(times[p][r]) * 1000, 3) for r in rows}
        result["paths"][p] = [{"rows": r, "layer_matmuls_ms": ms[r], "vs_one_row": round(ms[r] / ms[rows[0]], 3),
                               "vs_first_path": round(ms[r] / (statistics.median(times[paths[0]][r]) * 1000), 3)}
                              for r in rows]
        print(p, result["paths"][p])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_paths.json").write_text(json.dumps(result, indent=1) + "\n")
    panels = [(f"{p}: time / its one-row time", [str(r) for r in rows],
               [row["vs_one_row"] for row in result["paths"][p]]) for p in paths]
    panels.append((f"layer matmuls, ms at {rows[0]} row(s)", paths,
                   [result["paths"][p][0]["layer_matmuls_ms"] for p in paths]))
    bar_chart(args.out / "kernel_paths.png", "layer matmuls by kernel path and rows per pass (same run)", panels)
    print(f"wrote {args.out / 'kernel_paths.json'}")


if __name__ == "__main__":
    main()
