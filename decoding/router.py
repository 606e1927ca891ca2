"""Whether outline decoding suits a prompt: a rule-based router, and its evaluation on labelled prompts.

Skeleton-of-Thought helps answers that are lists of independent points (advice, knowledge, comparisons,
role-play, common sense, counterfactuals) and hurts where each step builds on the last or the answer is
short (maths, code, step-by-step reasoning, estimates, translations, continuous prose). The rules look for
the second kind; everything else goes to outline. Evaluated by

    python -m decoding.router --data ../shared/data [--out FILE.json]

on the categories of vicuna80 and the skills of the WizardLM test set, labelled as below.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

# (reason, pattern): a match means outline does not suit the prompt
RULES = [
    ("code", r"```|\b(code|coding|program(ming)?|function|python|javascript|java|c\+\+|sql|regex|script|"
             r"implement|algorithm|debug|bug|compile|html|css|api|class|variable|array|string|loop|recursion)\b"),
    ("math", r"\d\s*[-+*/^=×÷<>]\s*\(?\d|\b(solve|equation|calculate|compute|integral|derivative|probability|"
             r"prove|sum of|product of|how much|percent(age)?|average|area of|volume of|\d+x)\b"),
    ("estimate", r"\bhow many\b|\bestimate\b|\bapproximately\b"),
    ("reasoning", r"\bstep[- ]by[- ]step\b|\b(reasoning|riddle|puzzle|logic(al)?|deduce|infer|if .* then)\b"),
    ("translation", r"\b(translate|translation|in (french|spanish|german|chinese|japanese|italian|russian))\b"),
    ("format", r"\b(rewrite|paraphrase|summari[sz]e|correct the|grammar|table|json|csv|format|fill in)\b"),
    ("prose", r"\bwrite (a|an|me a)\b.*\b(poem|story|letter|email|essay|song|haiku|limerick|speech|dialogue|"
              r"tweet|post|review|script)\b|\b(compose|draft)\b"),
    ("short answer", r"^\s*(who|when|where|which|is|are|does|do|can|did)\b[^.?!]{0,60}\?\s*$"),
]
_COMPILED = [(reason, re.compile(pattern, re.I | re.S)) for reason, pattern in RULES]

# Labels for the evaluation: SoT's findings on the vicuna80 categories (see ../shared/data/README.md), and
# the same split of the WizardLM skills (knowledge domains yes; maths, code, reasoning, formats, translation
# and prose no). Categories in neither set are reported but not scored.
SUITS = {"generic", "knowledge", "roleplay", "common-sense", "counterfactual",
         "Common-Sense", "Counterfactual", "Roleplay", "Biology", "Technology", "Ethics", "Sport", "Law", "Medicine",
         "Literature", "Entertainment", "Art", "Music", "Economy", "Physics", "History", "Chemistry", "Philosophy",
         "Computer Science"}
UNSUITED = {"math", "coding", "fermi",
            "Math", "Code Generation", "Code Debug", "Reasoning", "Complex Format", "Multilingual", "Writting",
            "Academic Writing"}


def route(prompt: str) -> tuple[bool, str]:
    """(whether outline suits the prompt, why)."""
    for reason, pattern in _COMPILED:
        if pattern.search(prompt):
            return False, reason
    return True, "independent points"


def evaluate(data: Path) -> dict:
    """Accuracy of route() on the labelled prompts of vicuna80 and the WizardLM test set, per set and per
    category (share routed to outline)."""
    from bench.prompts import prompt_text

    out = {}
    for name, field in (("vicuna80", "category"), ("wizardlm_testset", "Skill")):
        rows = [json.loads(line) for line in (data / "prompts" / f"{name}.jsonl").read_text().splitlines() if line]
        routed: dict[str, list[bool]] = {}
        for row in rows:
            routed.setdefault(row[field], []).append(route(prompt_text(row))[0])
        scored = [(cat, r) for cat, rs in routed.items() for r in rs if cat in SUITS | UNSUITED]
        correct = sum(r == (cat in SUITS) for cat, r in scored)
        confusion = Counter(f"{'suits' if cat in SUITS else 'unsuited'}->{'outline' if r else 'default'}"
                            for cat, r in scored)
        shares = {cat: round(sum(rs) / len(rs), 3) for cat, rs in sorted(routed.items())}
        out[name] = {"accuracy": round(correct / len(scored), 4), "scored": len(scored),
                     "confusion": dict(sorted(confusion.items())), "outline_share_by_category": shares}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="evaluate the outline router on the labelled prompt sets")
    p.add_argument("--data", type=Path, default=Path("../shared/data"))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = evaluate(args.data)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
