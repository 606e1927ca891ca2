"""Outline parsing and the outline router (no model): numbered points in the forms models write, duplicates
and empty lines dropped, the cap, the fallback signal; router decisions on clear cases."""

from __future__ import annotations

import pytest

from edgespec.decoding.outline_text import MAX_POINTS, cut_outline, expansion_messages, outline_messages, parse_outline
from edgespec.decoding.router import route


@pytest.mark.parametrize("text, points", [
    ("1. Plan your day\n2. Set priorities\n3. Avoid distractions", ["Plan your day", "Set priorities",
                                                                  "Avoid distractions"]),
    ("Here is the skeleton:\n\n1) Sleep well.\n\n2) Exercise\n3)   Eat well  \nHope this helps!",
     ["Sleep well.", "Exercise", "Eat well"]),
    ("**1.** **Budget**\n**2.** Save:\n- detail\n3 - Invest", ["Budget", "Save", "Invest"]),
    ("Point 1: Cost\nPoint 2: Speed\nStep 3: Safety", ["Cost", "Speed", "Safety"]),
    ("1. Cost\n2. cost\n3.\n4. Speed!\n5. Speed", ["Cost", "Speed!"]),  # repeats (case, punctuation) and empties
    ("1. Only one point", []),  # too few: the request falls back
    ("No numbers here.\nJust prose.", []),
])
def test_outline_parsing(text, points):
    assert parse_outline(text) == points


def test_outline_is_capped():
    text = "\n".join(f"{i}. point number {i}" for i in range(1, 15))
    assert parse_outline(text) == [f"point number {i}" for i in range(1, MAX_POINTS + 1)]


@pytest.mark.parametrize("text, cut", [
    ("1. Pride\n2. Excitement\n3. Pride\n4. Pr", "1. Pride\n2. Excitement\n"),  # a point repeats
    ("1. Sleep\n\n2. Eat\nThe answer is 1.\n", "1. Sleep\n\n2. Eat\n"),  # prose after the points
    ("Here you go:\n1. Sleep\n2. Eat", None),  # prose before the points, and the last line still growing
    ("1. Sleep\n2. Eat\n2. Eat", None),  # a repeat on a line not completed yet
    ("".join(f"{i}. point {i}\n" for i in range(1, 13)), "".join(f"{i}. point {i}\n" for i in range(1, 11))),
])
def test_an_outline_is_cut_where_it_is_over(text, cut):
    assert cut_outline(text) == cut
    if cut:  # the cut keeps every point the whole text would give, up to its first repeat
        assert parse_outline(cut) == parse_outline(text)[:len(parse_outline(cut))]


def test_prompts_name_the_question_and_the_point():
    assert "How do I sleep better?" in outline_messages("How do I sleep better?")[-1]["content"]
    first, second = (expansion_messages("Q?", ["Cost", "Speed"], i)[-1]["content"] for i in range(2))
    assert "Q?" in second and "Speed" in second and "Cost" not in second
    assert first[:first.index("Cost")] == second[:second.index("Speed")]  # the points share their prompt's start


@pytest.mark.parametrize("prompt", [
    "How can I improve my time management skills?",
    "What are the main differences between cats and dogs as pets?",
    "What are some tips for staying healthy while travelling?",
    "Compare renewable and non-renewable energy sources.",
    "As a pirate captain, what would you say to motivate your crew to search for hidden treasure?",
])
def test_router_accepts_lists_advice_knowledge_comparisons(prompt):
    assert route(prompt)[0]


@pytest.mark.parametrize("prompt, reason", [
    ("Solve for x: 3x + 10 = 5(x - 2).", "math"),
    ("Write a Python function that reverses a linked list.", "code"),
    ("How many times does a human blink in a lifetime? Explain step by step.", "estimate"),
    ("Translate 'good morning' into French.", "translation"),
    ("Who wrote Hamlet?", "short answer"),
])
def test_router_refuses_math_code_reasoning_and_short_answers(prompt, reason):
    assert route(prompt) == (False, reason)
