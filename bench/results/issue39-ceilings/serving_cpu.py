"""Where a token's CPU goes outside the pass, against a running `edgespec serve` (port 8124), naive, greedy, 256
tokens: bursts of N streams (bench.concurrency.burst, the concurrency benchmark's own client), and for each the
server's threads' CPU time (/proc/PID/task: the model thread, the kernels' pool thread, the event loop) and this
client's, per generated token. Then one stream's client CPU a token for three clients reading the same answers:
the benchmark's (httpx, a JSON parse per SSE line), httpx's raw bytes, and a bare socket.

    python bench/results/issue39-ceilings/serving_cpu.py PID > bench/results/issue39-ceilings/serving_cpu.txt
"""

import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

import httpx

from edgespec.bench.concurrency import burst
from edgespec.bench.prompts import load_prompts
from edgespec.bench.run import stream_one

URL, MODEL, TOKENS = "http://127.0.0.1:8124", "SmolLM2-135M-Instruct", 256
PROMPTS = load_prompts(Path(__file__).parents[3] / "../shared/data/prompts/vicuna80.jsonl", 16)
TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[str, float]:
    # CPU seconds by thread: the main thread runs the event loop; the two busy others are the model thread (the
    # first started) and the kernels' pool thread
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
        out["main (event loop)" if int(t) == pid else f"thread {t}"] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def body(prompt: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True}, "decoding": "naive"}


def raw_httpx(client: httpx.Client, prompt: str) -> None:
    with client.stream("POST", "/v1/chat/completions", json=body(prompt)) as r:
        for _ in r.iter_raw():
            time.perf_counter()


def raw_socket(prompt: str) -> None:
    data = json.dumps(body(prompt)).encode()
    with socket.create_connection(("127.0.0.1", 8124)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        while s.recv(65536):
            time.perf_counter()


def main() -> None:
    pid = int(sys.argv[1])
    for n, rounds in [(1, 4), (4, 4), (8, 2), (16, 1)]:
        before, cpu0, tokens, t0, rates = threads(pid), own_cpu(), 0, time.perf_counter(), []
        for _ in range(rounds):
            b = burst(URL, MODEL, PROMPTS[:n], "naive", TOKENS)
            tokens += sum(r["tokens"] for r in b["runs"])
            rates.append(b["aggregate_tokens_per_s"])
        wall, after = time.perf_counter() - t0, threads(pid)
        print(f"{n} streams: {tokens} tokens in {wall:.1f} s, bursts {rates} tok/s")
        for name in sorted(after, key=lambda k: before.get(k, 0) - after[k]):
            d = after[name] - before.get(name, 0)
            if d > 0.05:
                print(f"  server {name:24s} {d / tokens * 1e6:7.1f} us a token, {d / wall:6.1%} of a core")
        d = own_cpu() - cpu0
        print(f"  this client              {d / tokens * 1e6:7.1f} us a token, {d / wall:6.1%} of a core")
    client = httpx.Client(base_url=URL, timeout=600)
    tokens = sum(stream_one(client, MODEL, p, "naive", TOKENS)["tokens"] for p in PROMPTS[:4])  # greedy: the same
    clients = {"benchmark's (stream_one)": lambda p: stream_one(client, MODEL, p, "naive", TOKENS),
               "httpx raw bytes": lambda p: raw_httpx(client, p), "socket": raw_socket}
    for name, read in clients.items():
        t0 = resource.getrusage(resource.RUSAGE_THREAD)
        for p in PROMPTS[:4]:
            read(p)
        t1 = resource.getrusage(resource.RUSAGE_THREAD)
        cpu = t1.ru_utime + t1.ru_stime - t0.ru_utime - t0.ru_stime
        print(f"one stream, client {name}: {cpu / tokens * 1e6:.1f} us a token ({tokens} tokens)")

if __name__ == "__main__":
    main()
