"""The served model's greedy answers (naive, temperature 0, through a running `edgespec serve` on port 8124) to
vicuna80 (128 tokens, as the benchmark) and to the drafters' training prompts (256 tokens), as token ids (the
text re-tokenized; the prompt as the chat template gives it), in WORK.

    python bench/results/issue39-ngram-pool/served_answers.py
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from edgespec.decoding.training.distill_data import training_prompts
from edgespec.model.source import resolve_model

URL, MODEL = "http://127.0.0.1:8124", "SmolLM2-135M-Instruct"
WORK = Path("/tmp/issue39-ngram-pool")
DATA = Path(__file__).parents[3] / "../shared/data"


def answer(tok, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(URL + "/v1/chat/completions", timeout=600, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
        "max_tokens": max_tokens, "decoding": "naive"})
    text = r.json()["choices"][0]["message"]["content"]
    chat = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return {"prompt": tok(chat, add_special_tokens=False).input_ids,
            "answer": tok(text, add_special_tokens=False).input_ids, "text": text}


def main() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(None).folder)
    WORK.mkdir(exist_ok=True)
    vicuna = [json.loads(line)["turns"][0] for line in (DATA / "prompts/vicuna80.jsonl").read_text().splitlines()]
    sets = [(vicuna, 128, "vicuna128.jsonl"), (training_prompts(DATA), 256, "corpus256.jsonl")]
    for prompts, max_tokens, name in sets:
        with ThreadPoolExecutor(16) as pool:
            rows = list(pool.map(lambda p, n=max_tokens: answer(tok, p, n), prompts))
        (WORK / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(name, len(rows), "answers,", sum(len(r["answer"]) for r in rows), "tokens")


if __name__ == "__main__":
    main()
