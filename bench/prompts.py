"""Prompt files for benchmarks: JSONL rows with any of the shared sets' field names."""

from __future__ import annotations

import json
from pathlib import Path

FIELDS = ("turns", "Instruction", "instruction", "prompt")


def prompt_text(row: dict) -> str:
    """The user message of one row: the first turn, or the instruction with its input appended."""
    for name in FIELDS:
        if name in row:
            value = row[name]
            text = value[0] if isinstance(value, list) else value
            instances = row.get("instances") or []
            extra = instances[0].get("input", "") if instances else ""
            return f"{text}\n\n{extra}" if extra else text
    raise ValueError(f"no prompt field ({', '.join(FIELDS)}) in row {row}")


def load_prompts(path: Path, limit: int | None = None) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [prompt_text(r) for r in rows]
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts[:limit] if limit else prompts
