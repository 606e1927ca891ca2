"""KV cache formats on the default model: what each costs in quality, bytes and speed.

    python -m edgespec.bench.kv_formats --out DIR [--tasks 40] [--contexts 512,2048] [--reps 5]

For each format (model/kv_format.py), with the default model in its default weights (`auto`):
- held-out perplexity: bench/formats.py's text (the last --tasks self-instruct seed answers, teacher-forced, one
  pass per task: every position attends over the stored keys and values), its change from float32's, and top-1
  agreement with float32's logits;
- bytes a token takes in the cache (every layer's K and V), here and for the scale shapes of config/models;
- speed in-process (every layer in one LayerStack, the compiled kernels): a prompt of --prefill tokens in one
  pass, and decoding (one token a pass) after --contexts cached tokens, medians of --reps, the formats taken in
  turn within each repetition so that a noisy neighbour spreads over all of them.
Writes DIR/kv_formats.json and DIR/kv_formats.png. Measure alone: nothing else running.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from edgespec.bench.formats import answer_logprobs, held_out
from edgespec.bench.plot import bar_chart
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import KV_FORMATS, kv_format
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.synth import SHAPES_DIR, hf_config
from edgespec.model.weights import open_source

DATA = Path(__file__).resolve().parents[2] / "shared/data/prompts/alpaca_seed_tasks.jsonl"


def quality(files, tasks: int) -> dict[str, dict]:
    """Per format: perplexity of the held-out answers, its change from float32's, top-1 agreement with float32."""
    from transformers import AutoTokenizer

    texts = held_out(AutoTokenizer.from_pretrained(files.folder), DATA, tasks)
    targets = [torch.tensor(ids[start:]) for ids, start in texts]
    n = sum(len(t) for t in targets)
    lps = {kv: answer_logprobs(files, "auto", texts, kv)[0] for kv in KV_FORMATS}
    out = {}
    for kv, lp in lps.items():
        nll = -sum(float(x.gather(1, t[:, None]).sum()) for x, t in zip(lp, targets, strict=True))
        agree = sum(int((x.argmax(-1) == r.argmax(-1)).sum()) for x, r in zip(lp, lps["float32"], strict=True))
        out[kv] = {"perplexity": math.exp(nll / n), "top1_agreement_with_float32": round(agree / n, 4)}
    for r in out.values():
        r["perplexity_change"] = round(r["perplexity"] / out["float32"]["perplexity"] - 1, 6)
        r["perplexity"] = round(r["perplexity"], 4)
    return {"tasks": len(texts), "answer_tokens": n, "formats": out}


def bytes_per_token(cfg: ModelConfig) -> dict[str, int]:
    return {kv: cfg.kv_bytes_per_token(fmt=fmt) for kv, fmt in KV_FORMATS.items()}


def shape_bytes() -> dict[str, dict[str, int]]:
    """Bytes per token of each scale shape's cache in each format (arithmetic on the real shapes)."""
    out = {}
    for path in sorted(SHAPES_DIR.glob("*.json")):
        card = json.loads(path.read_text())
        if "hf" in card:
            out[path.stem] = bytes_per_token(ModelConfig.from_hf_dict(hf_config(card, 1, 2)))
    return out


@torch.inference_mode()
def speed(files, prefill: int, contexts: list[int], decode: int, reps: int) -> dict[str, dict]:
    cfg = ModelConfig.from_folder(files.folder)
    src = open_source(files)
    ends = TokenEnds.load(src, cfg, weight_format("auto"))
    stacks = {kv: LayerStack.load(src, cfg, 0, cfg.n_layers, weight_format("auto"), kv_format(kv))
              for kv in KV_FORMATS}
    gen = torch.Generator().manual_seed(0)
    longest = max(prefill, *contexts) + decode
    ids = torch.randint(300, 20000, (1, longest), generator=gen)
    x = ends.embed_tokens(ids)  # [1, longest, H]
    pos = torch.arange(longest)[None]
    times: dict[str, dict[str, list[float]]] = {kv: {} for kv in KV_FORMATS}
    for rep in range(reps + 1):  # the first round warms up and is not kept
        for kv, stack in stacks.items():
            cache = stack.new_cache(longest)
            t0 = time.perf_counter()
            stack(x[:, :prefill], pos[:, :prefill], cache, 0)
            if rep:
                times[kv].setdefault(f"prefill_{prefill}_ms", []).append((time.perf_counter() - t0) * 1e3)
            for c in contexts:
                cache = stack.new_cache(c + decode)
                for a in range(0, c, 512):  # the context, in chunks
                    stack(x[:, a:min(a + 512, c)], pos[:, a:min(a + 512, c)], cache, a)
                t0 = time.perf_counter()
                for p in range(c, c + decode):
                    stack(x[:, p:p + 1], pos[:, p:p + 1], cache, p)
                if rep:
                    times[kv].setdefault(f"decode_ms_per_token_at_{c}", []).append(
                        (time.perf_counter() - t0) * 1e3 / decode)
    return {kv: {k: round(statistics.median(v), 3) for k, v in t.items()} for kv, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded after each context")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    files = resolve_model(args.model)
    cfg = ModelConfig.from_folder(files.folder)
    contexts = [int(c) for c in args.contexts.split(",")]
    record = {"model": files.name, "weights": "auto", "threads": torch.get_num_threads(),
              "quality": quality(files, args.tasks), "bytes_per_token": bytes_per_token(cfg),
              "scale_shapes_bytes_per_token": shape_bytes(),
              "speed": speed(files, args.prefill, contexts, args.decode, args.reps)}
    full = record["bytes_per_token"]["float32"]
    record["bytes_ratio_to_float32"] = {kv: round(b / full, 4) for kv, b in record["bytes_per_token"].items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_formats.json").write_text(json.dumps(record, indent=2) + "\n")
    names = list(KV_FORMATS)
    q, sp = record["quality"]["formats"], record["speed"]
    panels = [("bytes per token / float32's", names, [record["bytes_ratio_to_float32"][k] for k in names]),
              ("held-out perplexity change (%)", names, [100 * q[k]["perplexity_change"] for k in names]),
              (f"prefill of {args.prefill} tokens (ms)", names, [sp[k][f"prefill_{args.prefill}_ms"] for k in names])]
    panels += [(f"decode ms/token at context {c}", names, [sp[k][f"decode_ms_per_token_at_{c}"] for k in names])
               for c in contexts]
    bar_chart(out / "kv_formats.png", f"{files.name} (weights auto): KV cache formats", panels)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
