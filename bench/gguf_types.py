"""Every file type llama.cpp's quantizer writes, read by edgespec and by llama.cpp on the same file:
`python -m edgespec.bench.gguf_types --prompts ../shared/data/prompts/vicuna80.jsonl --out DIR`.

Two models, each written to a float32 GGUF as llama.cpp's converter writes it (bench/gguf_writer.py), then
quantized by llama.cpp's own quantizer (`llama_model_quantize` of llama-cpp-python, `make peer-env`) to each type:
`smollm2`, the served model's own weights (its Q4_1 file's values, exactly: a trained model, whose rows of 576
take llama.cpp's fallbacks for the K-quants), and `tiny-256`, a random model from transformers' class (hidden 256,
so every K-quant applies; `tiny-256-qwen3` and the like: another architecture's; matrices N(0, 0.02^2) as trained
models' are: at 0.2 the activations were so wide that llama.cpp and edgespec each stood 13% of the largest logit
from the file's exact float forward, and their top-1 agreed on 0.925 of the positions of a Q8_0 file), then trained
briefly (bench/tiny_train.py, `--train-steps`, 0: as drawn) on alpaca_seed_tasks.jsonl: a random model's next-token
distribution is nearly flat, so every rounding flips its top-1 and the agreement measured the flatness. For each
file: teacher-forced logits over held-out text (vicuna80's prompts in SmolLM2's chat template) from edgespec (its
served format, `auto`: the file's own blocks) and from llama.cpp (`Llama(logits_all=True)`), top-1 agreement and
the largest logit difference relative to the largest logit; and one chat completion through `edgespec serve` on
the file (none may fail); and each side's distance from the file's exact float forward. Writes
DIR/gguf_types.json and DIR/gguf_types.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import torch

from edgespec.bench.gguf_writer import tiny_model, write_gguf
from edgespec.bench.llamacpp import ServerProcess, free_port, llama_python, llamacpp_version
from edgespec.bench.tiny_train import TrainSettings, train_tiny

# llama.cpp's file types (its LLAMA_FTYPE_MOSTLY_* names), F16 down to Q2_K and the 4-bit non-linear ones
TYPES = ["F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0",
         "IQ4_NL", "IQ4_XS", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K"]
TINY = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 512, "max_position_embeddings": 1024, "tie_word_embeddings": False}

# Runs in llama-cpp-python's environment: quantize (argv: "quantize", src, dst, type) or score (argv: "score",
# file, ids.npy, out.npy: the argmax and the logits of every position).
LLAMA_SIDE = r"""
import ctypes, sys
import numpy as np
import llama_cpp
if sys.argv[1] == "quantize":
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[4])
    rc = llama_cpp.llama_model_quantize(sys.argv[2].encode(), sys.argv[3].encode(), ctypes.byref(params))
    sys.exit(rc)
ids = np.load(sys.argv[3]).tolist()
llm = llama_cpp.Llama(model_path=sys.argv[2], logits_all=True, n_ctx=len(ids) + 8, n_batch=len(ids),
                      n_threads=2, verbose=False)
llm.eval(ids)
np.save(sys.argv[4], np.asarray(llm.scores[:len(ids)], dtype=np.float32))
"""


def served_model_folder(out: Path) -> Path:
    """The served model (SmolLM2-135M-Instruct's Q4_1 file) as a Hugging Face folder in float32: its config and
    tokenizer, and every tensor's exact values."""
    import shutil

    from safetensors.torch import save_file

    from edgespec.model.config import ModelConfig
    from edgespec.model.gguf_source import GGUFSource, read_index
    from edgespec.model.source import resolve_model

    files = resolve_model(None)
    cfg = ModelConfig.from_folder(files.folder)
    src = GGUFSource(files.gguf, cfg)
    names = [n for t in read_index(files.gguf).tensors if (n := cfg.arch.hf_name(t))]
    shutil.copytree(files.folder, out)
    save_file({n: src.get(n, torch.float32).contiguous() for n in names}, out / "model.safetensors")
    return out


def held_out(tokenizer, data: Path, n: int) -> list[int]:
    """The first n vicuna80 prompts in the chat template, one after another: the teacher-forced text."""
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:n]
    ids: list[int] = []
    for row in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}], tokenize=False,
                                             add_generation_prompt=True)
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids


def edgespec_logits(gguf: Path, ids: list[int], fmt: str = "auto") -> torch.Tensor:
    """Teacher-forced logits [T, V] on `gguf` in one pass: in the served format (`auto`: the file's own blocks,
    int8 activations), or `float32` (the file's values exactly dequantized, float activations: the forward the
    file defines, which both llama.cpp and edgespec round)."""
    from edgespec.model.config import ModelConfig
    from edgespec.model.linear import weight_format
    from edgespec.model.source import resolve_model
    from edgespec.model.stack import LayerStack, TokenEnds
    from edgespec.model.weights import open_source

    files = resolve_model(str(gguf))
    cfg, src = ModelConfig.from_folder(files.folder), open_source(files)
    fmt = weight_format(fmt)
    stack, ends = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt), TokenEnds.load(src, cfg, fmt)
    x = ends.embed_tokens(torch.tensor([ids]))
    return ends.logits(stack(x, torch.arange(len(ids))[None], stack.new_cache(len(ids)), 0))[0]


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions whose top-1 token is the same in logits a and b [T, V]."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest logit difference relative to b's largest logit."""
    return float((a - b).abs().max() / b.abs().max())


def serve_once(gguf: Path, log: Path) -> dict:
    """One greedy chat completion from `edgespec serve` on the file: its status and text."""
    port = free_port()
    argv = [sys.executable, "-m", "edgespec.server.cli", "serve", "--model", str(gguf), "--port", str(port),
            "--log-level", "warning"]
    with ServerProcess("edgespec", argv, port, log, "/health") as server:
        server.wait_ready(300)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"], "max_tokens": 8,
            "temperature": 0, "messages": [{"role": "user", "content": "Name three rivers."}]})
        body = r.json()
        return {"status": r.status_code, "text": body["choices"][0]["message"]["content"] if r.is_success else body}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True, help="a prompt set with `turns` (vicuna80.jsonl)")
    # 40 prompts are ~2000 teacher-forced positions: an agreement near 0.98 then has a standard error of ~0.003
    # (at 6 prompts, 248 positions, it was ~0.009: one position moved a figure by 0.004)
    p.add_argument("--n-prompts", type=int, default=40)
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--models", default="smollm2,tiny-256",
                   help="smollm2 and random models of hidden 256: tiny-256 (llama) or tiny-256-KIND, KIND an "
                        "architecture of bench/gguf_writer.py (qwen2, qwen3, gemma3, phi3)")
    p.add_argument("--train-steps", type=int, default=TrainSettings.steps,
                   help="AdamW steps of bench/tiny_train.py on --train-data for each random model before it is "
                        "written (0: the random model as drawn)")
    p.add_argument("--train-data", type=Path, default=None,
                   help="the training text (alpaca_seed_tasks.jsonl; by default beside --prompts)")
    p.add_argument("--llama-python", default=None)
    args = p.parse_args(argv)
    python = llama_python(args.llama_python)
    train_data = args.train_data or args.prompts.with_name("alpaca_seed_tasks.jsonl")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, training = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model in args.models.split(","):
            if model == "smollm2":
                folder = served_model_folder(tmp / model)
                f32 = write_gguf(folder, tmp / f"{model}.F32.gguf")
            else:
                folder = tiny_model(tiny_kind(model), tmp / model, shape=TINY, std=0.02)
                if args.train_steps:
                    training[model] = train_tiny(folder, train_data, held_out_ids(folder, args),
                                                 TrainSettings(steps=args.train_steps))
                    print(json.dumps({"model": model, "training": training[model]}), flush=True)
                # a name without the architecture's: llama.cpp reads Phi-3's tokens for a 'phi3' (write_gguf)
                f32 = write_gguf(folder, tmp / f"{model}.F32.gguf", name="tiny-256")
            rows += compare_types(python, folder, f32, args, tmp)
    result = {"llama_cpp_python": llamacpp_version(python), "tiny_shape": TINY, "prompts": str(args.prompts),
              "n_prompts": args.n_prompts, "train_steps": args.train_steps, "training": training, "types": rows}
    (args.out / "gguf_types.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / "gguf_types.png")


def tiny_kind(model: str) -> str:
    """The architecture of a random model named 'tiny-256' (llama) or 'tiny-256-KIND' (qwen2, qwen3, gemma3, phi3)."""
    return model.removeprefix("tiny-256").removeprefix("-") or "llama"


def held_out_ids(folder: Path, args) -> list[int]:
    """The teacher-forced text's token ids (held_out) in the tokenizer of the model in `folder`."""
    from transformers import AutoTokenizer

    return held_out(AutoTokenizer.from_pretrained(folder), args.prompts, args.n_prompts)


def compare_types(python: str, folder: Path, f32: Path, args, tmp: Path) -> list[dict]:
    """One row per file type of the model in `folder` (its float32 GGUF `f32`)."""
    model = folder.name
    ids = held_out_ids(folder, args)
    np.save(tmp / "ids.npy", np.asarray(ids, dtype=np.int64))
    rows = []
    for kind in args.types.split(","):
        gguf = tmp / f"{model}.{kind}.gguf"
        q = subprocess.run([python, "-c", LLAMA_SIDE, "quantize", str(f32), str(gguf), kind], capture_output=True,
                           text=True, timeout=600)
        if q.returncode != 0:
            rows.append({"model": model, "type": kind, "quantized": False, "error": q.stderr[-2000:]})
            continue
        s = subprocess.run([python, "-c", LLAMA_SIDE, "score", str(gguf), str(tmp / "ids.npy"),
                            str(tmp / "llama.npy")], capture_output=True, text=True, timeout=600)
        row = {"model": model, "type": kind, "quantized": True, "bytes": gguf.stat().st_size, "positions": len(ids)}
        try:
            ours = edgespec_logits(gguf, ids)
            if s.returncode != 0:
                raise RuntimeError(f"llama.cpp failed to score: {s.stderr[-2000:]}")
            theirs = torch.from_numpy(np.load(tmp / "llama.npy"))
            exact = edgespec_logits(gguf, ids, "float32")
            row["top1_agreement"] = agreement(ours, theirs)
            row["max_rel_logit_diff"] = rel_diff(ours, theirs)
            # how far each stands from the file's exact forward: whose rounding a disagreement is
            row["edgespec_vs_exact"] = {"top1": agreement(ours, exact), "max_rel": rel_diff(ours, exact)}
            row["llama_cpp_vs_exact"] = {"top1": agreement(theirs, exact), "max_rel": rel_diff(theirs, exact)}
        except Exception as exc:  # a type that fails is a finding to report, not a crash of the benchmark
            row["error"] = f"{type(exc).__name__}: {exc}"
        row["serve"] = serve_once(gguf, args.out / f"serve-{model}-{kind}.log")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        gguf.unlink()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [r for r in rows if "top1_agreement" in r]
    models = sorted({r["model"] for r in scored})
    types = list(dict.fromkeys(r["type"] for r in scored))
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(1, len(models))
    for i, model in enumerate(models):
        got = {r["type"]: r["top1_agreement"] for r in scored if r["model"] == model}
        ax.bar([t + i * width for t in range(len(types))], [got.get(t, 0) for t in types], width, label=model)
    ax.axhline(0.98, color="tab:red", linestyle="--", label="bar 0.98")
    ax.set_xticks([t + width * (len(models) - 1) / 2 for t in range(len(types))], types, rotation=45, ha="right")
    ax.set_ylim(min([0.9] + [r["top1_agreement"] for r in scored]) - 0.01, 1.001)
    ax.set_ylabel("teacher-forced top-1 agreement")
    ax.set_title("edgespec vs llama.cpp on the same GGUF, per file type")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
