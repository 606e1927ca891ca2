"""A scale model's re-planning, shown: a worker lost mid-stream, and a worker's memory use past the threshold.

    python -m edgespec.bench.scale_events --out DIR [--workers 4] [--budget-gib 0.3]

Serves the TinyLlama-1.1B scale model (Q4_1) over N local workers with a memory budget each (no one of them can
hold it), then:
1. streams a greedy answer, and streams it again while one worker is killed (SIGKILL) after a few tokens: the
   second stream must give the same text, and /dashboard/state must show the re-plan (worker_lost) and, once
   the worker is started again, the placement over N workers again;
2. sends concurrent long prompts until a worker's weights plus KV caches pass --memory-threshold: the
   re-plan for memory (applied, or found infeasible and logged) must show in the re-plan counts.
Writes DIR/events.json. The text is noise (random weights); what is compared is its tokens.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from edgespec.bench.distributed import start
from edgespec.bench.scale import prompt_of


def chat(url: str, model: str, prompt: str, tokens: int, on_token=None) -> str:
    """A greedy naive streamed answer of exactly `tokens` tokens; on_token(i) after each content chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "stream": True,
            "max_tokens": tokens, "min_tokens": tokens, "decoding": "naive"}
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    parts.append(chunk["choices"][0]["delta"]["content"])
                    if on_token:
                        on_token(len(parts))
    return "".join(parts)


def state(url: str) -> dict:
    return httpx.get(url + "/dashboard/state", timeout=30).json()


def worker_pid(server: psutil.Process, name: str) -> int:
    for child in server.children(recursive=True):
        if f"--name {name}" in " ".join(child.cmdline()):
            return child.pid
    raise LookupError(f"no process of {name}")


def wait_for(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


def lost_worker(url: str, server: psutil.Process, model: str, tokenizer, workers: int) -> dict:
    """Kill the middle stage's worker mid-stream: same text, the re-plan, and the worker planned back in."""
    prompt = prompt_of(tokenizer, 200, 7)
    expected = chat(url, model, prompt, 48)
    before = state(url)
    victim = before["devices"][1 + workers // 2]["name"]
    killed = threading.Event()

    def kill_at(i: int) -> None:
        if i == 8 and not killed.is_set():
            psutil.Process(worker_pid(server, victim)).send_signal(signal.SIGKILL)
            killed.set()

    t0 = time.monotonic()
    got = chat(url, model, prompt, 48, kill_at)
    stream_s = time.monotonic() - t0
    after = state(url)
    back = wait_for(lambda: state(url)["layout"].count("[") == workers, 180)
    return {"killed": victim, "same_text": got == expected, "stream_seconds": round(stream_s, 2),
            "layout_before": before["layout"], "layout_after_loss": after["layout"],
            "layout_once_restarted": state(url)["layout"], "back_to_all_workers": back,
            "replans": state(url)["replans"]}


def memory_threshold(url: str, model: str, tokenizer, threshold: float) -> dict:
    """Concurrent long prompts until a worker's memory use passes the threshold: the re-plan for memory."""
    peak: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for d in state(url)["devices"]:
                if d["memory_use"] is not None:
                    peak[d["name"]] = max(peak.get(d["name"], 0.0), d["memory_use"])
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda i: chat(url, model, prompt_of(tokenizer, 1000, 50 + i), 4), range(3)))
        time.sleep(3)  # the next check sees the use of the last moment
    finally:
        done.set()
        watcher.join()
    replans = state(url)["replans"]
    return {"threshold": threshold, "peak_memory_use": peak,
            "memory_replans": [r for r in replans if r.get("reason") == "memory"], "replans": replans}


def main(argv: list[str] | None = None) -> None:
    from edgespec.model.load import load_tokenizer
    from edgespec.model.source import resolve_model
    from edgespec.model.synth import synthesize

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--budget-gib", type=float, default=0.3)
    p.add_argument("--memory-threshold", type=float, default=0.65)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    folder = synthesize("tinyllama-1.1b", weights="q4_1")
    tokenizer = load_tokenizer(resolve_model(str(folder)))
    proc, url = start(["--model", str(folder), "--local-workers", str(args.workers), "--worker-memory-budget-gib",
                       str(args.budget_gib), "--plan-concurrency", "1", "--memory-threshold",
                       str(args.memory_threshold), "--monitor-interval-s", "1", "--prefix-cache-mib", "0",
                       "--log-level", "info"], args.out / "serve-events.log")
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        server = psutil.Process(proc.pid)
        result = {"model": str(folder), "workers": args.workers, "worker_budget_gib": args.budget_gib,
                  "lost_worker": lost_worker(url, server, model, tokenizer, args.workers),
                  "memory": memory_threshold(url, model, tokenizer, args.memory_threshold)}
    finally:
        proc.terminate()
        proc.wait(60)
    (args.out / "events.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result["lost_worker"][k] for k in ("killed", "same_text", "layout_before",
                                                            "layout_after_loss", "back_to_all_workers")}
                     | {"memory_replans": result["memory"]["memory_replans"],
                        "peak_memory_use": result["memory"]["peak_memory_use"]}, indent=1))


if __name__ == "__main__":
    main()
