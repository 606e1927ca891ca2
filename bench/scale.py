"""Scale models against the planner: each setup's predicted decode and prefill times beside the measured ones.

    python -m edgespec.bench.scale --out DIR [--setup tinyllama-3w --setup llama-2-7b-4w ...] [--no-derived]
        [--planned qwen3-30b-a3b-4w]

Per setup (a scale model from `edgespec synth-model`, N local workers with a memory budget each):
1. `edgespec profile --local-workers N --worker-memory-budget-gib G` of that model writes DIR/profile-SETUP.json;
2. the planner's placement over it (the same PlanOptions `serve` gets) predicts decode ms/token at context 512
   and the prefill (time to first token) of each prompt length;
3. `edgespec serve --profile` that file with the same workers serves it; through the OpenAI streaming API, greedy
   naive decoding of `decode_tokens` after a prompt of 512 - decode_tokens / 2 tokens (mean context 512), and
   prompts of each length for prefill; medians of `reps` distinct prompts (the prefix cache is off);
4. the placement the server shows (/dashboard/state) is checked against the plan's;
5. a worker killed mid-stream (SIGKILL of the one holding the middle layers after a quarter of the tokens): the
   stream's text against the same request's without the fault (`killed_worker`).
The derived-testbed method (planning/testbeds.py's roofline scaling): the controller's curves of the first
setup's profile are the reference; this machine's bandwidth and peak are measured; the prediction for another
shape (in-process: every layer, the embedding and the head) is derived from them, and that shape is measured
in-process the same way. Writes DIR/scale.json and DIR/scale.png. Measure alone: nothing else running.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from edgespec.bench.distributed import start
from edgespec.planning.experts import n_away
from edgespec.planning.plan import PlanOptions, make_plan
from edgespec.planning.profile import ClusterProfile


@dataclass(frozen=True)
class Setup:
    shape: str
    weights: str
    workers: int  # 0: in-process
    budget_gib: float | None
    context: int = 2048  # the plan's KV slots per session
    concurrency: int = 1
    prefill: tuple[int, ...] = (128, 512, 1024)
    decode_tokens: int = 64
    reps: int = 3
    kv_format: str | None = None  # serve's and profile's --kv-format (None: no flag, their default)

    def kv_args(self) -> list[str]:
        return ["--kv-format", self.kv_format] if self.kv_format else []


SETUPS = {
    # TinyLlama-1.1B in Q4_1: 0.68 GiB of layers (0.82 GiB with the ends); each worker may hold 0.3 GiB
    "tinyllama-3w": Setup("tinyllama-1.1b", "q4_1", 3, 0.3),
    # Llama-2-7B in Q4_1: 4.5 GiB of layers; each worker may hold 1.5 GiB
    "llama-2-7b-4w": Setup("llama-2-7b", "q4_1", 4, 1.5, context=1024, prefill=(128, 512), decode_tokens=32,
                           reps=3),
    # Qwen3-4B in Q4_1 (q/k norms, heads of 128 wider than hidden / heads): its GGUF is 2,684,896,832 bytes (2.50
    # GiB; 2.54 GiB of layers in the workers' Q4 layout); each worker may hold 1.2 GiB, under half the file, so no
    # two workers hold it; the KV cache in Q8_0
    "qwen3-4b-3w": Setup("qwen3-4b", "q4_1", 3, 1.2, context=1024, prefill=(128, 512), decode_tokens=16, reps=2,
                         kv_format="q8_0"),
    # Qwen3-MoE-7B-A1B in Q4_1 (issue 40): 7.4B parameters, 1.1B of its layers' read a token; each worker may hold
    # 1.25 GiB, under a third of its layers, beside llama-2-7b-4w (a dense 6.7B over the same number of workers)
    "qwen3-moe-7b-a1b-4w": Setup("qwen3-moe-7b-a1b", "q4_1", 4, 1.25, context=1024, prefill=(128, 512),
                                 decode_tokens=32, reps=3),
    # the same mixture over 5 workers of 1.01 GiB: beside its 40 MiB of rotary tables, 4.86 of its 0.2 GiB layers
    # (with their KV for 1024 tokens) a worker, 24.3 in all but 20 whole ones, so the planner places some experts
    # apart from their layers (planning/experts.py) and the passes call for them
    "qwen3-moe-7b-a1b-5w-apart": Setup("qwen3-moe-7b-a1b", "q4_1", 5, 1.01, context=1024, prefill=(128, 512),
                                       decode_tokens=32, reps=3),
    # its control: the same 5 workers with room for whole layers (what the experts apart cost, the fifth process
    # and its hop aside)
    "qwen3-moe-7b-a1b-5w": Setup("qwen3-moe-7b-a1b", "q4_1", 5, 1.25, context=1024, prefill=(128, 512),
                                 decode_tokens=32, reps=3),
}
# Shapes this machine cannot hold (Qwen3-30B-A3B in Q4_1: 20.9 GiB of layers in the workers' layout, with the
# processes beside them past this machine's 23 GiB), planned over a measured setup's devices instead: name ->
# (shape, the measured setup whose profile it scales, each worker's budget in GiB)
PLANNED = {"qwen3-30b-a3b-4w": ("qwen3-30b-a3b", "qwen3-moe-7b-a1b-4w", 6.0)}

DERIVED = Setup("llama-3.2-1b", "q4_1", 0, None)


def run(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed; see {log}")


def edgespec(*args: str) -> list[str]:
    return [sys.executable, "-m", "edgespec.server.cli", *args]


def prompt_of(tokenizer, n: int, seed: int) -> str:
    """A user message of about n tokens once templated: random words of the tokenizer (the text is noise)."""
    rng = random.Random(seed)
    overhead = len(tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True))
    ids = [rng.randrange(1000, 20000) for _ in range(max(1, n - overhead))]
    return tokenizer.decode(ids)


def stream(client: httpx.Client, model: str, prompt: str, tokens: int, on_token=None) -> dict:
    """One greedy naive streamed completion of exactly `tokens` tokens: TTFT, decode ms/token and the tokens
    (each as its logprobs entry's bytes); on_token(n) after the n-th. Tokens are timed and told by their chunks'
    logprobs, which come for every token: a scale model's random tokens often show no text (a byte of a
    character, or an id past its tokenizer's)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "stream": True,
            "max_tokens": tokens, "min_tokens": tokens, "decoding": "naive", "logprobs": True,
            "stream_options": {"include_usage": True}}
    start_s, first, last, usage, seen = time.perf_counter(), None, None, None, []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and (content := (chunk["choices"][0].get("logprobs") or {}).get("content")):
                first = first or time.perf_counter()
                last = time.perf_counter()
                for entry in content:
                    seen.append(entry["bytes"])
                    if on_token is not None:
                        on_token(len(seen))
            usage = chunk.get("usage") or usage
    n = usage["completion_tokens"]
    return {"prompt_tokens": usage["prompt_tokens"], "tokens": n, "ttft_ms": 1000 * (first - start_s),
            "decode_ms_per_token": 1000 * (last - first) / (n - 1) if n > 1 else None, "token_bytes": seen}


def measure(url: str, setup: Setup, tokenizer) -> dict:
    """Decode at mean context 512 and prefill at each length, medians over distinct prompts."""
    client = httpx.Client(base_url=url, timeout=1800)
    model = client.get("/v1/models").json()["data"][0]["id"]
    stream(client, model, prompt_of(tokenizer, 64, 0), 4)  # warm-up
    decode = [stream(client, model, prompt_of(tokenizer, 512 - setup.decode_tokens // 2, 100 + i),
                     setup.decode_tokens) for i in range(setup.reps)]
    prefill = {n: [stream(client, model, prompt_of(tokenizer, n, 1000 * n + i), 2) for i in range(setup.reps)]
               for n in setup.prefill}
    return {
        "decode_runs": decode,
        "decode_ms_per_token": statistics.median(r["decode_ms_per_token"] for r in decode),
        "decode_mean_context": statistics.median(r["prompt_tokens"] + r["tokens"] / 2 for r in decode),
        "prefill_runs": {str(n): runs for n, runs in prefill.items()},
        "prefill_ms": {str(n): statistics.median(r["ttft_ms"] for r in runs) for n, runs in prefill.items()},
        "prefill_prompt_tokens": {str(n): statistics.median(r["prompt_tokens"] for r in runs)
                                  for n, runs in prefill.items()},
    }


def serve_args(setup: Setup, model: Path) -> list[str]:
    args = ["--model", str(model), "--policy", "naive", "--prefix-cache-mib", "0", "--log-level", "warning",
            "--plan-context", str(setup.context), "--plan-concurrency", str(setup.concurrency)]
    if setup.workers:
        args += ["--local-workers", str(setup.workers)]
    if setup.budget_gib:
        args += ["--worker-memory-budget-gib", str(setup.budget_gib)]
    return args + setup.kv_args()


def distributed(name: str, setup: Setup, out: Path) -> dict:
    """Profile, plan, serve and measure one setup over local workers."""
    from edgespec.model.load import load_tokenizer
    from edgespec.model.source import resolve_model
    from edgespec.model.synth import synthesize

    model = synthesize(setup.shape, weights=setup.weights)
    profile_path = out / f"profile-{name}.json"
    t0 = time.monotonic()
    run(edgespec("profile", "--local-workers", str(setup.workers), "--worker-memory-budget-gib",
                 str(setup.budget_gib), "--model", str(model), "--out", str(profile_path), *setup.kv_args()),
        out / f"profile-{name}.log")
    profile_s = time.monotonic() - t0
    profile = ClusterProfile.load(profile_path)
    plan = make_plan(profile, PlanOptions(context=setup.context, concurrency=setup.concurrency))
    proc, url = start([*serve_args(setup, model), "--profile", str(profile_path)], out / f"serve-{name}.log")
    try:
        shown = httpx.get(url + "/dashboard/state", timeout=10).json()
        tokenizer = load_tokenizer(resolve_model(str(model)))
        measured = measure(url, setup, tokenizer)
        devices = httpx.get(url + "/dashboard/state", timeout=10).json()["devices"]
        controller_rss = psutil.Process(proc.pid).memory_info().rss
        killed = killed_worker(url, proc.pid, prompt_of(tokenizer, 64, 7))
    finally:
        proc.terminate()
        proc.wait(60)
    layout = " · ".join(f"{s.device} [{s.first}, {s.last})" for s in plan.stages)
    predicted_prefill = {n: plan.predicted_prefill_ms(int(t)) for n, t in measured["prefill_prompt_tokens"].items()}
    weights = sum(s.weight_bytes for s in plan.stages)
    return {
        "setup": dataclasses.asdict(setup), "model": str(model), "profile": str(profile_path),
        "profile_seconds": round(profile_s, 1),
        "layer_weights_gib": weights / 2**30, "worker_budget_gib": setup.budget_gib,
        "placement": layout, "placement_served": shown["layout"], "placement_matches": shown["layout"] == layout,
        "stages": [dataclasses.asdict(s) for s in plan.stages],
        "experts_apart": sum(n_away(s.away) for s in plan.stages),
        # what the workers hold after the run (memory_use: weights plus KV over the budget), and the controller's
        # whole resident memory (Python, torch, the tokenizer and the token ends: no layer)
        "devices_served": devices, "controller_resident_gib": controller_rss / 2**30,
        "prefill_cuts": {n: plan.sequence_cuts(int(t)) for n, t in measured["prefill_prompt_tokens"].items()},
        "predicted": {"decode_ms_per_token": plan.decode_ms_per_token, "prefill_ms": predicted_prefill},
        "measured": measured, "killed_worker": killed,
        "error": errors(plan.decode_ms_per_token, predicted_prefill, measured),
    }


def killed_worker(url: str, controller: int, prompt: str, tokens: int = 32) -> dict:
    """A greedy stream of `tokens` with the worker of the middle layers killed (SIGKILL) after a quarter of them,
    against the same request without the fault: whether it gave the same tokens, and its longest gap."""
    from edgespec.bench.faults import worker_pid

    with httpx.Client(base_url=url, timeout=1800) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        reference = stream(client, model, prompt, tokens)
        workers = client.get("/health").json()["workers"]
        target = workers[len(workers) // 2]
        pid, times = worker_pid(controller, target), []

        def on_token(n: int) -> None:
            times.append(time.perf_counter())
            if n == tokens // 4:
                os.kill(pid, signal.SIGKILL)

        try:
            run = stream(client, model, prompt, tokens, on_token)
        except RuntimeError as exc:  # an error event: the fault cost the stream
            return {"worker": target["name"], "layers": target.get("layers"), "completed": False, "error": str(exc)}
    return {"worker": target["name"], "layers": target.get("layers"), "after_tokens": tokens // 4, "completed": True,
            "same_tokens": run["token_bytes"] == reference["token_bytes"], "tokens": run["tokens"],
            "longest_gap_ms": round(1000 * max(b - a for a, b in itertools.pairwise(times)), 1),
            "reference_decode_ms_per_token": round(reference["decode_ms_per_token"], 2)}


def errors(decode: float, prefill: dict, measured: dict) -> dict:
    """(predicted - measured) / measured, for decode and each prefill length."""
    return {"decode": round((decode - measured["decode_ms_per_token"]) / measured["decode_ms_per_token"], 4),
            "prefill": {n: round((p - measured["prefill_ms"][n]) / measured["prefill_ms"][n], 4)
                        for n, p in prefill.items()}}


def machine_spec():
    """This machine as a DeviceSpec: DRAM bandwidth from a 1 GiB copy and peak from a float32 matmul, now."""
    import torch

    from edgespec.planning.testbeds import DeviceSpec
    from edgespec.workers.host import total_memory_bytes

    def best_s(fn, reps: int = 5) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    a = torch.ones(2**28)
    b = torch.empty_like(a)
    bandwidth = 2 * a.nbytes / best_s(lambda: b.copy_(a))  # read and write
    m = torch.randn(2048, 2048)
    peak = 2 * 2048**3 / best_s(lambda: m @ m)
    return DeviceSpec("this-machine", "here", total_memory_bytes() / 2**30, 0.0, bandwidth / 1e9, peak / 1e9,
                      "measured by bench/scale.py")


def in_process_prediction(layer, embed, head, n_layers: int, lengths) -> dict:
    """Every layer, the embedding and the head in one process: decode at context 512, prefill as one pass."""
    return {"decode_ms_per_token": n_layers * layer(1, 512) + embed(1) + head(1),
            "prefill_ms": {str(n): n_layers * layer(n, 0) + embed(n) + head(1) for n in lengths}}


def in_process(setup: Setup, out: Path, name: str, predict) -> dict:
    """Serve a scale model in-process and measure it beside predict(cfg, card, prefill lengths)."""
    from edgespec.model.config import ModelConfig
    from edgespec.model.load import load_tokenizer
    from edgespec.model.source import resolve_model
    from edgespec.model.synth import synthesize

    model = synthesize(setup.shape, weights=setup.weights)
    proc, url = start(serve_args(setup, model), out / f"serve-{name}.log")
    try:
        measured = measure(url, setup, load_tokenizer(resolve_model(str(model))))
    finally:
        proc.terminate()
        proc.wait(60)
    lengths = [int(t) for t in measured["prefill_prompt_tokens"].values()]
    predicted = predict(ModelConfig.from_folder(model), lengths)
    predicted["prefill_ms"] = dict(zip(measured["prefill_prompt_tokens"], predicted["prefill_ms"].values(),
                                       strict=True))
    return {"setup": dataclasses.asdict(setup), "model": str(model), "predicted": predicted, "measured": measured,
            "error": errors(predicted["decode_ms_per_token"], predicted["prefill_ms"], measured)}


def planned(shape: str, reference: ClusterProfile, budget_gib: float, setup: Setup) -> dict:
    """A shape too large to serve here, planned over a measured profile's devices: every device's layer curve
    scaled by roofline to the shape's layer (planning/testbeds.py's scale_curve, this machine's measured bandwidth
    and peak for both: at one row, the ratio of the bytes a token reads; a mixture reads its chosen experts),
    its ends' curves kept (the same vocabulary and width, or the scaling is refused), each worker `budget_gib`.
    The planner's placement and predicted decode and prefill, as for a measured setup."""
    from edgespec.model.config import ModelConfig
    from edgespec.model.synth import hf_config, load_shape
    from edgespec.model.timing import model_card
    from edgespec.planning.testbeds import part_costs, scale_curve

    ref = reference.model
    cfg = ModelConfig.from_hf_dict(hf_config(load_shape(shape), 0, 1))
    card = dataclasses.replace(model_card(cfg, shape, setup.weights), weight_bytes_per_param=ref.weight_bytes_per_param,
                               kv_bytes_per_value=ref.kv_bytes_per_value,
                               activation_bytes_per_value=ref.activation_bytes_per_value)
    if (card.ends_params, card.hidden_size) != (ref.ends_params, ref.hidden_size):
        raise ValueError(f"{shape}'s token ends differ from {ref.name}'s: their curves would need scaling too")
    spec = machine_spec()
    ref_cost, cost = part_costs(ref, None)["layer"], part_costs(card, None)["layer"]

    def scaled(d, capacity: int):
        return dataclasses.replace(d, layer_ms=scale_curve(d.layer_ms, ref_cost, spec, cost, spec),
                                   memory_capacity_bytes=capacity)

    profile = dataclasses.replace(reference, model=card,
                                  controller=scaled(reference.controller, reference.controller.memory_capacity_bytes),
                                  workers=[scaled(w, int(budget_gib * 2**30)) for w in reference.workers])
    plan = make_plan(profile, PlanOptions(context=setup.context, concurrency=setup.concurrency))
    return {"shape": shape, "reference_setup_model": ref.name, "worker_budget_gib": budget_gib,
            "layer_weights_gib": card.n_layers * card.layer_weight_bytes() / 2**30,
            "layer_read_params_one_row": {"shape": card.layer_read_params(1), "reference": ref.layer_read_params(1)},
            "placement": " · ".join(f"{s.device} [{s.first}, {s.last})" for s in plan.stages),
            "predicted": {"decode_ms_per_token": plan.decode_ms_per_token,
                          "prefill_ms": {str(n): plan.predicted_prefill_ms(n) for n in setup.prefill}}}


def derived(reference: ClusterProfile, out: Path) -> dict:
    """The derived-testbed method on this machine: the reference's measured curves, scaled by roofline to
    DERIVED's shape, against DERIVED served in-process; and the reference shape itself in-process (its own
    curves, unscaled), which separates the serving path's overhead from the scaling's error."""
    from edgespec.model.timing import model_card
    from edgespec.planning.testbeds import derive_device

    spec = machine_spec()
    ref_setup = dataclasses.replace(SETUPS["tinyllama-3w"], workers=0, budget_gib=None)
    c = reference.controller
    own = in_process(ref_setup, out, "reference-in-process",
                     lambda cfg, lengths: in_process_prediction(c.layer_ms, c.embed_ms, c.head_ms, cfg.n_layers,
                                                                lengths))

    def scaled(cfg, lengths):
        card = model_card(cfg, DERIVED.shape, "auto", from_gguf=True)
        layer, embed, head = derive_device(spec, card, reference, spec, vocab=cfg.vocab_size)
        return in_process_prediction(layer, embed, head, cfg.n_layers, lengths)

    target = in_process(DERIVED, out, "derived", scaled)
    return {"machine": dataclasses.asdict(spec), "reference": reference.model.name, "reference_in_process": own,
            "target": target}


def plot(result: dict, path: Path) -> None:
    """Predicted beside measured: decode ms/token per setup, and prefill ms per setup and length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = dict(result["setups"])
    if "derived" in result:
        rows["tinyllama in-process"] = result["derived"]["reference_in_process"]
        rows[f"{DERIVED.shape} derived"] = result["derived"]["target"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    decode = [(n, r["predicted"]["decode_ms_per_token"], r["measured"]["decode_ms_per_token"]) for n, r in rows.items()]
    prefill = [(f"{n}\n{k} tok", r["predicted"]["prefill_ms"][k], r["measured"]["prefill_ms"][k])
               for n, r in rows.items() for k in r["measured"]["prefill_ms"]]
    for ax, data, label in ((axes[0], decode, "decode ms/token (context 512)"), (axes[1], prefill, "prefill ms")):
        xs = range(len(data))
        ax.bar([x - 0.2 for x in xs], [d[1] for d in data], 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [d[2] for d in data], 0.4, label="measured")
        ax.set_xticks(list(xs), [d[0] for d in data], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle("scale models: the planner's predictions against measurement (OpenAI streaming API)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--setup", action="append", choices=[*SETUPS, "none"],
                   help="setups to run (default: all; none: only the derived method, on an earlier profile)")
    p.add_argument("--planned", action="append", choices=list(PLANNED),
                   help="also plan a shape too large to serve here over a measured setup's profile in --out")
    p.add_argument("--derived", action=argparse.BooleanOptionalAction, default=True,
                   help="also the derived-testbed method (needs the tinyllama-3w profile)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "scale.json"
    # written after each part, and kept: a setup not asked for again keeps its result from an earlier run
    result = json.loads(path.read_text()) if path.exists() else {"setups": {}}
    for name in [n for n in args.setup or SETUPS if n != "none"]:
        result["setups"][name] = distributed(name, SETUPS[name], args.out)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({name: {k: result["setups"][name][k] for k in ("placement", "predicted", "error")}}))
    for name in args.planned or []:
        shape, ref_name, budget = PLANNED[name]
        reference = ClusterProfile.load(args.out / f"profile-{ref_name}.json")
        result.setdefault("planned", {})[name] = planned(shape, reference, budget, SETUPS[ref_name])
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({name: result["planned"][name]}))
    if args.derived:
        reference = ClusterProfile.load(args.out / "profile-tinyllama-3w.json")
        result["derived"] = derived(reference, args.out)
        path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "scale.png")
    print(json.dumps({n: r["error"] for n, r in result["setups"].items()}, indent=1))


if __name__ == "__main__":
    main()
