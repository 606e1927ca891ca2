"""The text side of outline decoding (Skeleton-of-Thought as Jupiter uses it): the outline prompt, the
point-expansion prompt, and parsing the model's numbered outline.

Prompts are chat messages, rendered by the served model's own chat template. The outline asks for 3 to 10
numbered points of a few words each; each point is then expanded as its own sequence, about that point only,
in one or two sentences.
"""

from __future__ import annotations

import re

MAX_POINTS = 10
MIN_POINTS = 2  # fewer is no outline: the request falls back to the default policy

OUTLINE_SYSTEM = (
    "You write the skeleton of an answer: 3 to 10 numbered points, one per line, each only a few words "
    "(at most 8). Do not explain the points."
)
EXPAND_SYSTEM = "Answer in one or two sentences."

# "1. x", "1) x", "1 - x", "Point 1: x", "**1.** x", "Step 2: x"; the number starts the line
_NUMBERED = re.compile(r"^\s*(?:[*_#>\s]*)(?:(?:point|step)\s*)?(\d{1,2})\s*(?:[.):\-]|\*\*)+\s*(.+?)\s*$", re.I)
_DECORATION = re.compile(r"^[*_\s]+|[*_\s]+$")


# One worked example before the question (as Skeleton-of-Thought's prompt has): without it SmolLM2-135M wrote
# a numbered outline for 13 of 20 vicuna80 prompts the router accepts; with it, for all 20.
EXAMPLE_QUESTION = "What are some ways to learn a new language?"
EXAMPLE_OUTLINE = ("1. Practice every day\n2. Use language apps\n3. Watch films with subtitles\n"
                   "4. Talk with native speakers\n5. Read simple books")


def outline_messages(question: str) -> list[dict]:
    """Chat messages that ask the model for the outline of its answer to `question`."""
    ask = "Question: {}\nWrite the numbered skeleton of the answer."
    return [{"role": "system", "content": OUTLINE_SYSTEM},
            {"role": "user", "content": ask.format(EXAMPLE_QUESTION)},
            {"role": "assistant", "content": EXAMPLE_OUTLINE},
            {"role": "user", "content": ask.format(question)}]


def expansion_messages(question: str, points: list[str], index: int) -> list[dict]:
    """Chat messages that ask the model to write point `index` (0-based) of the outline `points` only. Every
    point's messages start alike (the question), so the points share that prompt's KV cache. The skeleton
    itself is not shown: SmolLM2-135M then tends to repeat it instead of writing the point."""
    return [{"role": "system", "content": EXPAND_SYSTEM},
            {"role": "user", "content": f"{question}\nWrite only about this point: {points[index]}."}]


def _point(line: str) -> str | None:
    """The point a numbered line holds, undecorated; None for a line that is not a numbered point."""
    m = _NUMBERED.match(line)
    return _DECORATION.sub("", m.group(2)).rstrip(":").strip() if m else None


def _key(point: str) -> str:
    return re.sub(r"\W+", " ", point).strip().lower()


def cut_outline(text: str) -> str | None:
    """Where an outline being written is over, so its decoding can stop: the text before the first completed
    line that repeats an earlier point, or is prose after the points, or after MAX_POINTS distinct points;
    None while it may go on. (SmolLM2-135M often loops on one point until its token budget runs out.) Only
    completed lines count, so the cut does not depend on how many tokens each decoding step added."""
    seen: set[str] = set()
    done = 0  # characters of the lines kept so far
    for line in text.split("\n")[:-1]:
        point = _point(line)
        if len(seen) == MAX_POINTS or (point is None and seen and line.strip()) or (point and _key(point) in seen):
            return text[:done]
        if point and _key(point):
            seen.add(_key(point))
        done += len(line) + 1
    return None


def parse_outline(text: str) -> list[str]:
    """The numbered points of an outline, in order: lines starting with a number; markdown decoration and
    trailing colons stripped, empty and repeated points dropped (case-insensitive), at most MAX_POINTS.
    Returns [] when fewer than MIN_POINTS remain (the outline could not be parsed)."""
    points, seen = [], set()
    for line in text.splitlines():
        point = _point(line)
        if not point or not _key(point) or _key(point) in seen:
            continue
        seen.add(_key(point))
        points.append(point)
        if len(points) == MAX_POINTS:
            break
    return points if len(points) >= MIN_POINTS else []
