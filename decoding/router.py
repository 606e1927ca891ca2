"""Whether outline decoding suits a prompt: a rule-based router (evaluated by bench/router_eval.py).

Skeleton-of-Thought helps answers that are lists of independent points (advice, knowledge, comparisons,
role-play, common sense, counterfactuals) and hurts where each step builds on the last or the answer is
short (maths, code, step-by-step reasoning, estimates, translations, continuous prose). The rules look for
the second kind; everything else goes to outline. `python -m bench.router_eval` scores it on the categories of
vicuna80 and the skills of the WizardLM test set, labelled as below.
"""

from __future__ import annotations

import re

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
