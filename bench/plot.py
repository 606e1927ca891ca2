"""PNG plots of bench runs."""

from __future__ import annotations

from pathlib import Path


def bar_chart(path: Path, title: str, panels: list[tuple[str, list[str], list[float]]]) -> None:
    """One bar panel per (y label, names, values), side by side, values written on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (label, names, values) in zip(axes[0], panels, strict=True):
        ax.bar(names, values)
        ax.set_ylabel(label)
        for x, v in enumerate(values):
            ax.annotate(f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}", (x, v), ha="center", va="bottom")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_results(results: dict, path: Path) -> None:
    """Decode speed and time to first token per policy (and transformers' generate, when measured)."""
    rows = [(name, s) for name, s in results["policies"].items()]
    if "transformers_generate" in results:
        rows.append(("transformers\ngenerate", results["transformers_generate"]))
    names = [name for name, _ in rows]
    s = results["settings"]
    bar_chart(path, f"{s['model']}: {s['prompts']} prompts, {s['max_tokens']} new tokens, greedy", [
        ("median decode tokens/s", names, [r["median_decode_tokens_per_s"] or 0 for _, r in rows]),
        ("median time to first token (ms)", names, [r["median_ttft_ms"] or 0 for _, r in rows]),
    ])
