"""`edgespec eval-formats`: what each weight format loses, against the float32 dequantized reference.

Held-out text: human-written answers of the self-instruct seed tasks (`alpaca_seed_tasks.jsonl`, the last
--tasks of them), each after its instruction in the chat template. For every format the answers are scored
teacher-forced, one pass per task: perplexity of the answer tokens, top-1 agreement with float32 (the
reference: the GGUF's own values, exactly dequantized), mean KL(float32 || format) per token, and the bytes
the weights take. Writes DIR/formats.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import linear_bytes, weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def held_out(tokenizer, data: Path, tasks: int) -> list[tuple[list[int], int]]:
    """(ids of prompt + answer, index where the answer starts) for the last `tasks` seed tasks."""
    from edgespec.decoding.outline import chat_ids

    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][-tasks:]
    out = []
    for row in rows:
        inst = row["instances"][0]
        user = row["instruction"] + (f"\n\n{inst['input']}" if inst["input"] else "")
        prompt = chat_ids(tokenizer, [{"role": "user", "content": user}])
        answer = tokenizer(inst["output"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append((prompt + answer, len(prompt)))
    return out


@torch.inference_mode()
def answer_logprobs(files, fmt: str, texts, kv: str = "float32") -> tuple[list[torch.Tensor], int]:
    # per text: log-probabilities [answer tokens, V] of the tokens after each answer position's predecessor, the
    # KV cache in format `kv` (each position attends over the stored keys and values, its own included)
    cfg = ModelConfig.from_folder(files.folder)
    src = open_source(files)
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, weight_format(fmt), kv_format(kv))
    ends = TokenEnds.load(src, cfg, weight_format(fmt))
    out = []
    for ids, start in texts:
        cache = stack.new_cache(len(ids))
        hidden = stack(ends.embed_tokens(torch.tensor([ids])), torch.arange(len(ids))[None], cache, 0)
        out.append(torch.log_softmax(ends.logits(hidden[:, start - 1:-1])[0].double(), dim=-1))
    return out, linear_bytes(stack) + linear_bytes(ends)


def run(args: argparse.Namespace) -> dict:
    files = resolve_model(args.model)
    from transformers import AutoTokenizer

    texts = held_out(AutoTokenizer.from_pretrained(files.folder), Path(args.data), args.tasks)
    targets = [torch.tensor(ids[start:]) for ids, start in texts]
    n_tokens = sum(len(t) for t in targets)
    ref, _ = answer_logprobs(files, "float32", texts)
    results = {}
    for fmt in args.formats.split(","):
        t0 = time.perf_counter()
        lps, nbytes = answer_logprobs(files, fmt, texts)
        nll = -sum(float(lp.gather(1, t[:, None]).sum()) for lp, t in zip(lps, targets, strict=True))
        agree = sum(int((lp.argmax(-1) == r.argmax(-1)).sum()) for lp, r in zip(lps, ref, strict=True))
        kl = sum(float((r.exp() * (r - lp)).sum()) for lp, r in zip(lps, ref, strict=True))
        results[fmt] = {"perplexity": round(math.exp(nll / n_tokens), 4), "top1_agreement_with_float32":
                        round(agree / n_tokens, 4), "mean_kl_from_float32": round(kl / n_tokens, 6),
                        "weight_mib": round(nbytes / 2**20, 1), "seconds": round(time.perf_counter() - t0, 1)}
    exact = results.get("float32", {}).get("perplexity")
    for r in results.values():
        if exact:
            r["perplexity_change"] = round(r["perplexity"] / exact - 1, 5)
    record = {"model": files.name, "source": str(files.gguf or files.folder), "data": Path(args.data).name,
              "tasks": len(texts), "answer_tokens": n_tokens, "formats": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "formats.json").write_text(json.dumps(record, indent=2) + "\n")
    table = Table(title=f"{files.name}: {len(texts)} held-out answers, {n_tokens} tokens")
    for col in ("format", "perplexity", "change", "top-1 = float32", "KL", "weights MiB"):
        table.add_column(col)
    for fmt, r in results.items():
        table.add_row(fmt, str(r["perplexity"]), f"{r.get('perplexity_change', 0):+.3%}",
                      str(r["top1_agreement_with_float32"]), str(r["mean_kl_from_float32"]), str(r["weight_mib"]))
    Console().print(table)
    print(f"wrote {out / 'formats.json'}")
    return record

