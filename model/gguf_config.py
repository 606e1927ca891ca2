"""A Hugging Face config from a GGUF file's metadata, for the architectures whose files transformers' GGUF loader
does not read (Architecture.gguf_by_transformers False: SmolLM3, Granite).

llama.cpp's converter writes these through LlamaModel (TextModel's and LlamaModel's keys, under the file's own
architecture name); they are read back here as transformers' loader reads a llama file's (its
GGUF_TO_TRANSFORMERS_MAPPING for llama), with the architecture's own keys beside them (Architecture.gguf_fields:
Granite's multipliers). What a file cannot hold follows from transformers' config class defaults, as for a folder
(SmolLM3's NoPE layers: every fourth, which is also llama.cpp's fixed rule for the architecture).
"""

from __future__ import annotations

from edgespec.model.arch import Architecture

# the llama keys after '{arch}.' -> the config field transformers' loader reads them into
LLAMA_FIELDS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
    "attention.key_length": "head_dim",
}
# tokenizer ids -> config fields (absent ones stay None, not the config class's own checkpoint's)
TOKEN_FIELDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}


def gguf_hf_config(meta: dict, tensors: set[str], arch: Architecture) -> dict:
    """The config dict (transformers' config class of `arch`, its defaults filled in) of a GGUF with metadata
    `meta` (read_index's, with tokenizer.ggml.tokens read) and tensor names `tensors`."""
    from transformers import AutoConfig

    prefix = meta["general.architecture"]
    fields = {}
    for key, name in {**LLAMA_FIELDS, **arch.gguf_fields}.items():
        if (value := meta.get(f"{prefix}.{key}")) is not None:
            fields[name] = value
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if meta.get(f"{prefix}.rope.scaling.type") == "linear":
        fields["rope_parameters"] = {"rope_type": "linear", "factor": float(meta[f"{prefix}.rope.scaling.factor"]),
                                     "rope_theta": float(fields.pop("rope_theta", 10000.0))}
    for key, name in TOKEN_FIELDS.items():
        fields[name] = meta.get(f"tokenizer.ggml.{key}")
    fields["tie_word_embeddings"] = "output.weight" not in tensors  # the converter writes a tied head once
    return AutoConfig.for_model(arch.hf_types[0], **fields).to_dict()
