"""Writes a Hugging Face folder (a tiny random model from transformers' own class, with SmolLM2's tokenizer) as a
GGUF file the way llama.cpp's converter does (`convert_hf_to_gguf.py --outtype f32`; checked against it, see the
README's "Architectures"): its `TextModel.set_gguf_parameters` keys, its `_set_vocab_gpt2` tokenizer, its tensor
names (gguf's own TensorNameMap, which the converter maps through), and q and k rows reordered as its
`LlamaModel.permute` does for the architectures it writes through LlamaModel. Nothing here is taken from
edgespec's own description of an architecture (model/arch.py), so a wrong name or ordering there fails the
tests. `kinds` quantizes chosen tensors (by GGUF name) with the gguf library's own quantizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

# Hugging Face model_type -> (the converter's GGUF architecture, whether it writes it through LlamaModel)
CONVERTER = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False),
             "qwen3": ("QWEN3", False)}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # LlamaModel.permute: each head's rows from two halves to llama.cpp's interleaved rotary order
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(writer, folder: Path, vocab_size: int) -> None:
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if i in added and added[i].special
                         else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)


def write_gguf(folder: Path | str, out: Path | str, kinds: dict[str, str] | None = None) -> Path:
    """The model in `folder` as the GGUF file `out` (float32 tensors, norms included; `kinds`: GGUF tensor name ->
    GGML type name for tensors to quantize, e.g. {'token_embd.weight': 'Q4_0'}). Returns `out`."""
    import gguf
    from gguf.quants import quantize

    folder, out, kinds = Path(folder), Path(out), kinds or {}
    hp = json.loads((folder / "config.json").read_text())
    arch_name, through_llama = CONVERTER[hp["model_type"]]
    arch = gguf.MODEL_ARCH[arch_name]
    names = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(folder.name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    if through_llama:  # LlamaModel's own keys
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, folder, hp["vocab_size"])

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if name == "lm_head.weight" and hp.get("tie_word_embeddings"):
                continue
            data = f.get_tensor(name).to(torch.float32).numpy()
            if through_llama and name.endswith(("q_proj.weight", "q_proj.bias")):
                data = llama_permute(data, hp["num_attention_heads"])
            elif through_llama and name.endswith(("k_proj.weight", "k_proj.bias")):
                data = llama_permute(data, hp["num_key_value_heads"])
            gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gname in kinds:
                kind = gguf.GGMLQuantizationType[kinds[gname]]
                w.add_tensor(gname, quantize(data, kind), raw_dtype=kind)
            else:
                w.add_tensor(gname, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
