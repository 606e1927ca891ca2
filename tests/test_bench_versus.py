"""The pure parts of `edgespec bench-peer`: the per-configuration table from per-request records, the peak
RSS of processes, the server command lines. No servers are started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from edgespec.bench.llamacpp import child_pids, llama_python, llamacpp_argv, peak_rss_bytes, vm_hwm_bytes
from edgespec.bench.long_prompt import CHARS_PER_TOKEN, first_token, long_prompt, summarise_long
from edgespec.bench.plot import plot_versus
from edgespec.bench.versus import LLAMA, LLAMA_REQUEST, edgespec_argv, gguf_format, machine_info, stream_chat, summarise


def _record(server, fmt, policy, prompt, tokens, rate, ttft=100.0, counted="usage"):
    return {"server": server, "format": fmt, "policy": policy, "prompt": prompt, "tokens": tokens,
            "token_count": counted, "ttft_ms": ttft, "decode_tokens_per_s": rate}


def test_summarise_medians_ratios_and_token_parity():
    records = [
        _record(LLAMA, "Q4_1", LLAMA, 0, 10, 100.0, 20.0, "content_chunks"),
        _record(LLAMA, "Q4_1", LLAMA, 1, 20, 120.0, 40.0, "content_chunks"),
        _record(LLAMA, "Q4_1", LLAMA, 2, 30, 140.0, 60.0, "content_chunks"),
        _record("edgespec", "auto", "naive", 0, 10, 40.0),
        _record("edgespec", "auto", "speculative", 0, 10, 80.0),
        _record("edgespec", "auto", "naive", 1, 21, 60.0),
        _record("edgespec", "auto", "speculative", 1, 20, None),  # one token: no decode rate
        _record("edgespec", "auto", "naive", 2, 30, 50.0),
        _record("edgespec", "auto", "speculative", 2, 30, 90.0),
    ]
    rss = {(LLAMA, "Q4_1", LLAMA): 300 * 2**20, ("edgespec", "auto", "naive"): int(512.25 * 2**20),
           ("edgespec", "auto", "speculative"): 600 * 2**20}
    rows = summarise(records, rss)
    assert [(r["server"], r["format"], r["policy"]) for r in rows] == [
        (LLAMA, "Q4_1", LLAMA), ("edgespec", "auto", "naive"), ("edgespec", "auto", "speculative")]
    llama, naive, spec = rows
    assert llama["median_decode_tokens_per_s"] == 120.0
    assert llama["median_ttft_ms"] == 40.0
    assert llama["peak_rss_mib"] == 300.0
    assert llama["ratio_to_llama_cpp"] == 1.0
    assert llama["token_count"] == "content_chunks"
    assert llama["same_tokens_as_llama_cpp"] is None
    assert llama["tokens_per_request"] == [10, 20, 30] and llama["total_tokens"] == 60
    assert naive["median_decode_tokens_per_s"] == 50.0
    assert naive["ratio_to_llama_cpp"] == round(50 / 120, 3)
    assert naive["same_tokens_as_llama_cpp"] == 2  # prompt 1: 21 tokens against 20
    assert naive["peak_rss_mib"] == 512.2 and spec["peak_rss_mib"] == 600.0
    assert spec["median_decode_tokens_per_s"] == 85.0  # the request without a rate is left out
    assert spec["ratio_to_llama_cpp"] == round(85 / 120, 3)
    assert spec["same_tokens_as_llama_cpp"] == 3
    assert spec["same_text_as_llama_cpp"] == 0 and llama["same_text_as_llama_cpp"] is None  # no texts here
    assert spec["median_tokens"] == 20 and spec["prompts"] == 3
    json.dumps(rows)  # goes into versus.json as it is


def test_summarise_without_llama_cpp_has_no_ratios():
    rows = summarise([_record("edgespec", "f32", "naive", 0, 5, 30.0)], {})
    assert rows[0]["ratio_to_llama_cpp"] is None
    assert rows[0]["peak_rss_mib"] is None
    assert rows[0]["same_tokens_as_llama_cpp"] is None
    assert summarise([], {}) == []


def test_peak_rss_of_this_process():
    own = vm_hwm_bytes(os.getpid())
    assert own is not None and own > 10 * 2**20  # a Python process with pytest loaded
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert abs(own - kb * 1024) <= 64 * 2**20  # it can only have grown in between
    assert peak_rss_bytes(os.getpid()) >= own
    assert vm_hwm_bytes(2**22 + 12345) is None  # beyond pid_max: no such process


def test_peak_rss_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert child.pid in child_pids(os.getpid())
        parts = vm_hwm_bytes(os.getpid()) + vm_hwm_bytes(child.pid)
        assert peak_rss_bytes(os.getpid()) >= parts  # peaks only grow: the later total holds both
    finally:
        child.kill()
        child.wait()


def test_command_lines(monkeypatch, tmp_path):
    gguf = Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf_format(gguf) == "Q4_1"
    assert llamacpp_argv("/py", gguf, 8123) == [
        "/py", "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", "8123",
        "--n_threads", "2", "--n_ctx", "2048"]
    argv = edgespec_argv("q8_0", 9000, ["--threads", "2"])
    assert argv[1:4] == ["-m", "edgespec.server.cli", "serve"]
    assert argv[argv.index("--weights") + 1] == "q8_0" and argv[-2:] == ["--threads", "2"]
    assert "--weights" not in edgespec_argv("default", 9000, [])
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("EDGESPEC_LLAMA_PYTHON", str(python))
    assert llama_python() == str(python)
    assert llama_python(sys.executable) == sys.executable
    monkeypatch.setenv("EDGESPEC_LLAMA_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="peer-env"):
        llama_python()


def test_machine_info():
    info = machine_info()
    assert set(info) >= {"cpu_model", "torch", "date"}
    assert info["torch"]


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _delta(text=None, finish=None):
    return {"choices": [{"index": 0, "delta": {"content": text} if text is not None else {},
                         "finish_reason": finish}]}


@pytest.mark.parametrize(("finish", "usage", "tokens", "counted"), [
    ("length", {"completion_tokens": 7}, 7, "usage"),  # edgespec: usage wins
    ("length", None, 4, "finish_length"),  # llama.cpp at max_tokens: exactly max_tokens
    ("stop", None, 3, "content_chunks"),  # llama.cpp at end of sequence: the non-empty chunks
])
def test_stream_chat_counts_tokens(finish, usage, tokens, counted):
    bodies = []

    def reply(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
                  _delta("Hel"), _delta(""), _delta("lo"), _delta("!"), _delta(finish=finish)]
        if usage:
            chunks.append({"choices": [], "usage": usage})
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    with httpx.Client(base_url="http://peer", transport=httpx.MockTransport(reply)) as client:
        r = stream_chat(client, "m", "hi", 4, None, LLAMA_REQUEST)
        stream_chat(client, "m", "hi", 4, "naive")
    assert (r["tokens"], r["token_count"], r["content_chunks"]) == (tokens, counted, 3)
    assert r["text"] == "Hello!" and r["finish_reason"] == finish
    assert r["ttft_ms"] >= 0 and r["decode_tokens_per_s"] > 0
    assert "decoding" not in bodies[0] and bodies[0]["repeat_penalty"] == 1.0 and bodies[0]["temperature"] == 0
    assert bodies[1]["decoding"] == "naive" and "repeat_penalty" not in bodies[1]


def test_long_prompts_differ_from_the_first_line_and_reach_their_length():
    texts = ["Plan a trip to the coast.", "Explain how tides work to a child."]
    a, b = long_prompt(texts, 300, 0), long_prompt(texts, 300, 1)
    assert a.splitlines()[0] != b.splitlines()[0]  # no cached prefix from the repetition before
    assert a.splitlines()[1:] == b.splitlines()[1:] and len(a) >= 300 * CHARS_PER_TOKEN
    assert texts[1] in a


def test_first_token_times_a_one_token_answer_and_the_summary_compares_with_llama_cpp():
    bodies = []

    def reply(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [], "usage": {"prompt_tokens": 1077, "completion_tokens": 1}})

    with httpx.Client(base_url="http://peer", transport=httpx.MockTransport(reply)) as client:
        r = first_token(client, "m", "long", LLAMA_REQUEST)
    assert r["prompt_tokens"] == 1077 and r["ms"] >= 0
    assert bodies[0]["max_tokens"] == 1 and bodies[0]["repeat_penalty"] == 1.0 and "stream" not in bodies[0]
    times = {"llama.cpp Q8_0": [{"ms": 400.0, "prompt_tokens": 1077}, {"ms": 420.0, "prompt_tokens": 1077}],
             "edgespec default naive": [{"ms": 190.0, "prompt_tokens": 1077}, {"ms": 230.0, "prompt_tokens": 1078}]}
    out = summarise_long(times, "llama.cpp Q8_0")
    assert out["llama.cpp Q8_0"]["median_first_token_ms"] == 410.0
    assert out["edgespec default naive"] == {"median_first_token_ms": 210.0, "prompt_tokens": [1077, 1078],
                                             "ms": [190.0, 230.0], "ratio_to_llama_cpp": 0.512}


def test_the_png_has_the_long_prompts_panel(tmp_path):
    row = {"server": "llama.cpp", "format": "Q4_1", "policy": "llama.cpp", "median_decode_tokens_per_s": 90.0,
           "ratio_to_llama_cpp": 1.0, "roofline_tokens_per_s": 300.0, "fraction_of_roofline": 0.3}
    results = {"configurations": [row, {**row, "server": "edgespec", "format": "default", "policy": "naive",
                                        "median_decode_tokens_per_s": 110.0, "ratio_to_llama_cpp": 1.22}],
               "settings": {"prompts": 2, "max_tokens": 8}, "machine": {"cpu_model": "cpu"},
               "roofline": {"median_gb_per_s": 30.0},
               "long_prompt": {"servers": summarise_long(
                   {"llama.cpp Q4_1": [{"ms": 400.0, "prompt_tokens": 1073}],
                    "edgespec default naive": [{"ms": 180.0, "prompt_tokens": 1073}]}, "llama.cpp Q4_1")}}
    plot_versus(results, tmp_path / "one.png")
    del results["long_prompt"]
    plot_versus(results, tmp_path / "two.png")
    from PIL import Image

    assert Image.open(tmp_path / "one.png").width > Image.open(tmp_path / "two.png").width  # a second panel
