"""Results of the fault benchmark (bench/faults.py): the summary per (workers, policy, fault), results.json and
the plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def write(results: dict, measured: dict[str, dict], out: Path) -> None:
    """Summarise the settings measured so far into `results` (whose other settings, from an earlier run, are
    kept) and write results.json and faults.png."""
    for setting, section in measured.items():
        section["summary"] = summarise(section["cases"])
        results["settings"][setting] = section
    results["settings"] = {k: v for k, v in results["settings"].items() if "summary" in v or "skipped" in v}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "faults.png")


def summarise(cases: list[dict]) -> dict:
    """Per (workers, policy, fault): cases that completed with the reference's text out of all, and the
    medians of the stall and of the time to rejoin."""
    groups: dict[str, list[dict]] = {}
    for c in cases:
        if c["fault"] != "none":
            groups.setdefault(f"{c['workers']}w {c['policy']} {c['fault']}", []).append(c)

    def median(values) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    return {key: {"completed_same_text": sum(c["completed"] and c["same_text"] for c in group),
                  "cases": len(group), "completed": sum(c["completed"] for c in group),
                  "rejoined": sum(c["rejoined"] for c in group),
                  "median_stall_s": median(c["stall_s"] for c in group),
                  "max_stall_s": max(c["stall_s"] for c in group),
                  "median_reference_stall_s": median(c["reference_stall_s"] for c in group),
                  "median_rejoin_s": median(c["rejoin_s"] for c in group),
                  "max_rejoin_s": max((c["rejoin_s"] for c in group if c["rejoin_s"] is not None), default=None)}
            for key, group in groups.items()}


def plot(results: dict, path: Path) -> None:
    """Horizontal bars, one row per (setting, workers, policy, fault): too many rows for bench/plot.py's
    bar_chart's upright labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{setting} {key}".replace("sigkill", "KILL").replace("sigstop", "STOP"), s)
            for setting, section in results["settings"].items() for key, s in section.get("summary", {}).items()]
    if not rows:
        return
    panels = [("completed with the same text (of all cases)", lambda s: s["completed_same_text"] / s["cases"],
               lambda s: f"{s['completed_same_text']}/{s['cases']}"),
              ("median longest gap between chunks (s)", lambda s: s["median_stall_s"] or 0, None),
              ("median time to rejoin (s)", lambda s: s["median_rejoin_s"] or 0,
               lambda s: f"{s['median_rejoin_s'] or 0:.1f} ({s['rejoined']}/{s['cases']} back)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 1.2 + 0.35 * len(rows)), sharey=True, squeeze=False)
    names = [name for name, _ in rows]
    for ax, (label, value, text) in zip(axes[0], panels, strict=True):
        values = [value(s) for _, s in rows]
        ax.barh(names, values, color=["tab:red" if "KILL" in n else "tab:blue" for n in names])
        ax.set_xlabel(label)
        ax.set_xlim(0, 1.35 * max(values, default=1) or 1)  # room for the labels
        for y, (v, (_, s)) in enumerate(zip(values, rows, strict=True)):
            ax.annotate(text(s) if text else f"{v:.1f}", (v, y), va="center", ha="left", fontsize=8)
    axes[0][0].invert_yaxis()  # first row on top (the axes share it: once)
    fig.suptitle("a worker killed (SIGKILL, red) or hung (SIGSTOP, blue) mid-stream")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
