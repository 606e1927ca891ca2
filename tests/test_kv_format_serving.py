"""The KV formats as users run them: the default model served with --kv-format, in-process and over layer
workers (each worker's cache in the format the controller names), prefix cache on: at temperature 0 every exact
policy streams naive's tokens in that format, and the same request again (its prompt from the prefix cache)
gives the same answer."""

from __future__ import annotations

import pytest
from openai import OpenAI
from processes import start_server
from test_api_exact import EXACT, MODEL, answer

from edgespec.server.settings import ServeSettings

PROMPT = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."


# float16 in-process is the default: the session's server (conftest.py), which test_api_exact.py asks too
@pytest.mark.slow
@pytest.mark.parametrize(("kv", "extra"), [("q8_0", ("--local-workers", "2", "--placement", "even")),
                                           ("float16", None)], ids=["q8_0-workers", "float16-inprocess"])
def test_exact_policies_are_exact_in_every_kv_format(kv, extra, tmp_path, request):
    proc = None
    if extra is None:
        assert ServeSettings().kv_format == kv
        client = request.getfixturevalue("client")
    else:
        proc, url = start_server(tmp_path, kv, "--kv-format", kv, *extra)
        client = OpenAI(base_url=url + "/v1", api_key="none")
    try:
        naive = answer(client, PROMPT, "naive")
        for decoding in EXACT:
            assert answer(client, PROMPT, decoding, stream=True) == naive, decoding
        again = client.chat.completions.create(model=MODEL, max_tokens=64, temperature=0,
                                               messages=[{"role": "user", "content": PROMPT}])
        assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.choices[0].message.content == naive
    finally:
        if proc is not None:
            proc.stop()


def test_an_unknown_kv_format_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_format"):
        ServeSettings(kv_format="q4_0")
