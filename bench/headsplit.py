"""HeadSplit's comparison mode (the paper's `--mode all`): layer-based partitioning, head-level partitioning
without speculation and HeadSplit on the same prompt over real workers, beside the simulator's prediction of
the same setting.

    edgespec compare-headsplit --out DIR [--model tinyllama-1.1b] [--tokens 128] [--workers 2,3,4,5]
        [--link wifi | --rate 100mbit --delay-ms 1] [--epsilon 0.05 0.3] [--mode all] [--no-perplexity]

--model: a model folder, or a scale-model shape (model/synth.py, written once in bf16; default: the embedded
model). Each worker count of --workers runs in turn; workers are pinned one per core where there are cores
enough (worker i on CPU i mod cores), one thread each. Without --link, on loopback; with it, in network
namespaces on shaped links (bench/headsplit_net.py). Every mode runs bf16. Layer-based runs through `edgespec
serve` over N workers (even layer ranges by default: the paper's baseline); the head modes run on N workers
of their own through workers/head_client.py, the projection worker gathering each layer and calling its peers
over its links to them (the controller sees one call per token on its link), and all decode the same prompt
greedily for --tokens tokens. Head modes:
- head-level: KV groups spread evenly over the workers, no speculation (also with the controller gathering
  every layer itself, to show what gathering at a worker saves);
- HeadSplit at each epsilon, placed by the planner from the acceptance and block times and the measured round
  trip of a call on a link plus 15%;
- HeadSplit with groups spread and every layer after the first speculating, to show what the overlap does when
  speculation runs (the planner may enable none on this machine).
Acceptance: the model's own profile (config/profiles/*-headsplit.json); a model without one (a scale model,
whose text is noise) takes the embedded model's profiled alpha mapped onto its layers by relative depth. Block
times: the profile's for the placement where the model has one (as before); else, and for the prediction
always, this machine's for the model, measured as the workers run the blocks (headsplit_net.measure_blocks:
one thread, over the whole model). Beside each measured mode: the simulator's ms per token and speedup for the
same setting (bench/headsplit_sim.predict_setting: those block times, the measured round trip, n devices, the
placements measured, the acceptance); with the measured share of speculations kept; and on shaped links
without a delay (no netem), with the link's own round trip added. Also the held-out perplexity of
each HeadSplit mode against exact (the profile's held-out answers, float32; not for a scale model). Writes
DIR/headsplit.json and DIR/headsplit.png (speedup over layer-based by worker count, measured and predicted) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import torch

from edgespec.bench.headsplit_net import (
    link_spec,
    measure_blocks,
    overtakes,
    print_table,
    setting,
    speedup_chart,
    worker_cpus,
)
from edgespec.bench.headsplit_sim import depth_alphas, predict_setting
from edgespec.decoding.headsplit_profile import load_profile
from edgespec.decoding.outline import chat_ids
from edgespec.decoding.training.distill_data import generate_answers, training_prompts
from edgespec.decoding.training.profile_headsplit import held_out_perplexity
from edgespec.model.config import ModelConfig
from edgespec.model.source import ModelFiles, resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.synth import synthesize
from edgespec.model.timing import model_card
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import (
    HeadDevice,
    LayerPlace,
    head_card,
    place,
    profiled_alphas,
    profiled_devices,
    spread,
)
from edgespec.workers.head_client import call_ms, remote_headsplit

PROMPT = "What are some tips for staying healthy while working from home?"
DISTILL = Path.home() / ".cache" / "edgespec" / "distill"


def layer_based(net, workers: int, tokens: int, log: Path, serve_args: list[str]) -> dict:
    """The layer pipeline through the API: median ms per decoded token (from the server's decode rate) and
    wire bytes and requests per token."""
    proc, url = net.layer_server(workers, serve_args, log)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "temperature": 0, "max_tokens": tokens, "decoding": "naive",
                "messages": [{"role": "user", "content": PROMPT}]}
        runs = [httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()["decoding"] for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(30)
    return {"median_ms_per_token": round(1000 / statistics.median(r["decode_tokens_per_s"] for r in runs), 3),
            "payload_bytes_per_token": round(statistics.median(r["wire_bytes_per_token"] for r in runs), 1),
            "calls_per_token": round(statistics.median(r["wire_requests_per_token"] for r in runs), 2)}


def head_mode(urls: dict[str, str], token: str, cfg: ModelConfig, layers: list[LayerPlace], epsilon: float,
              ends: TokenEnds, prompt: list[int], tokens: int, gathered: bool = True, model: str | None = None
              ) -> dict:
    """Greedy decoding of the prompt through HeadSplit blocks on the workers: median ms per token, payload
    bytes and calls per token on every link (controller and worker to worker), speculations kept/discarded."""
    pipe = remote_headsplit(urls, token, layers, cfg, dtype="bfloat16", model=model, epsilon=epsilon,
                            gathered=gathered)
    pipe.open("bench", len(prompt) + tokens + 1)
    times = []
    devices = list(pipe.devices.values())
    with torch.inference_mode():
        hidden = pipe.forward("bench", ends.embed_tokens(torch.tensor([prompt])), torch.arange(len(prompt))[None], 0)
        token_id = int(ends.logits(hidden[:, -1:])[0, -1].argmax())
        before = sum(d.payload[0] + d.payload[1] for d in devices), sum(d.calls for d in devices)
        wire_before = {link: list(v) for link, v in pipe.wire_stats["bench"].items()}
        for p in range(len(prompt), len(prompt) + tokens - 1):
            t0 = time.perf_counter()
            hidden = pipe.forward("bench", ends.embed_tokens(torch.tensor([[token_id]])), torch.tensor([[p]]), p)
            token_id = int(ends.logits(hidden)[0, -1].argmax())
            times.append(time.perf_counter() - t0)
    stats, steps = pipe.stats["bench"], len(times)
    sent = sum(d.payload[0] + d.payload[1] for d in devices) - before[0]
    calls = sum(d.calls for d in devices) - before[1]
    for link, (b, n) in pipe.wire_stats["bench"].items():  # the workers' calls to their peers
        if link.endswith("-peers"):
            sent, calls = sent + b - wire_before.get(link, [0, 0])[0], calls + n - wire_before.get(link, [0, 0])[1]
    pipe.release("bench")
    pipe.close()
    return {"median_ms_per_token": round(1000 * statistics.median(times), 3),
            "payload_bytes_per_token": round(sent / steps, 1), "calls_per_token": round(calls / steps, 2),
            "speculating_layers": sum(lp.speculate for lp in layers),
            "speculations_kept": sum(stats.kept), "speculations_discarded": sum(stats.discarded),
            "kept_share_by_layer": [round(k / (k + d), 3) if k + d else None
                                    for k, d in zip(stats.kept, stats.discarded, strict=True)]}


def spread_placement(cfg: ModelConfig, names: list[str], speculate: bool) -> list[LayerPlace]:
    """Head-level: every layer's KV groups spread evenly over the devices (rotating), the projection and the FFN
    on the first device (where the planner puts them on links that cost more than an FFN); with `speculate`,
    every layer after the first speculates."""
    return [LayerPlace(spread(cfg.n_kv_heads, names[i % len(names):] + names[:i % len(names)]), names[0],
                       names[0], speculate and i > 0) for i in range(cfg.n_layers)]


def heldout_rows(files, record: dict, data: Path) -> list[dict]:
    """The profile's held-out prompts and their greedy answers (cached by profile-headsplit)."""
    cal, n = record["calibration"]["prompts"], record["held_out"]["prompts"]
    prompts = training_prompts(data)[:cal + n]
    rows = generate_answers(files.folder, prompts, DISTILL / "answers.jsonl", 256, 32)
    return [r for r in rows if r["index"] >= cal]


def target(arg: str | None) -> tuple[str | None, ModelFiles, dict | None]:
    """--model: None, the embedded model; a path, that model; else a scale-model shape (model/synth.py), written
    once in bfloat16. -> (the model argument for serve and the workers, its files, the scale model's record)."""
    if arg is not None and not Path(arg).expanduser().exists():
        folder = synthesize(arg, weights="bfloat16")
        arg = str(folder)
    files = resolve_model(arg)
    record = Path(files.folder) / "synth.json"
    return arg, files, json.loads(record.read_text()) if record.exists() else None


def run(args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in str(args.workers).split(",")]
    model, files, synth = target(getattr(args, "model", None))
    cfg = ModelConfig.from_folder(files.folder)
    ends = TokenEnds.load(open_source(files.folder), cfg, torch.bfloat16)
    from transformers import AutoTokenizer

    prompt = chat_ids(AutoTokenizer.from_pretrained(files.folder), [{"role": "user", "content": PROMPT}])
    card = model_card(cfg, "served", torch.bfloat16)
    hcard = head_card(card)
    own = None if synth else load_profile(files.name)  # a scale model's text is noise: its alpha means nothing
    acceptance = Acceptance(own, cfg.n_layers)
    blocks = measure_blocks(files.folder, cfg, ends, prompt, args.tokens)
    link = link_spec(getattr(args, "link", None), getattr(args, "rate", None), getattr(args, "delay_ms", None))
    net = setting(args.out, link)
    serve_args = ["--log-level", "warning", "--policy", "naive", "--dtype", "bfloat16",
                  "--placement", getattr(args, "layer_placement", "even"), *(["--model", model] if model else [])]
    by_workers, perplexity = {}, Perplexity(args, files, own) if args.perplexity and own and not synth else None
    try:
        for n in counts:
            by_workers[str(n)] = one_count(args, net, n, model, cfg, card, hcard, ends, prompt, acceptance, blocks,
                                           own, link, serve_args)
            if perplexity:
                perplexity.add(by_workers[str(n)])
    finally:
        net.close()
    summary = {"settings": {
        "model": files.name, "scale_model": synth and {"shape": synth["shape"]["name"], "weights": synth["weights"],
                                                       "seed": synth["seed"], "folder": str(files.folder)},
        "workers": counts, "tokens": args.tokens, "dtype": "bfloat16 (every mode, the layer server too)",
        "layer_placement": getattr(args, "layer_placement", "even"), "prompt": PROMPT,
        "cores": len(os.sched_getaffinity(0)),
        "pinning": "worker i on CPU i mod cores, one torch thread each; more workers than cores share cores "
                   "(and the controller's threads share them too)",
        "network": {"setting": net.name, **(asdict(link) if link else {}), "notes": net.notes},
        "acceptance": acceptance.source,
        "perplexity": None if perplexity else ("skipped: a scale model's text is noise" if synth else
                                               "skipped (--no-perplexity or no profile)"),
        "block_ms": blocks, "gather": "at each layer's projection worker",
        "prediction": "bench/headsplit_sim.predict_setting: block_ms (one thread, as the workers run the blocks), "
                      "the measured round trip of a call (half of it a message), n identical devices and a "
                      "controller of its own, the placements measured and the acceptance above; "
                      "predicted_ms_with_kept_share: the acceptance the run really had; predicted_with_link_rtt: "
                      "the link's own round trip added where the kernel had no delay (the planned HeadSplit modes "
                      "placed again for it); excess_ms_per_call: (measured - predicted) / calls per token"},
        "by_workers": by_workers, "overtakes": overtakes(by_workers)}
    if len(counts) == 1:  # the layout of a single count, as before
        summary["modes"] = by_workers[str(counts[0])]["modes"]
    (args.out / "headsplit.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = f"{files.name}, {net.name}{f' ({link.name}: {link.rate})' if link else ''}, greedy"
    speedup_chart(args.out / "headsplit.png", title, by_workers)
    print_table(by_workers, summary["overtakes"])
    return summary


class Acceptance:
    """Per-layer alpha at an epsilon: the model's own profile, or else the shipped profile of the embedded model
    (the real model's profiled alpha) mapped onto this model's layers by relative depth."""

    def __init__(self, own: dict | None, n_layers: int):
        self.n_layers = n_layers
        if own:
            self.record, self.source = own, {"profile": own["model"], "mapped": False}
        else:
            self.record = load_profile(resolve_model(None).name)
            self.source = {"profile": self.record["model"], "mapped": f"onto {n_layers} layers by relative depth "
                           f"from {self.record['card']['n_layers']}"}

    def __call__(self, epsilon: float) -> list[float]:
        if not self.source["mapped"]:
            return profiled_alphas(self.record, self.n_layers, epsilon)
        n = self.record["card"]["n_layers"]
        return depth_alphas(profiled_alphas(self.record, n, epsilon), self.n_layers)


def one_count(args, net, n: int, model: str | None, cfg: ModelConfig, card, hcard, ends: TokenEnds,
              prompt: list[int], acceptance: Acceptance, blocks: dict, own: dict | None, link, serve_args) -> dict:
    """Every mode on n workers in the setting, and beside each its predicted ms per token."""
    results, modes = {}, {}
    if args.mode in ("layer", "all"):
        results["layer"] = layer_based(net, n, args.tokens, args.out / f"layer_server-{n}.log", serve_args)
    workers = net.head_workers(n, model)
    try:
        names = list(workers.urls)
        # the cost of a call on a link besides the compute: a bf16 hidden state out, a small answer back
        rtt = call_ms(workers.urls[names[0]], workers.token, cfg.hidden_size * 2)
        if own:  # as before: the profile's block times
            devices = profiled_devices(own, dict.fromkeys(names, 2**33))
        else:  # this machine's for the model's shape
            devices = [HeadDevice(d, blocks["group_ms"], blocks["proj_ms"], blocks["ffn_ms"], 2**33) for d in names]

        def planned(eps: float, hop: float) -> list[LayerPlace]:
            # one message: half the round trip, plus the 15% margin
            return place(devices, hcard, acceptance(eps), lambda a, b: 0.0 if a == b else 1.15 * hop, 512)

        def mode(label: str, layers: list[LayerPlace], epsilon: float, gathered: bool = True) -> None:
            modes[label] = (layers, epsilon, gathered)
            results[label] = head_mode(workers.urls, workers.token, cfg, layers, epsilon, ends, prompt, args.tokens,
                                       gathered, model)

        if args.mode in ("head", "all"):
            mode("head (controller gathers)", spread_placement(cfg, names, False), 0.0, gathered=False)
            mode("head", spread_placement(cfg, names, False), 0.0)
        if args.mode in ("headsplit", "all"):
            for eps in args.epsilon:
                mode(f"headsplit eps {eps}", planned(eps, rtt / 2), eps)
                mode(f"headsplit eps {eps}, every layer", spread_placement(cfg, names, True), eps)
    finally:
        workers.stop()
    cores = len(os.sched_getaffinity(0))
    row = {"round_trip_ms": round(rtt, 3), "cpus": worker_cpus(n), "shares_cores": n > cores,
           "placements": {label: [asdict(lp) for lp in layers] for label, (layers, _, _) in modes.items()}}
    predict(card, blocks, names, rtt / 2, results, modes, acceptance, "predicted")
    if link and net.notes:  # the kernel had no delay: what the link's own round trip would add
        hop = (rtt + link.rtt_ms) / 2
        again = {label: (planned(eps, hop) if label == f"headsplit eps {eps}" else layers, eps, g)
                 for label, (layers, eps, g) in modes.items()}
        predict(card, blocks, names, hop, results, again, acceptance, "predicted_with_link_rtt")
        row["link_rtt_added_ms"] = link.rtt_ms
    kept = {label: (layers, eps, g) for label, (layers, eps, g) in modes.items() if any(lp.speculate for lp in layers)}
    for label, (layers, _, gathered) in kept.items():  # with the acceptance the scale model really had
        shares = [s or 0.0 for s in results[label]["kept_share_by_layer"]]
        shares += [0.0] * (cfg.n_layers - len(shares))
        alt = predict_setting(card, blocks, names, rtt / 2, blocks["ends_ms"], {label: (layers, shares, gathered)})
        results[label]["predicted_ms_with_kept_share"] = alt[label]
    if "layer" in results:
        whole = cfg.n_layers * blocks["layer_ms"] + blocks["ends_ms"] + (n + 1) * rtt / 2
        results["layer"]["predicted_ms_from_whole_layer_time"] = round(whole, 3)
        for r in results.values():
            r["speedup_over_layer"] = round(results["layer"]["median_ms_per_token"] / r["median_ms_per_token"], 3)
    for label, r in results.items():
        if label != "layer" and r.get("calls_per_token"):  # what the prediction misses, per call on a link
            r["excess_ms_per_call"] = round((r["median_ms_per_token"] - r["predicted_ms_per_token"])
                                            / r["calls_per_token"], 3)
    return {**row, "modes": results}


def predict(card, blocks: dict, names: list[str], hop: float, results: dict, modes: dict, acceptance: Acceptance,
            key: str) -> None:
    """The simulator's ms per token and speedup over layer-based beside each measured mode (results[label][key
    + '_ms_per_token'] and [key + '_speedup_over_layer'])."""
    pred = predict_setting(card, blocks, names, hop, blocks["ends_ms"],
                           {label: (layers, acceptance(eps), g) for label, (layers, eps, g) in modes.items()})
    for label, ms in pred.items():
        if label in results:
            results[label][f"{key}_ms_per_token"] = ms
            results[label][f"{key}_speedup_over_layer"] = round(pred["layer"] / ms, 3)


class Perplexity:
    """The held-out perplexity of each HeadSplit mode's speculation against exact (float32, the profile's
    held-out answers), once per pattern of speculating layers."""

    def __init__(self, args, files, record: dict):
        src = open_source(files.folder)
        cfg = ModelConfig.from_folder(files.folder)
        self.stack = LayerStack.load(src, cfg, 0, cfg.n_layers, torch.float32)
        self.ends, self.rows = TokenEnds.load(src, cfg, torch.float32), heldout_rows(files, record, args.data)
        self.exact = held_out_perplexity(self.stack, self.ends, self.rows, 0.0)["perplexity"]
        self.seen: dict[tuple, float] = {}

    def add(self, row: dict) -> None:
        for label, r in row["modes"].items():
            eps = float(label.split()[2].rstrip(",")) if label.startswith("headsplit eps") else 0.0
            speculate = tuple(lp["speculate"] for lp in row["placements"].get(label, []))
            if any(speculate) and (speculate, eps) not in self.seen:
                self.seen[speculate, eps] = held_out_perplexity(self.stack, self.ends, self.rows, eps,
                                                                list(speculate))["perplexity"]
            if label in row["placements"]:
                ppl = self.seen[speculate, eps] if any(speculate) else self.exact  # nothing speculates: exact
                r |= {"heldout_perplexity": ppl, "perplexity_change": round(ppl / self.exact - 1, 6)}
