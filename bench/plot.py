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


def plot_versus(results: dict, path: Path) -> None:
    """Median decode speed per configuration of `edgespec bench-peer`, llama.cpp's bar highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["configurations"]
    names = [f"{r['server']}\n{r['format']}" + ("" if r["server"] == r["policy"] else f"\n{r['policy']}")
             for r in rows]
    values = [r["median_decode_tokens_per_s"] or 0 for r in rows]
    colors = ["tab:orange" if r["server"] == "llama.cpp" else "tab:blue" for r in rows]
    long = (results.get("long_prompt") or {}).get("servers", {})
    width = max(5.0, 1.3 * len(rows) + 2)
    fig, axes = plt.subplots(1, 2 if long else 1, figsize=(width * (1.8 if long else 1), 5.0), squeeze=False)
    ax = axes[0][0]
    ax.bar(names, values, color=colors)
    roofs = [r.get("roofline_tokens_per_s") for r in rows]
    for x, (v, r, roof) in enumerate(zip(values, rows, roofs, strict=True)):
        ratio, part = r.get("ratio_to_llama_cpp"), r.get("fraction_of_roofline")
        label = f"{v:.1f}" + (f"\n×{ratio:.2f}" if ratio and r["server"] != "llama.cpp" else "")
        ax.annotate(label, (x, v), ha="center", va="bottom")
        if roof:  # the weights' roofline: this machine's read bandwidth over the bytes a token reads
            ax.hlines(roof, x - 0.4, x + 0.4, colors="black", linestyles="dashed")
            ax.annotate(f"roofline {roof:.0f}" + (f" ({part:.0%})" if part else ""), (x, roof), ha="center",
                        va="bottom", fontsize=8)
    ax.set_ylabel("median decode tokens/s")
    ax.set_ylim(0, max([*values, *(r for r in roofs if r)], default=1) * 1.25 or 1)
    s, m = results["settings"], results["machine"]
    roof = results.get("roofline")
    read = f", reads {roof['median_gb_per_s']} GB/s" if roof else ""
    ax.set_title(f"same GGUF, {s['prompts']} prompts, max {s['max_tokens']} new tokens, greedy\n{m['cpu_model']}{read}",
                 fontsize=10)
    if long:  # the first token of a long prompt, per server
        lx = axes[0][1]
        labels = list(long)
        ms = [long[k]["median_first_token_ms"] for k in labels]
        lx.bar([k.replace(" ", "\n") for k in labels], ms,
               color=["tab:orange" if k.startswith("llama.cpp") else "tab:blue" for k in labels])
        for x, k in enumerate(labels):
            ratio = long[k]["ratio_to_llama_cpp"]
            lx.annotate(f"{ms[x]:.0f}" + (f"\n×{ratio:.2f}" if ratio and not k.startswith("llama.cpp") else ""),
                        (x, ms[x]), ha="center", va="bottom")
        lx.set_ylabel("median time to first token (ms)")
        lx.set_ylim(0, max(ms) * 1.25)
        tokens = sorted({t for k in labels for t in long[k]["prompt_tokens"]})
        span = str(tokens[0]) if len(tokens) == 1 else f"{tokens[0]}-{tokens[-1]}"
        lx.set_title(f"prompts of {span} tokens, one-token answers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_leaderboard(path: Path, title: str, rows: list[tuple[str, float]], ours: tuple[str, float]) -> None:
    """Horizontal bars, one per leaderboard row (name, percent), with our row among them in another colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = sorted([*[(n, v, False) for n, v in rows], (*ours, True)], key=lambda r: r[1])
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.28 * len(bars) + 1.2)))
    ax.barh([n for n, _, _ in bars], [v for _, v, _ in bars],
            color=["tab:orange" if mine else "tab:blue" for _, _, mine in bars])
    for y, (_, v, _) in enumerate(bars):
        ax.annotate(f"{v:.1f}%", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, 110)
    ax.set_xlabel("good, % of scored outputs")
    ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
