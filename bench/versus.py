"""`edgespec bench-peer`: edgespec against llama.cpp's server on the same GGUF file, in one run.

    edgespec bench-peer --prompts bench/prompts/extraction20.jsonl --max-tokens 128 --out DIR \\
        [--limit N] [--formats auto,q8_0,float32] [--policies naive,speculative] [--edgespec-args="--threads 2"]

Starts llama.cpp's OpenAI server (llama-cpp-python, see bench/llamacpp.py) on the embedded GGUF, then
`edgespec serve --weights FORMAT` for each format and policy, one server alive at a time so that they
never share the cores. Each runs every prompt, streamed, at temperature 0 and the same max_tokens, after
one warm-up request on a prompt of its own; its peak RSS is read just before it is stopped. edgespec gets
a fresh server per policy: within one server its prefix cache would hand a later policy every prompt
already prefilled (time to first token 57 ms against 699 ms in a smoke run), which llama.cpp, keeping
only the previous prompt's prefix, never gets.
The format `default` starts `edgespec serve` without --weights.

Writes DIR/versus.json (per server, format and policy: median decode tokens/s, median time to first token,
peak RSS, tokens per request, ratio of decode speed to llama.cpp's, and the roofline: weight bytes per token and
the fraction of the limit that this machine's read bandwidth, measured before the servers start, sets
(bench/roofline.py); the machine and settings),
DIR/versus_requests.jsonl (every request, with its text), DIR/versus.png and DIR/logs/ (the servers' logs).
Then, unless --long-prompt-tokens is 0, the time to first token of prompts of about that many tokens, the
servers in turn (bench/long_prompt.py): in versus.json's `long_prompt`, the table and a second panel of the PNG.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from edgespec.bench.llamacpp import ServerProcess, free_port, llama_python, llamacpp_argv, llamacpp_version
from edgespec.bench.long_prompt import first_token, long_prompt, summarise_long
from edgespec.bench.prompts import load_prompts
from edgespec.bench.roofline import add_roofline, edgespec_bytes_per_token, gguf_bytes_per_token, read_bandwidth
from edgespec.bench.run import decoding_field

REPO = Path(__file__).resolve().parents[1]
LLAMA = "llama.cpp"
EDGESPEC = "edgespec"
# llama-cpp-python's server applies a repeat penalty of 1.1 unless told otherwise: not greedy decoding,
# which edgespec does at temperature 0. Everything else at its defaults (top-k/top-p do not act at temperature 0).
LLAMA_REQUEST = {"repeat_penalty": 1.0}
WARMUP_TOKENS = 8
WARMUP_PROMPT = "Say hello."
NOTES = [
    "decode tokens/s per request = (tokens - 1) / (time of the last content chunk - time of the first), "
    "client side; medians over the prompts",
    "requests stop at end of sequence or max_tokens (no ignore_eos), so servers can generate different numbers "
    "of tokens for a prompt: see tokens_per_request and same_tokens_as_llama_cpp (prompts with as many tokens "
    "as llama.cpp's answer; same_text_as_llama_cpp: with the very same text)",
    "llama.cpp requests send repeat_penalty 1.0 (llama-cpp-python's server defaults to 1.1, which is not greedy)",
    "peak RSS: VmHWM of the server process plus each of its descendants, summed, read just before stopping it; "
    "one server runs at a time, and edgespec gets a fresh server per format and policy (no prompt is cached "
    "from another policy's run)",
]
CHUNK_NOTE = ("token_count other than 'usage': the server's stream sent no usage (llama-cpp-python's does not), so "
              "a request that finished by length counts max_tokens ('finish_length'), and one that stopped at end "
              "of sequence counts its non-empty content chunks ('content_chunks': llama-cpp-python sends one per "
              "token but merges text it holds back, such as incomplete UTF-8 or a possible stop-string prefix, so "
              "that count can be slightly low)")


def stream_chat(client: httpx.Client, model: str, prompt: str, max_tokens: int, decoding: str | dict | None = None,
                extra: dict | None = None) -> dict:
    """One streamed chat completion at temperature 0, timed client side. `decoding` (edgespec's policy field)
    is sent only when given, `extra` merged into the body. Tokens come from the stream's usage when it has
    one; else they are max_tokens when the finish reason is 'length', else the number of non-empty content
    chunks (`token_count` says which: usage, finish_length or content_chunks)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if decoding is not None:
        body["decoding"] = decoding
    body.update(extra or {})
    start = time.perf_counter()
    first = last = None
    chunks, parts, usage, finish = 0, [], None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", str(chunk["error"])))
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                    parts.append(text)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    if usage:
        tokens, counted = usage["completion_tokens"], "usage"
    elif finish == "length" and chunks <= max_tokens:  # stopped by max_tokens: exactly that many tokens
        tokens, counted = max_tokens, "finish_length"
    else:
        tokens, counted = chunks, "content_chunks"
    decode_s = (last - first) if first is not None else 0.0
    return {
        "tokens": tokens,
        "token_count": counted,
        "content_chunks": chunks,
        "finish_reason": finish,
        "ttft_ms": (first - start) * 1000 if first is not None else None,
        "decode_tokens_per_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None,
        "text": "".join(parts),
    }


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarise(records: list[dict], peak_rss: dict[tuple[str, str, str], int | None]) -> list[dict]:
    """One row per (server, format, policy), in the order the records first name them, from per-request
    records (server, format, policy, prompt, tokens, token_count, ttft_ms, decode_tokens_per_s) and the
    peak RSS in bytes per (server, format, policy)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["server"], r["format"], r["policy"]), []).append(r)
    llama_tokens = {r["prompt"]: r["tokens"] for r in records if r["server"] == LLAMA}
    llama_text = {r["prompt"]: r.get("text") for r in records if r["server"] == LLAMA}
    naive_text = {(r["format"], r["prompt"]): r.get("text") for r in records
                  if r["server"] != LLAMA and r["policy"] == "naive"}
    rows = []
    for (server, fmt, policy), runs in groups.items():
        rss = peak_rss.get((server, fmt, policy))
        row = {
            "server": server, "format": fmt, "policy": policy, "prompts": len(runs),
            "median_decode_tokens_per_s": _median(r["decode_tokens_per_s"] for r in runs),
            "median_ttft_ms": _median(r["ttft_ms"] for r in runs),
            "peak_rss_mib": round(rss / 2**20, 1) if rss is not None else None,
            "median_tokens": _median(r["tokens"] for r in runs),
            "total_tokens": sum(r["tokens"] for r in runs),
            "tokens_per_request": [r["tokens"] for r in runs],
            "token_count": ",".join(sorted({r["token_count"] for r in runs})),
            "same_tokens_as_llama_cpp": None if server == LLAMA or not llama_tokens else
            sum(r["tokens"] == llama_tokens.get(r["prompt"]) for r in runs),
            # greedy decoding of the same weights: differences come from the arithmetic (or a wrong format)
            "same_text_as_llama_cpp": None if server == LLAMA or not llama_tokens else
            sum(r.get("text") is not None and r.get("text") == llama_text.get(r["prompt"]) for r in runs),
            # exact policies: the same greedy text as naive in the same format (deliverable of issue 17)
            "same_text_as_naive": None if server == LLAMA or (fmt, runs[0]["prompt"]) not in naive_text else
            sum(r.get("text") == naive_text.get((fmt, r["prompt"])) for r in runs),
        }
        rows.append(row)
    base = next((row["median_decode_tokens_per_s"] for row in rows if row["server"] == LLAMA), None)
    for row in rows:
        rate = row["median_decode_tokens_per_s"]
        row["ratio_to_llama_cpp"] = round(rate / base, 3) if base and rate else None
    return rows


def machine_info() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    return {"cpu_model": cpu, "cpus": os.cpu_count(), "load_average_1min": _load(), "torch": torch,
            "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def gguf_format(gguf: Path) -> str:
    """The quantisation in a GGUF file's name, e.g. Q4_1 for SmolLM2-135M-Instruct.Q4_1.gguf."""
    parts = gguf.name.split(".")
    return parts[-2] if len(parts) > 2 else "gguf"


def edgespec_argv(fmt: str, port: int, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "edgespec.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]
    if fmt != "default":
        argv += ["--weights", fmt]
    return argv + extra  # last: these may override the log level


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _short_error(exc: BaseException) -> str:
    """The first line of an error (which names the log) and the last of its log tail (the exception)."""
    lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _split(names: str) -> list[str]:
    return [n.strip() for n in names.split(",") if n.strip()]


def model_gguf(model: str) -> Path:
    """The GGUF llama.cpp serves for `model`: the file itself, or the one a folder's weights are in (a scale
    model's, whose tokenizer and chat template edgespec reads from the folder)."""
    from edgespec.model.source import resolve_model

    gguf = resolve_model(model).gguf
    if gguf is None:
        raise ValueError(f"{model} has no GGUF file for llama.cpp to serve")
    return gguf


def run_versus(args) -> dict:
    from edgespec.model.source import default_gguf

    console = Console()
    if not console.is_terminal and console.width < 170:  # piped into a log: do not squeeze the table
        console = Console(width=170)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(Path(args.prompts), args.limit)
    formats, policies = _split(args.formats), _split(args.policies)
    gguf = model_gguf(args.model) if args.model else default_gguf()
    extra = (["--model", args.model] if args.model else []) + shlex.split(args.edgespec_args or "")
    python = llama_python(args.llama_python)
    results: dict = {
        "settings": {"prompts_file": str(args.prompts), "limit": args.limit, "prompts": len(prompts),
                     "max_tokens": args.max_tokens, "temperature": 0, "gguf": str(gguf), "formats": formats,
                     "policies": policies, "edgespec_args": extra,
                     "llama_cpp": {"python": python, "llama_cpp_python": llamacpp_version(python),
                                   "n_threads": args.llama_threads, "n_ctx": args.llama_ctx,
                                   "request_fields": LLAMA_REQUEST}},
        "machine": machine_info(),
        "servers": {},
    }
    # measured alone, before any server starts
    console.print("measuring this machine's read bandwidth and each format's weight bytes per token")
    results["roofline"] = read_bandwidth()
    per_token = {LLAMA: gguf_bytes_per_token(gguf),
                 **{fmt: edgespec_bytes_per_token(fmt, args.model) for fmt in formats}}
    # (server, format, policy, decoding field, extra request fields, argv for a port, readiness path)
    setups = [(LLAMA, gguf_format(gguf), LLAMA, None, LLAMA_REQUEST,
               lambda port: llamacpp_argv(python, gguf, port, args.llama_threads, args.llama_ctx), "/v1/models")]
    for fmt in formats:
        for policy in policies:
            setups.append((EDGESPEC, fmt, policy, decoding_field(policy), None,
                           lambda port, fmt=fmt: edgespec_argv(fmt, port, extra), "/health"))
    records: list[dict] = []
    peak_rss: dict[tuple[str, str, str], int | None] = {}
    live: list[tuple] = []  # (setup, label, process, client, model) of the servers that started
    # Every server is up at once and the prompts go round them in turn, one request at a time: the machine
    # is shared and its speed drifts by 20% between minutes, which one server after another turned into
    # differences between configurations (a naive run measured 77 and then 64 tokens/s with the same code).
    with Progress(console=console) as progress, contextlib.ExitStack() as stack:
        task = progress.add_task("bench-peer", total=len(prompts) * len(setups))
        for setup in setups:
            server, fmt, policy, decoding, fields, argv, ready = setup
            port = free_port()
            label = " ".join(dict.fromkeys((server, fmt, policy)))  # llama.cpp's policy is its name
            info = results["servers"][label] = {"server": server, "format": fmt, "policy": policy,
                                                "argv": argv(port), "load_average_at_start": _load()}
            progress.update(task, description=f"{label}: starting")
            log = out / "logs" / (label.replace(" ", "-").replace(":", "_").replace("/", "_") + ".log")
            proc = ServerProcess(label, info["argv"], port, log, ready, cwd=REPO)
            stack.callback(proc.stop)
            try:
                proc.wait_ready(args.ready_timeout_s)
                client = stack.enter_context(httpx.Client(base_url=proc.url, timeout=600))
                model = info["model"] = client.get("/v1/models").json()["data"][0]["id"]
                # first requests pay one-off costs; a prompt of its own, so no measured prompt is cached
                stream_chat(client, model, WARMUP_PROMPT, WARMUP_TOKENS, decoding, fields)
                live.append((setup, label, proc, client, model))
            except (RuntimeError, TimeoutError, httpx.HTTPError, KeyError, ValueError) as exc:
                info["error"] = _short_error(exc)
                console.print(f"[red]{label} failed, left out of the results:[/red] {exc}")
                proc.stop()
        done: dict[str, list[dict]] = {label: [] for _, label, *_ in live}
        for i, prompt in enumerate(prompts):
            for (server, fmt, policy, decoding, fields, *_), label, _proc, client, model in live:
                if "error" in results["servers"][label]:
                    continue
                progress.update(task, description=f"prompt {i + 1}: {label}")
                try:
                    r = stream_chat(client, model, prompt, args.max_tokens, decoding, fields)
                    done[label].append({"server": server, "format": fmt, "policy": policy, "prompt": i, **r})
                except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as exc:
                    results["servers"][label]["error"] = _short_error(exc)
                    console.print(f"[red]{label} failed, left out of the results:[/red] {exc}")
                progress.advance(task)
        if args.long_prompt_tokens:
            results["long_prompt"] = time_long_prompts(args, prompts, live, results["servers"], progress)
        for (server, fmt, policy, *_), label, proc, *_ in live:
            info = results["servers"][label]
            if "error" in info:
                continue
            info["load_average_at_end"] = _load()
            rss = peak_rss[(server, fmt, policy)] = proc.peak_rss_bytes()
            info["peak_rss_mib"] = round(rss / 2**20, 1) if rss is not None else None
            records += done[label]
    results["configurations"] = summarise(records, peak_rss)
    add_roofline(results["configurations"], results["roofline"]["median_gb_per_s"] * 1e9, per_token)
    notes = list(NOTES)
    if any(r["token_count"] != "usage" for r in records):
        notes.append(CHUNK_NOTE)
    results["notes"] = notes
    (out / "versus.json").write_text(json.dumps(results, indent=2))
    with open(out / "versus_requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    from edgespec.bench.plot import plot_versus

    if results["configurations"]:
        plot_versus(results, out / "versus.png")
    print_table(console, results)
    console.print(f"wrote {out / 'versus.json'}, {out / 'versus_requests.jsonl'} and {out / 'versus.png'}")
    return results


def time_long_prompts(args, prompts: list[str], live: list[tuple], servers: dict, progress: Progress) -> dict:
    """bench/long_prompt.py's first-token times, the live servers in turn per repetition."""
    times: dict[str, list[dict]] = {label: [] for _, label, *_ in live}
    task = progress.add_task("long prompts", total=args.long_prompt_repeats * len(live))
    for rep in range(args.long_prompt_repeats):
        prompt = long_prompt(prompts, args.long_prompt_tokens, rep)
        for (_, _, _, _, fields, *_), label, _proc, client, model in live:
            if "error" not in servers[label]:
                try:
                    times[label].append(first_token(client, model, prompt, fields))
                except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as exc:
                    servers[label]["error"] = _short_error(exc)
            progress.advance(task)
    reference = next((label for (server, *_), label, *_ in live if server == LLAMA), "")
    return {"tokens": args.long_prompt_tokens, "repeats": args.long_prompt_repeats,
            "servers": summarise_long(times, reference)}


def _cell(value, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_table(console: Console, results: dict) -> None:
    s, m = results["settings"], results["machine"]
    table = Table(title=f"{s['prompts']} prompts, max {s['max_tokens']} tokens, greedy; {m['cpu_model']}")
    for col in ("server", "format", "policy", "decode tok/s", "TTFT ms", "RSS MiB", "tokens", "tokens = llama.cpp",
                "text = llama.cpp", "text = naive", "× llama.cpp", "MiB/token", "of roofline"):
        table.add_column(col)
    for row in results["configurations"]:
        same = [row[k] for k in ("same_tokens_as_llama_cpp", "same_text_as_llama_cpp", "same_text_as_naive")]
        table.add_row(row["server"], row["format"], row["policy"], _cell(row["median_decode_tokens_per_s"]),
                      _cell(row["median_ttft_ms"], 0), _cell(row["peak_rss_mib"], 0), _cell(row["median_tokens"], 0),
                      *("" if n is None else f"{n}/{row['prompts']}" for n in same),
                      _cell(row["ratio_to_llama_cpp"], 2), _cell(row.get("weight_mib_per_token")),
                      _cell(row.get("fraction_of_roofline"), 2),
                      style="bold yellow" if row["server"] == LLAMA else None)
    console.print(table)
    for label, row in (results.get("long_prompt") or {}).get("servers", {}).items():
        console.print(f"first token of a {'/'.join(map(str, row['prompt_tokens']))}-token prompt, {label}: median "
                      f"{row['median_first_token_ms']} ms, x{row['ratio_to_llama_cpp']} llama.cpp's")
    if roof := results.get("roofline"):
        console.print(f"read bandwidth {roof['median_gb_per_s']} GB/s ({roof['method']}, {roof['threads']} threads)")
    for label, info in results["servers"].items():
        if "error" in info:
            console.print(f"[red]{label} failed:[/red] {info['error']}")
