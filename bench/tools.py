"""Tools and structured output against one running server, on Home Assistant's request shapes
(bench/prompts/home_assistant.json): the issue-19 bars, measured through the HTTP API, greedy.

- required: each of the 8 device commands must come back as valid calls of listed tools (arguments validate
  against the tool's schema); how many open with the intended tool.
- auto: how many device commands call a tool, how many chit-chat prompts answer in text.
- json_schema: how many of the structured prompts' outputs parse and validate.
- under load: the required commands sent 4 at once give the calls they give alone.
- grammar cost: each json_schema and required answer's tokens replayed through its grammar here (the mask
  and the advance the sampler does per token), per token, against the same answers' decode time per token
  in the server (run it with --policy naive, one token per step).

    python -m bench.tools --url http://127.0.0.1:8000 --out bench/results/issue19-tools [--reference OTHER.json]

--reference: a tools.json from another setup (say in-process) whose calls this run's must equal (say over
workers). Writes DIR/tools.json and DIR/tools.png. Measure alone: other processes change the timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import httpx
import jsonschema
import torch

from edgespec.bench.plot import bar_chart


def load_data() -> dict:
    return json.loads(resources.files("edgespec.bench").joinpath("prompts/home_assistant.json").read_text())


def ask(client: httpx.Client, model: str, data: dict, prompt: str, policy: str, max_tokens: int, **extra) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "decoding": policy,
            "messages": [{"role": "system", "content": data["system"]}, {"role": "user", "content": prompt}]}
    r = client.post("/v1/chat/completions", json=body | extra)
    r.raise_for_status()
    return r.json()


def calls_of(answer: dict, data: dict) -> tuple[list[dict], bool]:
    """The answer's calls as {name, arguments} and whether every one is a listed tool with valid arguments."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in data["tools"]}
    calls, valid = [], True
    for c in answer["choices"][0]["message"].get("tool_calls") or []:
        name, args = c["function"]["name"], c["function"]["arguments"]
        calls.append({"name": name, "arguments": args})
        try:
            jsonschema.validate(json.loads(args), schemas[name])
        except (KeyError, ValueError, jsonschema.ValidationError):
            valid = False
    return calls, valid and bool(calls)


def run_required(client, model, data, policy, max_tokens) -> dict:
    rows = []
    for cmd in data["commands"]:
        answer = ask(client, model, data, cmd["prompt"], policy, max_tokens, tools=data["tools"],
                     tool_choice="required")
        calls, valid = calls_of(answer, data)
        rows.append({"prompt": cmd["prompt"], "intended": cmd["tool"], "calls": calls, "valid": valid,
                     "finish_reason": answer["choices"][0]["finish_reason"],
                     "intended_first": bool(calls) and calls[0]["name"] == cmd["tool"],
                     "tool_choice": answer["decoding"].get("tool_choice"), "ttft_ms": answer["decoding"]["ttft_ms"],
                     "decode_tokens_per_s": answer["decoding"]["decode_tokens_per_s"],
                     "completion_tokens": answer["usage"]["completion_tokens"]})
    return {"valid": sum(r["valid"] for r in rows), "intended": sum(r["intended_first"] for r in rows),
            "of": len(rows), "rows": rows}


def run_auto(client, model, data, policy, max_tokens) -> dict:
    def one(prompt: str) -> dict:
        answer = ask(client, model, data, prompt, policy, max_tokens, tools=data["tools"], tool_choice="auto")
        calls, valid = calls_of(answer, data)
        message = answer["choices"][0]["message"]
        return {"prompt": prompt, "calls": calls, "valid": valid, "text": message["content"],
                "tool_choice": answer["decoding"].get("tool_choice")}

    commands = [one(c["prompt"]) | {"intended": c["tool"]} for c in data["commands"]]
    chitchat = [one(p) for p in data["chitchat"]]
    return {"commands_calling": sum(r["valid"] for r in commands), "commands": len(commands),
            "chitchat_text": sum(not r["calls"] and bool((r["text"] or "").strip()) for r in chitchat),
            "chitchat": len(chitchat), "rows": commands + chitchat}


def run_structured(client, model, data, policy, max_tokens) -> dict:
    schema = data["structured"]["schema"]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    rows = []
    for prompt in data["structured"]["prompts"]:
        answer = ask(client, model, data, prompt, policy, max_tokens, response_format=fmt)
        content = answer["choices"][0]["message"]["content"]
        try:
            jsonschema.validate(json.loads(content), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        rows.append({"prompt": prompt, "content": content, "valid": valid,
                     "finish_reason": answer["choices"][0]["finish_reason"],
                     "decode_tokens_per_s": answer["decoding"]["decode_tokens_per_s"],
                     "tokens_per_step": answer["decoding"]["tokens_per_step"]})
    return {"valid": sum(r["valid"] for r in rows), "of": len(rows), "format": fmt, "rows": rows}


def run_concurrent(url, model, data, policy, max_tokens, alone: dict) -> dict:
    """The required commands 4 at once: each answer's calls against its calls alone."""
    def one(cmd: dict) -> list[dict]:
        with httpx.Client(base_url=url, timeout=600) as client:
            answer = ask(client, model, data, cmd["prompt"], policy, max_tokens, tools=data["tools"],
                         tool_choice="required")
        return calls_of(answer, data)[0]

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, data["commands"]))
    same = [t == r["calls"] for t, r in zip(together, alone["rows"], strict=True)]
    return {"streams": 4, "same_calls_as_alone": sum(same), "of": len(same)}


def grammar_cost(data: dict, required: dict, structured_run: dict) -> dict:
    """Per token, here: the mask and the advance of each answer's own grammar over the answer's tokens, as the
    sampler does them (decoding/grammar.py), against the server's decode time per token for those answers."""
    from edgespec.decoding.grammar import Grammars
    from edgespec.model.load import load_tokenizer
    from edgespec.model.source import resolve_model
    from edgespec.server import structured
    from edgespec.server.chat_input import ChatInput, Message, ResponseFormat, ToolSpec
    from edgespec.server.tool_prompt import SMOLLM2

    tokenizer = load_tokenizer(resolve_model(None))
    grammars = Grammars(tokenizer, len(tokenizer))
    tools = tuple(ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                  for t in data["tools"])
    schema = structured_run["format"]["json_schema"]["schema"]
    json_plan = structured.plan(ChatInput((Message("user", "q"),), response_format=ResponseFormat(
        "json_schema", schema)), SMOLLM2)
    call_plan = structured.plan(ChatInput((Message("user", "q"),), tools, "required"), SMOLLM2)
    cases = [(json_plan.grammar, r["content"]) for r in structured_run["rows"] if r["valid"]]
    cases += [(call_plan.grammar, "<tool_call>" + json.dumps(r["calls_json"], separators=(",", ":"))
               + "</tool_call>") for r in required["rows"] if r["valid"]]
    logits = torch.randn(grammars.vocab_size)  # [V]: the mask's cost does not depend on the values
    per_token = []
    for lark, text in cases:
        constraint = grammars.compile(lark).constraint()
        for token in [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]:
            began = time.perf_counter()
            constraint.mask(logits)
            constraint.consume(token)
            per_token.append(time.perf_counter() - began)
    step_ms = [1000 / r["decode_tokens_per_s"] for r in structured_run["rows"] + required["rows"]
               if r.get("decode_tokens_per_s")]
    mask_ms = statistics.median(per_token) * 1000
    return {"tokens": len(per_token), "median_grammar_ms_per_token": round(mask_ms, 4),
            "p90_grammar_ms_per_token": round(sorted(per_token)[int(0.9 * len(per_token))] * 1000, 4),
            "median_decode_ms_per_token": round(statistics.median(step_ms), 3),
            "grammar_share_of_step": round(mask_ms / statistics.median(step_ms), 4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", default="naive", help="decoding policy of every request (naive: a step is a token)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reference", help="tools.json of another setup whose calls this run's must equal")
    args = ap.parse_args(argv)
    data = load_data()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=args.url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        required = run_required(client, model, data, args.policy, args.max_tokens)
        auto = run_auto(client, model, data, args.policy, args.max_tokens)
        structured_run = run_structured(client, model, data, args.policy, 256)
    concurrent = run_concurrent(args.url, model, data, args.policy, args.max_tokens, required)
    for r in required["rows"]:
        r["calls_json"] = [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in r["calls"]]
    cost = grammar_cost(data, required, structured_run)
    results = {"settings": {"url": args.url, "model": model, "policy": args.policy, "max_tokens": args.max_tokens},
               "required": required, "auto": auto, "json_schema": structured_run, "concurrent": concurrent,
               "grammar_cost": cost}
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())
        same = [a["calls"] == b["calls"] for a, b in zip(required["rows"], ref["required"]["rows"], strict=True)]
        results["same_calls_as_reference"] = {"reference": args.reference, "same": sum(same), "of": len(same)}
    (out / "tools.json").write_text(json.dumps(results, indent=2))
    bar_chart(out / "tools.png", f"{model}: Home Assistant tools and structured output, greedy", [
        ("answers (of 8)", ["required\nvalid", "required\nintended", "auto: commands\ncalling"],
         [required["valid"], required["intended"], auto["commands_calling"]]),
        ("answers", ["auto: chit-chat\nin text (of 4)", "json_schema\nvalid (of 8)"],
         [auto["chitchat_text"], structured_run["valid"]]),
        ("% of a decode step", ["grammar\nper token"], [100 * cost["grammar_share_of_step"]]),
    ])
    print(json.dumps({"required": f"{required['valid']}/8 valid, {required['intended']}/8 intended",
                      "auto": f"{auto['commands_calling']}/8 commands call, {auto['chitchat_text']}/4 chit-chat text",
                      "json_schema": f"{structured_run['valid']}/{structured_run['of']} valid",
                      "concurrent": f"{concurrent['same_calls_as_alone']}/{concurrent['of']} same as alone",
                      "grammar_cost": cost, **({"reference": results["same_calls_as_reference"]}
                                               if args.reference else {})}, indent=1))


if __name__ == "__main__":
    main()
