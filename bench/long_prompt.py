"""Time to first token of a long prompt, for `bench-peer` (bench/versus.py): every live server gets the same
prompts of about N tokens in turn, one request at a time, each a one-token completion, so its time is the
prompt's prefill plus one step. Each repetition starts with its own line, so neither server reuses a cached
prefix (edgespec's prefix cache matches from the first block; llama.cpp's server keeps the previous prompt's
prefix). The prompt is the prompt set's own texts, joined until about CHARS_PER_TOKEN * N characters.
"""

from __future__ import annotations

import statistics
import time

import httpx

CHARS_PER_TOKEN = 5.0  # vicuna80 under SmolLM2's tokenizer: 4301 characters, 860 prompt tokens (template included)


def long_prompt(texts: list[str], tokens: int, repetition: int) -> str:
    """About `tokens` tokens of the texts joined, headed by a line of its own for this repetition."""
    head = f"Request {repetition}: read the notes below, then answer the last one.\n\n"
    body, chars = [], len(head)
    while chars < tokens * CHARS_PER_TOKEN:
        for text in texts:
            body.append(text)
            chars += len(text) + 2
            if chars >= tokens * CHARS_PER_TOKEN:
                break
    return head + "\n\n".join(body)


def first_token(client: httpx.Client, model: str, prompt: str, fields: dict | None) -> dict:
    """One non-streamed one-token chat completion at temperature 0, timed client side: {ms, prompt_tokens}."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 1,
            **(fields or {})}
    start = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    ms = (time.perf_counter() - start) * 1000
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
    return {"ms": round(ms, 1), "prompt_tokens": r.json()["usage"]["prompt_tokens"]}


def summarise_long(times: dict[str, list[dict]], reference: str) -> dict:
    """Per server label: the median ms, the prompt tokens, and the ratio of its median to `reference`'s."""
    out = {label: {"median_first_token_ms": round(statistics.median(r["ms"] for r in rs), 1),
                   "prompt_tokens": sorted({r["prompt_tokens"] for r in rs}), "ms": [r["ms"] for r in rs]}
           for label, rs in times.items() if rs}
    ref = out.get(reference, {}).get("median_first_token_ms")
    for row in out.values():
        row["ratio_to_llama_cpp"] = round(row["median_first_token_ms"] / ref, 3) if ref else None
    return out
