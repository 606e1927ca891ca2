"""What `edgespec plan` shows: a placement as a rich table, as JSON, and as a PNG, each beside the even split.

Pure presentation of Plan objects (planning/plan.py).
"""

from __future__ import annotations

import math

from rich.table import Table

from edgespec.planning.plan import GIB, InfeasibleError, Plan, PlanOptions, even_plan
from edgespec.planning.profile import ClusterProfile


def even_baseline(profile: ClusterProfile, options: PlanOptions) -> tuple[Plan | None, str]:
    """(the even split's plan, "") when its stages fit their devices, else (None, why not)."""
    try:
        return even_plan(profile, options), ""
    except InfeasibleError as exc:
        return None, str(exc)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else None


def _jsonable(x):
    # json.dumps writes inf and nan as Infinity/NaN, which strict JSON readers reject
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def plan_summary(plan: Plan, even: Plan | None = None, even_note: str = "") -> dict:
    """plan.to_dict(), plus the even split's predictions and DP/even ratios (below 1: the DP is faster)."""
    out = plan.to_dict()
    if even is None:
        out["even"] = {"note": even_note} if even_note else None
        return _jsonable(out)
    out["even"] = {
        "bounds": even.bounds(),
        "decode_ms_per_token": even.decode_ms_per_token,
        "bottleneck_ms": even.bottleneck_ms,
        "prefill_ms": {sp.bucket: sp.predicted_ms for sp in even.prefill},
    }
    out["ratios"] = {
        "decode_ms_per_token": _ratio(plan.decode_ms_per_token, even.decode_ms_per_token),
        "bottleneck_ms": _ratio(plan.bottleneck_ms, even.bottleneck_ms),
        "prefill_ms": {a.bucket: _ratio(a.predicted_ms, b.predicted_ms)
                       for a, b in zip(plan.prefill, even.prefill, strict=False) if a.bucket == b.bucket},
    }
    return _jsonable(out)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def compact_cuts(cuts) -> str:
    """Segment ends, with runs of an equal step written first..last/step: 16..128/16, 1216..4096/192."""
    cuts, parts, i = list(cuts), [], 0
    while i < len(cuts):
        j = i + 1
        while j + 1 < len(cuts) and cuts[j + 1] - cuts[j] == cuts[i + 1] - cuts[i]:
            j += 1
        if j < len(cuts) and j - i >= 2:  # three or more points in one step
            parts.append(f"{cuts[i]}..{cuts[j]}/{cuts[i + 1] - cuts[i]}")
            i = j + 1
        else:
            parts.append(str(cuts[i]))
            i += 1
    return ", ".join(parts)


def _stages(plan: Plan) -> Table:
    o = plan.options
    table = Table(title=f"{plan.model}: {plan.method} placement, context {o.context} x {o.concurrency} sessions")
    for name in ("device", "layers", "#", "weights GiB", "KV GiB", "capacity GiB", "ms/token"):
        table.add_column(name, justify="left" if name in ("device", "layers") else "right")
    for s in plan.stages:
        used = s.weight_bytes + s.kv_bytes
        style = "bold red" if used > 0.95 * s.capacity_bytes else None  # nearly full: little room to re-plan
        table.add_row(s.device, f"[{s.first}, {s.last})", str(s.last - s.first), _gib(s.weight_bytes),
                      _gib(s.kv_bytes), _gib(s.capacity_bytes), f"{s.ms_per_token:.2f}", style=style)
    return table


def _prefill(plan: Plan, even: Plan | None) -> Table:
    table = Table(title="prefill: sequence cuts per prompt-length bucket")
    for name in ("bucket", "k", "cuts", "W ms", "predicted ms", *(("even ms", "DP/even") if even else ())):
        table.add_column(name, justify="left" if name == "cuts" else "right")
    evens = {sp.bucket: sp.predicted_ms for sp in even.prefill} if even else {}
    for sp in plan.prefill:
        row = [str(sp.bucket), str(len(sp.cuts)), compact_cuts(sp.cuts), f"{sp.bottleneck_ms:.1f}",
               f"{sp.predicted_ms:.0f}"]
        if even:
            e = evens.get(sp.bucket, math.nan)
            row += [f"{e:.0f}", f"{sp.predicted_ms / e:.3f}" if e else "-"]
        table.add_row(*row)
    return table


def plan_table(plan: Plan, even: Plan | None = None, even_note: str = "") -> Table:
    """A grid of: the stages (one row each), the decode predictions, and the prefill cuts per bucket.

    With `even`, the even split's predictions and the DP/even ratios (below 1: the DP is faster) are added;
    `even_note` says why there is no even split to compare with.
    """
    slowest = max(plan.stages, key=lambda s: s.ms_per_token)
    lines = [
        f"decode: {plan.decode_ms_per_token:.1f} ms/token predicted ({1000 / plan.decode_ms_per_token:.2f} tokens/s), "
        f"of which controller {plan.controller_ms_per_token:.2f} ms",
        f"bottleneck: {plan.bottleneck_ms:.2f} ms at {plan.options.tokens} token(s)/pass "
        f"(slowest stage at 1 token: {slowest.device}); min segment b = {plan.min_segment}",
    ]
    if even is not None:
        decode = plan.decode_ms_per_token / even.decode_ms_per_token
        bottleneck = plan.bottleneck_ms / even.bottleneck_ms
        lines.append(f"even split {even.bounds()}: decode {even.decode_ms_per_token:.1f} ms/token, bottleneck "
                     f"{even.bottleneck_ms:.2f} ms; DP/even: decode {decode:.3f}, bottleneck {bottleneck:.3f}")
    elif even_note:
        lines.append(even_note)
    grid = Table.grid(padding=(1, 0))
    grid.add_row(_stages(plan))
    grid.add_row("\n".join(lines))
    if plan.prefill:
        grid.add_row(_prefill(plan, even))
    return grid


def plot_plan(plan: Plan, path, even: Plan | None = None) -> None:
    """A PNG: layer ranges per device with memory use, and predicted decode/prefill times of DP vs even."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and boards
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 3 + 0.5 * len(plan.stages) + 3), constrained_layout=True)
    colors = plt.get_cmap("tab10")
    even_by_device = {s.device: s for s in even.stages} if even else {}
    for i, s in enumerate(plan.stages):
        ax1.barh(i - 0.1, s.last - s.first, left=s.first, height=0.5, color=colors(i % 10))
        ax1.text(s.last + 0.3, i - 0.1, f"{(s.weight_bytes + s.kv_bytes) / GIB:.2f} / {s.capacity_bytes / GIB:.2f} GiB",
                 va="center", fontsize=8)
        if s.device in even_by_device:  # where the even split would have put this device's layers
            e = even_by_device[s.device]
            ax1.barh(i + 0.28, e.last - e.first, left=e.first, height=0.16, color="none", edgecolor="gray",
                     hatch="//", label="even split" if i == 0 else None)
    n_layers = plan.stages[-1].last
    ax1.set_yticks(range(len(plan.stages)), [s.device for s in plan.stages])
    ax1.set_xlim(0, n_layers * 1.35)
    ax1.set_xlabel("decoder layers")
    ax1.invert_yaxis()
    ax1.set_title(f"{plan.model}: {plan.method} placement (memory used / capacity)")
    if even:
        ax1.legend(loc="lower right", fontsize=8)

    labels = ["decode\nms/token", *(f"prefill\n{sp.bucket}" for sp in plan.prefill)]
    dp_vals = [plan.decode_ms_per_token, *(sp.predicted_ms for sp in plan.prefill)]
    x, width = range(len(labels)), 0.4 if even else 0.6
    bars = ax2.bar([i - (width / 2 if even else 0) for i in x], dp_vals, width, label=plan.method)
    ax2.bar_label(bars, fmt="%.0f", fontsize=7)
    if even:
        ev_vals = [even.decode_ms_per_token, *(sp.predicted_ms for sp in even.prefill)][:len(labels)]
        bars = ax2.bar([i + width / 2 for i in range(len(ev_vals))], ev_vals, width, label="even")
        ax2.bar_label(bars, fmt="%.0f", fontsize=7)
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_yscale("log")  # decode (ms) and long prefills (s) on one axis
    ax2.set_ylabel("predicted ms")
    ax2.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
