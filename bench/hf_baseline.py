"""The reference point: transformers' own `generate` on the same prompts, timed token by token."""

from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.progress import Progress


class _Clock:
    """A generate() streamer that timestamps every batch of tokens it is handed."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_transformers(model: str | None, dtype: str, prompts: list[str], max_tokens: int, console: Console) -> list:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgespec.model.source import resolve_model

    files = resolve_model(model)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok = AutoTokenizer.from_pretrained(files.folder)
    hf = AutoModelForCausalLM.from_pretrained(files.folder, dtype=torch_dtype).eval()
    runs = []
    with Progress(console=console) as progress, torch.inference_mode():
        task = progress.add_task("transformers generate", total=len(prompts) + 1)
        for prompt in [prompts[0], *prompts]:  # the first run warms up and is dropped
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            clock = _Clock()
            start = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, streamer=clock,
                              pad_token_id=tok.eos_token_id)
            # put() is called with the prompt first, then once per generated token
            stamps = clock.times[1:]
            n = out.shape[1] - ids.shape[1]
            decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else 0
            runs.append({"tokens": n, "ttft_ms": (stamps[0] - start) * 1000,
                         "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 else None})
            progress.advance(task)
    return runs[1:]
