"""PNG plots of a bench run."""

from __future__ import annotations

from pathlib import Path


def plot_results(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rates, ttfts = [], [], []
    for name, s in results["policies"].items():
        names.append(name)
        rates.append(s["median_decode_tokens_per_s"] or 0)
        ttfts.append(s["median_ttft_ms"] or 0)
    if "transformers_generate" in results:
        hf = results["transformers_generate"]
        names.append("transformers\ngenerate")
        rates.append(hf["median_decode_tokens_per_s"] or 0)
        ttfts.append(hf["median_ttft_ms"] or 0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, rates, color="tab:blue")
    ax1.set_ylabel("median decode tokens/s")
    for x, v in enumerate(rates):
        ax1.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom")
    ax2.bar(names, ttfts, color="tab:orange")
    ax2.set_ylabel("median time to first token (ms)")
    s = results["settings"]
    fig.suptitle(f"{s['model']}: {s['prompts']} prompts, {s['max_tokens']} new tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
