"""A GGUF's end-of-generation ids, by llama.cpp's rule (src/llama-vocab.cpp's special_eog_ids; model/gguf_eog.py
mirrors it): a model whose file names only its eos id still stops where it ends its turn (Phi-3's <|end|>,
Gemma 3's <end_of_turn>). GGUFs written the way llama.cpp's converter writes them (bench/gguf_writer.py: added
special tokens as CONTROL tokens, only the eos id named), served through the HTTP API."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import LoopClient, controller_app

from edgespec.bench.gguf_writer import tiny_model, write_gguf
from edgespec.model.config import ModelConfig
from edgespec.model.gguf_eog import end_of_generation_ids
from edgespec.model.gguf_source import read_index
from edgespec.model.source import resolve_model

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}
TURN_ENDS = ("<|end|>", "<end_of_turn>")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """(a tiny Llama GGUF whose vocabulary adds TURN_ENDS and <|user|> as special tokens, their ids)."""
    from transformers import AutoTokenizer

    folder = tiny_model("llama", tmp_path_factory.mktemp("eog"), 0, SHAPE,
                        special_tokens=(*TURN_ENDS, "<|user|>"))
    tok = AutoTokenizer.from_pretrained(folder)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*TURN_ENDS, "<|user|>")}
    return write_gguf(folder, tmp_path_factory.mktemp("eog-gguf") / "eog.f32.gguf"), ids


def test_the_writer_names_only_the_eos_and_marks_the_turn_ends_control(model):
    from gguf import TokenType

    gguf, ids = model
    meta = read_index(gguf, arrays={"tokenizer.ggml.token_type"}).meta
    assert "tokenizer.ggml.eot_token_id" not in meta  # the converter names no eot for these
    assert all(meta["tokenizer.ggml.token_type"][i] == TokenType.CONTROL for i in ids.values())


def test_the_gguf_config_ends_at_each_turn_end(model):
    gguf, ids = model
    folder = resolve_model(str(gguf)).folder
    ends = ModelConfig.from_folder(folder).eos_token_ids
    default = ModelConfig.from_folder(resolve_model(None).folder).eos_token_ids
    assert ends[:1] == default[:1]  # the file's eos (SmolLM2's <|im_end|>) first
    assert {ids[t] for t in TURN_ENDS} <= set(ends)
    assert ids["<|user|>"] not in ends  # a special token of no end


def test_the_default_models_ends_are_llama_cpps():
    from transformers import AutoTokenizer

    folder = resolve_model(None).folder
    tok = AutoTokenizer.from_pretrained(folder)
    # <|im_end|> (its eos), <|endoftext|> (by text), <reponame> (llama.cpp's FIM repo token, which ends too)
    assert tok.convert_ids_to_tokens(list(ModelConfig.from_folder(folder).eos_token_ids)) == [
        "<|im_end|>", "<|endoftext|>", "<reponame>"]


def _chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "eog", "max_tokens": 6, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Hello"}], **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_turn_end_stops_the_answer(model):
    gguf, ids = model
    app, service = controller_app(str(gguf), served_model_name="eog")
    client = LoopClient(app)
    try:
        for text in TURN_ENDS:  # made the greedy token by its logit bias
            out = _chat(client, logit_bias={str(ids[text]): 100})
            assert out["choices"][0]["finish_reason"] == "stop", text
            assert out["usage"]["completion_tokens"] == 1, text
            assert out["choices"][0]["message"]["content"] == "", text
        out = _chat(client, logit_bias={str(ids["<|user|>"]): 100})
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 6
    finally:
        client.close()
        service.engine.close()


def test_llama_cpps_exceptions():
    def ends(tokens, **meta):
        return end_of_generation_ids({f"tokenizer.ggml.{k}_token_id": v for k, v in meta.items()}, tokens)

    # gpt-oss: <|end|> closes a message, not the answer, where <|return|> and <|call|> end it
    assert ends(["a", "<|end|>", "<|return|>", "<|call|>"], eos=2) == [2, 3]
    assert ends(["a", "<|end|>", "<|return|>"], eos=2) == [2, 1]
    # Gemma 4 / PLaMo: a normal </s>
    assert ends(["</s>", "<|tool_response>"]) == [1]
    assert ends(["</s>", "b"]) == [0]
    # the file's eot and eom ids end too, an id past the vocabulary is ignored; a FIM pad by key or by text
    assert ends(["a", "b", "c", "d"], eos=0, eot=2, eom=9, fim_pad=3) == [0, 2, 3]
    assert ends(["a", "<|fim_pad|>", "<|file_sep|>", "<|fim_prefix|>"], eos=0) == [0, 1, 2]
