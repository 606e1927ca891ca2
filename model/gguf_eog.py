"""The ids a GGUF model ends its generation on, by llama.cpp's rule (src/llama-vocab.cpp, `llama_vocab::impl::load`,
its `special_eog_ids`, as vendored by llama-cpp-python 0.3.36): a file names only its eos id, yet Phi-3 ends its
turn with <|end|>, Gemma 3 with <end_of_turn>, Llama 3 with <|eot_id|>; llama.cpp finds those by their text.

Its rule, in its order:
1. the FIM pad, repo and file-separator tokens: the file's fim_pad/fim_rep/fim_sep ids, else the first token whose
   text is one of FIM_PAD / FIM_REP / FIM_SEP;
2. every token whose text is in EOG_TEXTS, whatever its token type (llama.cpp makes it a control token);
3. the file's eos, eot and eom ids (its own eot and eom detection by text finds only texts of EOG_TEXTS);
4. <|end|> is dropped where <|return|> and <|call|> (gpt-oss), or <|calls|> and <|flush|> (Solar Open), are end
   ids too, and </s> where <|tool_response> or <|plamo:eos|> is (Gemma 4, PLaMo: a normal </s>).
An id the file gives past the vocabulary is ignored, as llama.cpp ignores it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>",
    "<|return|>", "<|call|>",  # o200k_harmony
    "<|flush|>", "<|calls|>",  # solar-open
    "<end_of_turn>", "<|endoftext|>",
    "</s>",  # paddleocr
    "<|eom_id|>", "<EOT>", "_<EOT>",
    "[EOT]", "[EOS]",  # Kimi-K2
    "<|end_of_text|>",
    "<end_of_utterance>",  # smoldocling
    "<eos>", "<turn|>", "<|tool_response>",  # gemma4
    "<｜end▁of▁sentence｜>",  # deepseek-ocr
    "[e~[",  # minimax-m2/m3
})
# llama.cpp's FIM detection by text, for the three FIM tokens it ends generation on: GGUF key suffix -> texts
FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def end_of_generation_ids(meta: Mapping[str, object], tokens: Sequence[str]) -> list[int]:
    """The end-of-generation ids of a GGUF file with metadata `meta` (its scalar values by key) and token texts
    `tokens` (tokenizer.ggml.tokens): its eos id first (where it has one), then the others ascending."""
    n = len(tokens)
    to_id = {text: i for i, text in enumerate(tokens)}  # llama.cpp's token_to_id: a repeated text keeps its last id

    def file_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if isinstance(value, int) and 0 <= value < n else None

    eog = set()
    for name, texts in FIM_TEXTS.items():
        # llama.cpp walks token_to_id (a hash map) for the first match: an order of its own, which matters only for
        # a vocabulary holding two of one kind's texts; ours is by text, ascending
        found = file_id(name)
        if found is None:
            found = next((to_id[t] for t in sorted(set(texts) & to_id.keys())), None)
        if found is not None:
            eog.add(found)
    eog.update(i for text, i in to_id.items() if text in EOG_TEXTS)
    eos = file_id("eos")
    eog.update(i for i in (eos, file_id("eot"), file_id("eom")) if i is not None)
    held = {tokens[i]: i for i in sorted(eog)}  # text -> id of the end tokens found
    if "<|end|>" in held and (("<|return|>" in held or "<|flush|>" in held)
                              and ("<|call|>" in held or "<|calls|>" in held)):
        eog.discard(held["<|end|>"])
    if "</s>" in held and ("<|tool_response>" in held or "<|plamo:eos|>" in held):
        eog.discard(held["</s>"])
    first = [eos] if eos in eog else []
    return first + sorted(eog - set(first))
