"""Scale models (`edgespec synth-model`): Hugging Face folders with the shapes of real models and seeded random
weights, for measuring speed, memory and placement on models bigger than the embedded 135M one.

Their text is noise: the weights are random. What a pass costs depends on shapes and formats, not on values,
so such a model measures the split honestly where no real weights of that size are available offline.

A folder holds config.json (the shape's fields and its card's Hugging Face fields, config/models/<shape>.json
"hf": the architecture is its model_type, Llama where a card names none), the embedded model's tokenizer cut to
the shape's vocabulary (its BPE vocabulary and merges kept below the shape's size; a larger shape's ids past the
tokenizer are never produced by it), and the weights, the tensors the architecture has (model/arch.py: its
layer's tensors, fused ones such as Phi-3's qkv_proj and gate_up_proj whole, as its checkpoints hold them; its
norms; a sparse layer's router and experts in place of the FFN, the experts one tensor a projection in a GGUF and
each expert's own in safetensors, as llama.cpp's converter and the checkpoints hold them):
- float32 / bfloat16 / float16: safetensors in that dtype (shards of at most 2 GiB, with an index);
- q4_1 / q8_0: a GGUF file of those blocks written as llama.cpp's converter writes that architecture
  (model/synth_gguf.py), pointed at as a converted GGUF folder points at its file, so it is served as a GGUF is
  (`--weights auto` runs its own blocks).

Values: every tensor from its own generator, seeded by (seed, tensor name), so a tensor is the same whatever
else is written; matrices N(0, 0.02^2) (about 1/sqrt(hidden) at 2048, as trained Llama matrices are), the output
projections of attention and FFN divided by sqrt(2 layers) so that the residual stream grows as in a trained
model (GPT-2's scaling), norms multiplying by 1 (stored as 0 where the architecture multiplies by 1 + w, Gemma 3's
folders; its GGUF holds 1, shifted as the converter shifts it). Hidden states stay finite through every layer
(tests/test_synth.py, tests/test_synth_archs.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from edgespec.model.arch import EXPERTS_LAYER, LLAMA_LAYER
from edgespec.model.config import ModelConfig
from edgespec.model.gguf_source import STACKED_EXPERTS
from edgespec.model.source import GGUF_POINTER, cache_root, resolve_model
from edgespec.model.synth_gguf import write_gguf

SHAPES_DIR = Path(__file__).resolve().parents[1] / "config" / "models"
FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GGUF_FORMATS = ("q4_1", "q8_0")
FORMATS = (*GGUF_FORMATS, *FLOAT_FORMATS)
# of the generator: a folder written by another version is written again. 2: GGUFs with the converter's keys
# (key and rope lengths, file type, name) and Llama 3's rope_freqs; every architecture's own tensors. 3: the
# tokenizer in the GGUF too (llama.cpp loads it)
VERSION = 3
STD = 0.02
SHARD_BYTES = 2 * 2**30
# a layer's FFN tensors by kind: a dense layer has the first, a sparse one (a mixture) the second
DENSE_FFN = {LLAMA_LAYER[k] for k in ("ffn_gate", "ffn_up", "ffn_down")}
SPARSE_FFN = set(EXPERTS_LAYER.values())
GGUF_FILE = "weights.gguf"


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: Hugging Face name, shape, and the std of its values (None: a norm, `fill` everywhere:
    the stored value of a norm that multiplies by 1)."""

    name: str
    shape: tuple[int, ...]
    std: float | None
    fill: float = 1.0

    def values(self, seed: int) -> torch.Tensor:
        """The tensor's float32 values: the same for the same seed and name, whatever else is written."""
        if self.std is None:
            return torch.full(self.shape, self.fill)
        key = int.from_bytes(hashlib.sha256(f"{seed}:{self.name}".encode()).digest()[:8], "little") >> 1
        return torch.randn(self.shape, generator=torch.Generator().manual_seed(key)).mul_(self.std)


def shape_names() -> list[str]:
    """The shapes synth-model can write: config/models cards with Hugging Face fields."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json") if "hf" in json.loads(p.read_text()))


def load_shape(shape: str) -> dict:
    """A shape's card by file stem or card name (case-insensitive), or a card JSON's path."""
    path = Path(shape)
    if path.suffix == ".json" and path.exists():
        card = json.loads(path.read_text())
    else:
        cards = {p.stem: json.loads(p.read_text()) for p in SHAPES_DIR.glob("*.json")}
        found = [c for stem, c in cards.items() if shape.lower() in (stem, c["name"].lower())]
        if not found:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(shape_names())}")
        card = found[0]
    if "hf" not in card:
        raise ValueError(f"shape {shape!r} has no Hugging Face fields ('hf') to build a model from")
    return card


# what the first cards (all Llama) leave out of their Hugging Face fields
LLAMA_FIELDS = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False}


def hf_config(card: dict, bos: int, eos: int | list[int]) -> dict:
    """config.json of a shape: its shape fields, then its card's Hugging Face fields (a card without a model_type
    is a Llama); token ids are the embedded tokenizer's (`eos`: its end id, or its end ids, its eos first)."""
    hf = dict(card["hf"]) if "model_type" in card["hf"] else {**LLAMA_FIELDS, **card["hf"]}
    pad = eos[0] if isinstance(eos, list) else eos  # one id, where a GGUF's config lists every end id
    return {
        "architectures": hf.pop("architectures"), "model_type": hf.pop("model_type"),
        "hidden_size": card["hidden_size"], "num_hidden_layers": card["n_layers"],
        "num_attention_heads": card["n_heads"], "num_key_value_heads": card["n_kv_heads"],
        "head_dim": card["head_dim"], **hf, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "_name_or_path": f"synthetic {card['name']} (random weights: its text is noise)",
    }


def layer_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], float | None]]:
    """Shape [out, in] and std of each layer projection and per-head norm (std None), by its Hugging Face name (the
    same in every architecture here; model/arch.py's Architecture.layer says which of them a layer has, and
    Architecture.stacked which are held fused in one tensor)."""
    h, n_layers, hd = config["hidden_size"], config["num_hidden_layers"], config["head_dim"]
    q, kv, inter = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, config["intermediate_size"]
    out_std = STD / math.sqrt(2 * n_layers)
    shapes = {"self_attn.q_proj": ((q, h), STD), "self_attn.k_proj": ((kv, h), STD),
              "self_attn.v_proj": ((kv, h), STD), "self_attn.o_proj": ((h, q), out_std),
              "mlp.gate_proj": ((inter, h), STD), "mlp.up_proj": ((inter, h), STD),
              "mlp.down_proj": ((h, inter), out_std), "self_attn.q_norm": ((hd,), None),
              "self_attn.k_norm": ((hd,), None)}
    if experts := config.get("num_experts") or config.get("num_local_experts"):
        # a mixture: the router [E, H], and every expert's projections stacked [E, N, K] as a GGUF holds them
        # (write_safetensors writes them apart, as the checkpoints do)
        size = config["moe_intermediate_size"]
        shapes.update({"mlp.gate": ((experts, h), STD), "mlp.experts.gate_proj": ((experts, size, h), STD),
                       "mlp.experts.up_proj": ((experts, size, h), STD),
                       "mlp.experts.down_proj": ((experts, h, size), out_std)})
    return shapes


def stacked_shape(shapes: dict[str, tuple[tuple[int, ...], float | None]], parts: tuple[str, ...],
                  what: str) -> tuple[tuple[int, ...], float | None]:
    """Shape and std of a layer tensor holding the rows of `parts` (layer_tensors' names) one after another (one
    part: that part's): their rows together, the same columns and std (a fused tensor is drawn as one)."""
    missing = [p for p in parts if p not in shapes]
    if missing:
        raise ValueError(f"synth-model has no shape for {what}'s {', '.join(missing)}")
    found = [shapes[p] for p in parts]
    columns, stds = {shape[1:] for shape, _ in found}, {std for _, std in found}
    if len(columns) != 1 or len(stds) != 1:  # rows stack only over the same columns; one tensor, one std
        raise ValueError(f"synth-model cannot stack {what}: its parts {parts} differ in columns or std")
    return (sum(shape[0] for shape, _ in found), *columns.pop()), stds.pop()


def tensors(config: dict) -> list[Tensor]:
    """Every tensor of a model with this config, in file order, as its Hugging Face checkpoint holds them: its
    architecture's layer tensors (model/arch.py: its norms over the hidden state by place, the rest from
    layer_tensors, a fused one (Architecture.stacked) with its parts' rows in the order it lists them), norms
    stored so that they multiply by 1 (1 - the architecture's norm_offset)."""
    cfg = ModelConfig.from_hf_dict(config)
    arch, h, vocab = cfg.arch, cfg.hidden_size, cfg.vocab_size
    if cfg.attention_bias or cfg.o_bias or cfg.mlp_bias:  # Qwen2's, for one: refused rather than left out
        raise ValueError(f"synth-model writes no biases ({arch.name} with this config has them)")
    shapes = layer_tensors(config)
    hidden_norms = set(arch.norms.values())
    norm = 1.0 - arch.norm_offset
    out = [Tensor("model.embed_tokens.weight", (vocab, h), STD)]
    shape: tuple[int, ...]
    std: float | None
    for i in range(cfg.n_layers):
        for gguf_name, hf_name in arch.layer.items():
            if hf_name in (DENSE_FFN if cfg.sparse(i) else SPARSE_FFN):  # a layer has one kind of FFN
                continue
            if hf_name in hidden_norms:
                shape, std = (h,), None
            else:
                parts = arch.stacked.get(hf_name, (hf_name,))
                shape, std = stacked_shape(shapes, parts, f"{arch.name}'s {gguf_name} ({hf_name})")
            out.append(Tensor(f"model.layers.{i}.{hf_name}.weight", shape, std, norm if std is None else 1.0))
    out.append(Tensor("model.norm.weight", (h,), None, norm))
    if not cfg.tie_word_embeddings:
        out.append(Tensor("lm_head.weight", (vocab, h), STD))
    return out


def default_out(shape: str, weights: str, seed: int) -> Path:
    """Where a scale model is cached when no --out is given."""
    stem = Path(shape).stem if shape.endswith(".json") else load_shape(shape)["name"].lower()
    return cache_root() / "synth" / f"{stem}-{weights}-s{seed}"


def synthesize(shape: str, out: Path | None = None, weights: str = "q4_1", seed: int = 0,
               progress: bool = True) -> Path:
    """Write the scale model `shape` in `weights` into `out` once (a folder already written with these
    parameters is kept); returns the folder."""
    if weights not in FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; valid: {', '.join(FORMATS)}")
    card = load_shape(shape)
    out = Path(out) if out is not None else default_out(shape, weights, seed)
    record = {"version": VERSION, "shape": card, "weights": weights, "seed": seed}
    done = out / "synth.json"
    if done.exists() and json.loads(done.read_text()) == record:
        return out
    if out.exists() and not done.exists() and any(out.iterdir()):  # never replace a folder of something else
        raise ValueError(f"{out} exists and is not a scale model's folder (no synth.json): choose another --out")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = write_config(card, tmp)
    plan = tensors(config)
    with _progress(progress, f"{card['name']} ({weights}, seed {seed})",
                   sum(math.prod(t.shape) for t in plan)) as advance:
        if weights in FLOAT_FORMATS:
            write_safetensors(plan, tmp, FLOAT_FORMATS[weights], seed, advance)
        else:
            write_gguf(plan, tmp / GGUF_FILE, config, card["name"], weights, seed, advance)
            (tmp / GGUF_POINTER).write_text(GGUF_FILE + "\n")  # relative: the folder can move
    (tmp / "synth.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def write_config(card: dict, out: Path) -> dict:
    """config.json of the card and the embedded tokenizer cut to its vocabulary, into the folder `out`; returns
    the config."""
    tokenizer = resolve_model(None).folder
    tok_config = json.loads((tokenizer / "config.json").read_text())
    config = hf_config(card, tok_config["bos_token_id"], tok_config["eos_token_id"])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(tokenizer, out, config["vocab_size"])
    return config


class _progress:
    """A rich progress bar over parameters written (or nothing); the context value advances it."""

    def __init__(self, show: bool, what: str, total: int):
        self.show, self.what, self.total = show, what, total

    def __enter__(self) -> Callable[[int], None]:
        if not self.show:
            return lambda n: None
        from rich.console import Console
        from rich.progress import Progress

        self.bar = Progress(console=Console(stderr=True), transient=False)  # stdout: the folder, for scripts
        self.bar.start()
        task = self.bar.add_task(f"writing {self.what}", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self.show:
            self.bar.stop()


def write_tokenizer(src: Path, out: Path, vocab: int) -> None:
    """The embedded tokenizer's files, its BPE vocabulary cut to ids below `vocab` (a merge is kept when both
    parts and the result are kept: the rest of the tokenizer never produces a dropped id)."""
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    model = tok["model"]
    if len(model["vocab"]) > vocab:
        kept = {t: i for t, i in model["vocab"].items() if i < vocab}
        merges = []
        for m in model["merges"]:
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            if a in kept and b in kept and a + b in kept:
                merges.append(m)
        model["vocab"], model["merges"] = kept, merges
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < vocab]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


def write_safetensors(plan: list[Tensor], out: Path, dtype: torch.dtype, seed: int,
                      advance: Callable[[int], None]) -> None:
    """The tensors as safetensors in `dtype`: one file, or shards of at most SHARD_BYTES with an index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for t in plan:
        value = t.values(seed).to(dtype)
        for name, part in checkpoint_tensors(t.name, value):
            nbytes = part.numel() * part.element_size()
            if current and size + nbytes > SHARD_BYTES:
                shards.append(current)
                current, size = {}, 0
            current[name], size = part, size + nbytes
        advance(value.numel())
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, out / name, metadata={"format": "pt"})
    weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def checkpoint_tensors(name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A planned tensor as a Hugging Face checkpoint holds it: stacked experts [E, N, K] as each expert's own
    `mlp.experts.{e}.*` [N, K] (copies: safetensors stores no shared memory), anything else as it is."""
    if m := STACKED_EXPERTS.fullmatch(name):
        return [(f"{m[1]}.{e}.{m[2]}", v.clone()) for e, v in enumerate(value)]
    return [(name, value)]


def weight_files(folder: Path) -> Iterator[Path]:
    """The files holding a scale model's weights (for comparing two writes byte for byte)."""
    yield from sorted(p for p in Path(folder).iterdir() if p.suffix in (".safetensors", ".gguf"))
