"""decoding.text.TextStream with the real SmolLM2 tokenizer: incremental text, stop strings, stop tokens and
the token budget."""

from __future__ import annotations

import random

import pytest
from model_fixtures import smollm2_folder

from edgespec.decoding.text import Pushed, TextStream

TEXTS = [
    "Hello world. The END of it all",
    "Please STOP now and continue",
    "I love 🦙 and 你好世界 😀!",
    "a\n\nb  c\tdone",
    "Spaces   before , punctuation . and 'quotes' don't change",
    "Ünïcödé àccents — and “curly” quotes…",
    "def f(x):\n    return x ** 2  # code\n",
    "日本語のテキストと한국어 텍스트",
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder())


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(tok, ids: list[int], stop=(), stop_token_ids=frozenset(), max_tokens: int = 10_000) -> list[Pushed]:
    """Push ids until the stream finishes; the Pushed of every token pushed."""
    stream = TextStream(tok, tuple(stop), frozenset(stop_token_ids), max_tokens)
    out = []
    for token in ids:
        out.append(stream.push(token))
        if out[-1].finish_reason:
            break
    return out


def joined(pushed: list[Pushed]) -> str:
    return "".join(p.text for p in pushed)


# --- plain streaming ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_decoded_text(tok, text):
    ids = encode(tok, text)
    pushed = run(tok, ids, max_tokens=len(ids))
    assert len(pushed) == len(ids)
    assert [p.finish_reason for p in pushed] == [None] * (len(ids) - 1) + ["length"]
    assert joined(pushed) == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in p.text for p in pushed)


def test_deltas_before_the_end_are_a_prefix_of_the_text(tok):
    text = TEXTS[2]
    ids = encode(tok, text)
    pushed = run(tok, ids)
    assert not any(p.finish_reason for p in pushed)  # budget not reached: nothing finishes
    so_far = ""
    for p in pushed:
        so_far += p.text
        assert text.startswith(so_far)
    assert so_far == text


@pytest.mark.parametrize("seed", range(40))
def test_random_ids_stream_like_decode(tok, seed):
    """Arbitrary token ids (byte tokens that do not form characters included) stream to what decode gives."""
    r = random.Random(seed)
    ids = [r.randrange(3, tok.vocab_size) for _ in range(r.randrange(1, 30))]
    assert joined(run(tok, ids, max_tokens=len(ids))) == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_not_shown(tok):
    ids = [*encode(tok, "one"), tok.convert_tokens_to_ids("<|im_start|>"), *encode(tok, " two")]
    assert joined(run(tok, ids, max_tokens=len(ids))) == "one two"


# --- multi-byte characters --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["🦙", "😀😀 ok", "你好世界", "x 🦙 y 你 z"])
def test_multibyte_characters_split_across_tokens(tok, text):
    ids = encode(tok, text)
    assert len(ids) > len(text.split()), "the characters should take several byte tokens"
    pushed = run(tok, ids, max_tokens=len(ids))
    assert all("\ufffd" not in p.text for p in pushed)
    assert joined(pushed) == text
    # a token that ends inside a character shows nothing yet
    assert any(p.text == "" for p in pushed)


def test_budget_ending_inside_a_character_shows_what_decode_shows(tok):
    ids = encode(tok, "I love 🦙")
    cut = ids[:-1]  # the llama's last byte is missing
    pushed = run(tok, cut, max_tokens=len(cut))
    assert pushed[-1].finish_reason == "length"
    assert joined(pushed) == tok.decode(cut, skip_special_tokens=True)


# --- stop strings -----------------------------------------------------------------------------------------


def stop_index(tok, ids: list[int], stop: str) -> int:
    """Index of the token whose text completes the first occurrence of `stop`."""
    return next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1]))


@pytest.mark.parametrize(
    ("text", "stop", "before"),
    [
        ("Hello world. The END of it all", "END of", "Hello world. The "),  # spans ' END' + ' of'
        ("Please STOP now and continue", "STOP", "Please "),  # spans ' ST' + 'OP'
        ("Hello world. The END of it all", "llo wor", "He"),  # starts and ends inside tokens
        ("Hello world. The END of it all", ". The END", "Hello world"),  # three tokens
        ("I love 🦙 and 你好世界 😀!", "🦙 and 你", "I love "),  # made of byte tokens
    ],
)
def test_stop_string_is_not_leaked(tok, text, stop, before):
    ids = encode(tok, text)
    assert len(ids) > 2
    pushed = run(tok, ids, stop=[stop], max_tokens=len(ids) + 5)
    assert joined(pushed) == before
    assert pushed[-1].finish_reason == "stop"
    assert len(pushed) == stop_index(tok, ids, stop) + 1  # ends on the token that completes the stop string
    assert all(stop[:2] not in p.text for p in pushed) or stop[:2] in before


def test_stop_string_spanning_tokens_is_held_back(tok):
    ids = encode(tok, "Hello world. The END of it all")
    pushed = run(tok, ids, stop=["END of"])
    # ' END' arrives: ' ' is shown, 'END' waits; ' of' completes the stop string
    assert [p.text for p in pushed] == ["Hello", " world", ".", " The", " ", ""]


def test_earliest_of_several_stop_strings_wins(tok):
    ids = encode(tok, "Hello world. The END of it all")
    # ' world' completes both; the text ends before the earlier one, whatever the order of the list
    for stop in (["world", " w"], [" w", "world"]):
        pushed = run(tok, ids, stop=stop)
        assert joined(pushed) == "Hello"
        assert pushed[-1].finish_reason == "stop"


def test_stop_string_prefix_that_diverges_is_emitted(tok):
    text = "Please STOP now and continue"
    ids = encode(tok, text)
    pushed = run(tok, ids, stop=["STOP HERE"], max_tokens=len(ids))
    assert joined(pushed) == text
    assert pushed[-1].finish_reason == "length"
    texts = [p.text for p in pushed]
    # 'ST' and 'OP' are held while they may still become 'STOP HERE', then released together
    assert texts[:4] == ["Please", " ", "", "STOP now"]


def test_held_back_prefix_is_flushed_at_the_budget(tok):
    ids = encode(tok, "Please STOP")
    pushed = run(tok, ids, stop=["STOP HERE"], max_tokens=len(ids))
    assert pushed[-1].finish_reason == "length"
    assert joined(pushed) == "Please STOP"


def test_empty_stop_strings_are_ignored(tok):
    ids = encode(tok, "Hello world")
    pushed = run(tok, ids, stop=["", "zzz"], max_tokens=len(ids))
    assert joined(pushed) == "Hello world"
    assert pushed[-1].finish_reason == "length"


def test_stop_string_beats_the_budget_on_the_same_token(tok):
    ids = encode(tok, "Please STOP now")
    pushed = run(tok, ids, stop=["STOP"], max_tokens=3)  # 'OP' is the third token
    assert len(pushed) == 3
    assert pushed[-1] == Pushed("", "stop")
    assert joined(pushed) == "Please "


# --- stop tokens and the budget -----------------------------------------------------------------------------


def test_stop_token_ends_with_stop_and_no_text(tok):
    eos = tok.eos_token_id
    ids = [*encode(tok, "Hello world"), eos, *encode(tok, " more")]
    pushed = run(tok, ids, stop_token_ids={eos})
    assert len(pushed) == 3
    assert pushed[-1] == Pushed("", "stop")
    assert joined(pushed) == "Hello world"


def test_stop_token_flushes_held_text(tok):
    eos = tok.eos_token_id
    ids = [*encode(tok, "Please STOP"), eos]
    pushed = run(tok, ids, stop=["STOP HERE"], stop_token_ids={eos})
    assert pushed[-1] == Pushed("STOP", "stop")  # held while it could have become 'STOP HERE'
    assert joined(pushed) == "Please STOP"


def test_ordinary_token_as_stop_token_shows_no_text(tok):
    world = encode(tok, " world")
    assert len(world) == 1 and world[0] not in tok.all_special_ids
    ids = [*encode(tok, "Hello"), world[0]]
    pushed = run(tok, ids, stop_token_ids=set(world))
    assert pushed[-1] == Pushed("", "stop")
    assert joined(pushed) == "Hello"


def test_stop_token_on_the_last_budgeted_token_is_stop(tok):
    eos = tok.eos_token_id
    ids = [*encode(tok, "Hi"), eos]
    pushed = run(tok, ids, stop_token_ids={eos}, max_tokens=len(ids))
    assert pushed[-1] == Pushed("", "stop")


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_ends_with_length(tok, max_tokens):
    ids = encode(tok, "Hello world. The END of it all")
    pushed = run(tok, ids, max_tokens=max_tokens)
    assert len(pushed) == max_tokens
    assert [p.finish_reason for p in pushed] == [None] * (max_tokens - 1) + ["length"]
    assert joined(pushed) == tok.decode(ids[:max_tokens])


def test_push_after_finish_raises(tok):
    stream = TextStream(tok, (), frozenset(), 1)
    assert stream.push(encode(tok, "Hi")[0]).finish_reason == "length"
    assert stream.finished == "length"
    with pytest.raises(RuntimeError):
        stream.push(encode(tok, "Hi")[0])
