"""The soak's checks (bench/soak.py): each one's measured values and pass/fail, computed from what was recorded
(every request's record, the RSS and /metrics samples, the KV state at idle before and after), and its plot."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from pathlib import Path

MIB = 2**20


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def errors_check(ledger: list[dict]) -> dict:
    """No response but whole answers, purposeful disconnects and documented 503s."""
    errors = [r for r in ledger if r["outcome"] == "error"]
    busy = [r for r in ledger if r["outcome"] == "busy"]
    examples, seen = [], set()
    for r in errors:
        if (r["code"], r["kind"]) not in seen and len(examples) < 12:
            seen.add((r["code"], r["kind"]))
            examples.append({k: r[k] for k in ("kind", "policy", "stream", "status", "code", "detail", "t_start",
                                                 "t_end", "chunks")})
    return {"pass": not errors, "errors": len(errors), "documented_503": len(busy),
            "documented_503_by_code": dict(Counter(r["code"] for r in busy)),
            "errors_by_code": dict(Counter(r["code"] for r in errors)),
            "errors_by_kind_policy": dict(Counter(f"{r['kind']}/{r['policy']}" for r in errors)),
            "examples": examples}


def _slope_mib_per_min(samples: list[dict], name: str) -> float | None:
    """Least-squares slope of a process's RSS over the samples, MiB per minute."""
    points = [(s["t"], s[name] / MIB) for s in samples if name in s]
    if len(points) < 3:
        return None
    mt, mv = statistics.mean(t for t, _ in points), statistics.mean(v for _, v in points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return round(60 * sum((t - mt) * (v - mv) for t, v in points) / var, 2) if var else None


def rss_check(samples: list[dict], load_start: float, warmup_s: float, limit_pct: float) -> dict:
    """Each process's RSS at the end of warm-up (the first warmup_s of load) against its highest and its last
    sample after (the rest of the load, the wait for idle, the flush), and its slope after warm-up."""
    cut = load_start + warmup_s
    before = [s for s in samples if load_start <= s["t"] <= cut]
    after = [s for s in samples if s["t"] > cut]
    if not before or not after:
        return {"pass": False, "why": "no RSS samples on one side of the warm-up's end"}
    processes = {}
    for name in before[-1]:
        if name == "t" or not all(name in s for s in after):
            continue
        base, top, last = before[-1][name], max(s[name] for s in after), after[-1][name]
        processes[name] = {"warmup_end_mib": round(base / MIB, 1), "max_after_mib": round(top / MIB, 1),
                           "last_mib": round(last / MIB, 1), "growth_pct": round(100 * (top / base - 1), 2),
                           "last_growth_pct": round(100 * (last / base - 1), 2),
                           "slope_after_warmup_mib_per_min": _slope_mib_per_min(after, name),
                           "pass": 100 * (top / base - 1) <= limit_pct}
    return {"pass": bool(processes) and all(p["pass"] for p in processes.values()), "limit_pct": limit_pct,
            "warmup_s": warmup_s, "processes": processes}


def kv_check(idle: dict, before_flush: dict, after: dict, flushes: dict, pool_blocks: float) -> dict:
    """KV memory back to its idle level: with the prefix cache flushed both times, the same used and free blocks
    and bytes (in-process pool or each worker), nothing running, waiting or in flight."""
    same = ("used_blocks", "free_blocks", "kv_cache_bytes")
    gauges = ("requests_in_flight", "sequences_running", "sequences_waiting")
    equal = all(after[k] == idle[k] for k in same) and all(after[k] == 0 for k in gauges)
    workers_equal = after.get("workers", {}) == idle.get("workers", {})
    flushed = all(f["flushed"] for f in flushes.values())
    reserved = pool_blocks - before_flush["used_blocks"] - before_flush["free_blocks"] if pool_blocks else None
    return {"pass": equal and workers_equal and flushed, "idle": idle, "after": after, "flushes": flushes,
            "pool_blocks": pool_blocks,
            # before the flush: what the prefix cache kept, and blocks reserved although nothing runs
            "after_load_before_flush": before_flush | {"reserved_blocks": reserved}}


def _requests_by_route(values: dict[str, float]) -> dict[str, int]:
    out = {}
    for key, v in values.items():
        if key.startswith("edgespec_requests_total{"):
            labels = dict(part.split("=", 1) for part in key[len("edgespec_requests_total{"):-1].split(","))
            out[f"{labels['route'].strip(chr(34))} {labels['status'].strip(chr(34))}"] = int(v)
    return out


def metrics_check(ledger: list[dict], samples: list[dict], growing: set[str], final: dict[str, float],
                  pool_blocks: float, max_waiting: int) -> dict:
    """/metrics against itself over time and against what the clients saw (every /v1 request the soak made)."""
    inv = {}
    client = Counter(f"{r['route']} {r['status']}" for r in ledger if r["status"] is not None)
    server = _requests_by_route(final)
    diff = {k: {"server": server.get(k, 0), "client": client.get(k, 0)} for k in set(server) | set(client)
            if server.get(k, 0) != client.get(k, 0)}
    inv["requests_total_match_client_statuses"] = {"pass": not diff, "differences": diff, "server": server,
                                                   "client_without_status": sum(r["status"] is None for r in ledger)}
    series = [m for m in samples if "values" in m] + [{"t": None, "values": final}]
    drops, negative = [], []
    for prev, cur in itertools.pairwise(series):
        for key in growing:
            if cur["values"].get(key, 0) < prev["values"].get(key, 0):
                drops.append({"metric": key, "t": cur["t"], "from": prev["values"][key], "to": cur["values"].get(key)})
    for m in series:
        negative += [{"metric": k, "t": m["t"], "value": v} for k, v in m["values"].items()
                     if k.startswith("edgespec_") and v < 0]
    # prometheus-client's process_cpu_seconds_total reads the kernel's utime + stime, whose split is rescaled
    # now and then: it can step back a tick (0.01 s). Not the server's counting: listed, not failed.
    own = [d for d in drops if d["metric"].startswith("edgespec_")]
    inv["counters_never_decrease"] = {"pass": not own, "checked": len(growing), "samples": len(series),
                                      "violations": own[:10],
                                      "process_collector_steps_back": [d for d in drops if d not in own][:5]}
    inv["no_negative_values"] = {"pass": not negative, "violations": negative[:10]}
    idle = {k: final.get(k, 0) for k in ("edgespec_requests_in_flight", "edgespec_sequences_running",
                                          "edgespec_sequences_waiting")}
    inv["idle_gauges_zero_at_end"] = {"pass": not any(idle.values()), **idle}
    busy = sum(r["outcome"] == "busy" and r["code"] == "server_busy" for r in ledger)
    refused = final.get("edgespec_queue_refused", 0)
    inv["queue_refused_equals_server_busy_503s"] = {"pass": refused == busy, "server": refused, "client": busy}
    generations = [r for r in ledger if r["kind"] != "embeddings" and r["route"] != "/v1/models"]
    ok = [r for r in generations if r["outcome"] == "ok"]
    started = [r for r in generations if r["status"] == 200 and r["outcome"] != "ok"]
    observed = sum(v for k, v in final.items() if k.startswith("edgespec_time_to_first_token_seconds_count"))
    inv["generations_observed_between_finished_and_started"] = {
        "pass": len(ok) <= observed <= len(ok) + len(started), "server": observed, "client_finished": len(ok),
        "client_left_or_failed_after_200": len(started)}
    tokens = sum(v for k, v in final.items() if k.startswith("edgespec_generated_tokens_total"))
    usage = sum(r["completion_tokens"] or 0 for r in ok)
    inv["generated_tokens_cover_client_usage"] = {"pass": tokens >= usage, "server": tokens, "client_usage": usage}
    prompt = final.get("edgespec_prompt_tokens_total", 0)
    prompt_usage = sum(r["prompt_tokens"] or 0 for r in ledger if r["outcome"] == "ok")
    inv["prompt_tokens_cover_client_usage"] = {"pass": prompt >= prompt_usage, "server": prompt,
                                               "client_usage": prompt_usage}
    over = [m["t"] for m in series if pool_blocks and m["values"].get('edgespec_kv_pool_blocks{state="used"}', 0)
            + m["values"].get('edgespec_kv_pool_blocks{state="free"}', 0) > pool_blocks]
    inv["kv_used_plus_free_within_pool"] = {"pass": not over, "pool_blocks": pool_blocks, "violations_at": over[:10]}
    waiting = max((m["values"].get("edgespec_sequences_waiting", 0) for m in series), default=0)
    inv["waiting_within_max_waiting"] = {"pass": waiting <= max_waiting, "max_seen": waiting, "limit": max_waiting}
    steps, rows = final.get("edgespec_steps", 0), final.get("edgespec_step_rows", 0)
    passes, calls = final.get("edgespec_shared_passes", 0), final.get("edgespec_shared_pass_calls", 0)
    inv["steps_rows_and_shared_passes"] = {"pass": steps <= rows and calls >= 2 * passes, "steps": steps,
                                           "step_rows": rows, "shared_passes": passes, "shared_pass_calls": calls}
    failed = [m for m in samples if "error" in m]
    latency = [m["scrape_s"] for m in samples if "scrape_s" in m]
    inv["metrics_always_answered"] = {"pass": not failed, "failed_scrapes": len(failed),
                                      "examples": [m["error"] for m in failed[:3]],
                                      "scrape_s_median": _pct(latency, 0.5), "scrape_s_max": max(latency, default=None)}
    return {"pass": all(v["pass"] for v in inv.values()), "invariants": inv}


def log_check(log: Path) -> dict:
    """The server's log: an exception that no client saw (a background task, a callback) is a fault too."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = text.splitlines()
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    errors = [line for line in lines if " ERROR " in line or line.startswith("ERROR")]
    first = "\n".join(lines[tracebacks[0]:tracebacks[0] + 40]) if tracebacks else None
    return {"pass": not tracebacks, "tracebacks": len(tracebacks), "error_lines": len(errors),
            "first_error_lines": errors[:5], "first_traceback": first}


def summary(records: list[dict], load_s: float, streams: int) -> dict:
    """The load phase's traffic: what was sent and how it ended, rates and latencies (client-side)."""
    ok = [r for r in records if r["outcome"] == "ok"]
    durations = [r["t_end"] - r["t_start"] for r in ok]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    return {"load_s": round(load_s, 1), "streams": streams, "requests": len(records),
            "by_outcome": dict(Counter(r["outcome"] for r in records)),
            "by_kind": dict(Counter(r["kind"] for r in records)),
            "by_policy": dict(Counter(r["policy"] or "-" for r in records)),
            "streamed": sum(r["stream"] for r in records),
            "requests_per_s": round(len(records) / load_s, 3),
            "finished_completion_tokens_per_s": round(tokens / load_s, 2),
            "finished_seconds_p50": _pct(durations, 0.5), "finished_seconds_p95": _pct(durations, 0.95),
            "finished_seconds_max": round(max(durations), 3) if durations else None,
            "finish_reasons": dict(Counter(r["finish_reason"] or "-" for r in ok))}


def timeline(records: list[dict], rss: list[dict], metrics: list[dict], load_start: float) -> dict:
    """Per-second series relative to the load's start, for the plot and the JSON."""
    ends: dict[str, Counter] = {o: Counter() for o in ("ok", "disconnected", "busy", "error")}
    for r in records:
        ends[r["outcome"]][int(r["t_end"] - load_start)] += 1
    last = max([int(r["t_end"] - load_start) for r in records] + [0])
    names = sorted({k for s in rss for k in s if k != "t"})
    keys = {"kv_used_blocks": 'edgespec_kv_pool_blocks{state="used"}', "running": "edgespec_sequences_running",
            "waiting": "edgespec_sequences_waiting", "in_flight": "edgespec_requests_in_flight"}
    return {
        "per_second": {o: [c.get(s, 0) for s in range(last + 1)] for o, c in ends.items()},
        "rss_mib": {"t": [round(s["t"] - load_start, 1) for s in rss],
                    **{n: [round(s.get(n, 0) / MIB, 1) for s in rss] for n in names}},
        "metrics": {"t": [round(m["t"] - load_start, 1) for m in metrics if "values" in m],
                    **{k: [m["values"].get(name, 0) for m in metrics if "values" in m] for k, name in keys.items()}},
    }


def plot(path: Path, series: dict, load_s: float, warmup_s: float, title: str) -> None:
    """RSS over time, requests finished and failed per second, and the KV pool and queue over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    rss = series["rss_mib"]
    for name in (k for k in rss if k != "t"):
        top.plot(rss["t"], rss[name], label=name)
    top.set_ylabel("RSS (MiB)")
    per = series["per_second"]
    seconds = list(range(len(per["ok"])))
    for outcome, color in (("ok", "tab:green"), ("disconnected", "tab:blue"), ("busy", "tab:orange"),
                           ("error", "tab:red")):
        smooth = [statistics.mean(per[outcome][max(0, i - 4):i + 1]) for i in seconds]  # 5 s mean
        mid.plot(seconds, smooth, label=f"{outcome} /s", color=color)
    mid.set_ylabel("requests ended per s (5 s mean)")
    met = series["metrics"]
    for key in ("kv_used_blocks", "running", "waiting"):
        low.plot(met["t"], met[key], label=key)
    low.set_ylabel("KV blocks / sequences")
    low.set_xlabel("seconds since the load started")
    for ax in (top, mid, low):
        ax.axvline(warmup_s, color="grey", linestyle="--", linewidth=0.8)
        ax.axvline(load_s, color="black", linestyle=":", linewidth=0.8)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
