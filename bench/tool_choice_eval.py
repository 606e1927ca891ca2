"""Tool choice on Home Assistant's request shapes, measured through the HTTP API of one running server, greedy
(issue 38, deliverable 4):

- ha_commands.json: 63 spoken commands over Home Assistant 2025.4.4's real intents, its own tools and system
  prompt (bench/ha_commands_build.py), split into a tuning half and a checking half by SPLIT_RULE (fixed
  before anything was tuned; `--write-split` writes it into the file, and every run checks the file agrees);
- ha_heldout.json: 8 held-out commands in the shape issue 38's measurer used (no one tunes on them);
- ha_two_lights.json: issue 38's real Home Assistant turn (two lights; HassTurnOn, HassTurnOff,
  HassCancelAllTimers, GetLiveContext);
- home_assistant.json: issue 19's set, which the old router was tuned on.

Per set: `tool_choice: required` (every answer a valid call of a listed tool? the intended tool first? the
intended name/area arguments, a secondary figure), `auto` (commands that call a tool, chit-chat answered in
text), and the times: the decision's (`decoding.tool_choice.decide_ms`, where the server reports it), the
time to first token after it (`decoding.ttft_ms`, which starts once the decision is made), the whole
answer's as the client saw it (`wall_ms`), and that less the generation's own time (`outside_generation_ms`:
the decision, the prompt's rendering and grammars, HTTP; the one figure the server before issue 38, which did
not time its decision, also gives).

    python -m bench.tool_choice_eval --url http://127.0.0.1:8000 --label before \
        --out bench/results/issue38-tool-choice [--sets tune,check]

Writes DIR/LABEL.json, and DIR/tool_choice.png over every LABEL.json in DIR. Measure alone: timings move with
other processes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib import resources
from pathlib import Path

import httpx
import jsonschema

from edgespec.bench.plot import bar_chart

SETS = {"tune": "ha_commands.json", "check": "ha_commands.json", "heldout": "ha_heldout.json",
        "two_lights": "ha_two_lights.json", "issue19": "home_assistant.json"}
SPLIT_SEED = 38
SPLIT_RULE = ("stratified by tool: the commands ordered by (intended tool, a draw of random.Random(38) in file "
              "order), then alternately tune, check, tune, ... down that order")


def load(name: str) -> dict:
    return json.loads(resources.files("edgespec.bench").joinpath(f"prompts/{name}").read_text())


def split(commands: list[dict]) -> list[str]:
    """SPLIT_RULE: each command's half, 'tune' or 'check'. Every tool's commands fall half and half (an odd one
    out where the order reaches it), and tools with one command alternate between the halves."""
    rng = random.Random(SPLIT_SEED)
    draws = [rng.random() for _ in commands]
    order = sorted(range(len(commands)), key=lambda i: (commands[i]["tool"], draws[i]))
    halves = [""] * len(commands)
    for rank, i in enumerate(order):
        halves[i] = "tune" if rank % 2 == 0 else "check"
    return halves


def cases(name: str) -> tuple[dict, list[dict]]:
    """A set's data file and its commands (the tuning or the checking half of ha_commands.json)."""
    data = load(SETS[name])
    commands = data["commands"]
    if SETS[name] == "ha_commands.json":
        if [c.get("split") for c in commands] != split(commands):
            raise SystemExit("ha_commands.json's split is not SPLIT_RULE's: run with --write-split before tuning")
        commands = [c for c in commands if c["split"] == name]
    return data, commands


def ask(client: httpx.Client, model: str, data: dict, prompt: str, policy: str, max_tokens: int, **extra) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "decoding": policy, "tools": data["tools"],
            "messages": [{"role": "system", "content": data["system"]}, {"role": "user", "content": prompt}]}
    began = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body | extra)
    r.raise_for_status()
    return r.json() | {"wall_ms": round(1000 * (time.perf_counter() - began), 1)}


def generation_ms(answer: dict) -> float | None:
    """The generation's own time as the server reports it: its time to first token and its decode."""
    stats, tokens = answer["decoding"], answer["usage"]["completion_tokens"]
    if not stats.get("decode_tokens_per_s"):
        return None
    return round(stats["ttft_ms"] + 1000 * max(tokens - 1, 0) / stats["decode_tokens_per_s"], 1)


def calls_of(answer: dict, data: dict) -> tuple[list[dict], bool]:
    """The answer's calls as {name, arguments} and whether every one is a listed tool whose arguments validate."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in data["tools"]}
    calls, valid = [], True
    for c in answer["choices"][0]["message"].get("tool_calls") or []:
        name, args = c["function"]["name"], c["function"]["arguments"]
        try:
            parsed = json.loads(args)
            jsonschema.validate(parsed, schemas[name])
        except (KeyError, ValueError, jsonschema.ValidationError):
            parsed, valid = args, False
        calls.append({"name": name, "arguments": parsed})
    return calls, valid and bool(calls)


def arguments_match(call: dict, intended: dict, data: dict) -> bool:
    """The call's name/area arguments are the intended ones (case aside; a name may be any of the entity's
    names, an area any of its names)."""
    args = call["arguments"] if isinstance(call["arguments"], dict) else {}
    for key, want in intended.items():
        got = str(args.get(key, "")).strip().lower()
        same = {want.lower()}
        for entity in data.get("home", []):
            for field in ("names", "areas"):
                names = [n.strip().lower() for n in str(entity.get(field, "")).split(",")]
                if want.lower() in names:
                    same |= set(names)
        if got not in same:
            return False
    return True


def run_set(client, model: str, name: str, policy: str, max_tokens: int) -> dict:
    data, commands = cases(name)
    required, auto = [], []
    for cmd in commands:
        answer = ask(client, model, data, cmd["prompt"], policy, max_tokens, tool_choice="required")
        calls, valid = calls_of(answer, data)
        choice = answer["decoding"].get("tool_choice") or {}
        first = calls[0] if calls else None
        required.append({"prompt": cmd["prompt"], "intended": cmd["tool"], "intended_args": cmd.get("args", {}),
                         "calls": calls, "valid": valid, "finish_reason": answer["choices"][0]["finish_reason"],
                         "intended_first": first is not None and first["name"] == cmd["tool"],
                         "args_match": first is not None and first["name"] == cmd["tool"]
                         and arguments_match(first, cmd.get("args", {}), data),
                         "tool_choice": choice, "decide_ms": choice.get("decide_ms"),
                         "ttft_ms": answer["decoding"]["ttft_ms"], "wall_ms": answer["wall_ms"],
                         "outside_generation_ms": _less(answer["wall_ms"], generation_ms(answer)),
                         "completion_tokens": answer["usage"]["completion_tokens"],
                         "prompt_tokens": answer["usage"]["prompt_tokens"]})
    chitchat = data.get("chitchat", []) if name != "check" else []  # the tuning half's row holds ha_commands'
    for prompt, intended in [(c["prompt"], c["tool"]) for c in commands] + [(p, None) for p in chitchat]:
        answer = ask(client, model, data, prompt, policy, max_tokens, tool_choice="auto")
        calls, valid = calls_of(answer, data)
        choice = answer["decoding"].get("tool_choice") or {}
        auto.append({"prompt": prompt, "intended": intended, "calls": calls, "valid": valid,
                     "text": answer["choices"][0]["message"]["content"], "tool_choice": choice,
                     "decide_ms": choice.get("decide_ms"), "ttft_ms": answer["decoding"]["ttft_ms"],
                     "wall_ms": answer["wall_ms"]})
    on_commands = [r for r in auto if r["intended"] is not None]
    on_chitchat = [r for r in auto if r["intended"] is None]
    return {
        "file": SETS[name], "commands": len(required),
        "required": {"valid": sum(r["valid"] for r in required), "intended": sum(r["intended_first"] for r in required),
                     "args_match": sum(r["args_match"] for r in required), "of": len(required),
                     "median_ttft_ms": _median([r["ttft_ms"] for r in required]),
                     "median_decide_ms": _median([r["decide_ms"] for r in required]),
                     "median_wall_ms": _median([r["wall_ms"] for r in required]),
                     "median_outside_generation_ms": _median([r["outside_generation_ms"] for r in required]),
                     "rows": required},
        "auto": {"commands_calling": sum(r["valid"] for r in on_commands),
                 "commands_calling_intended": sum(r["valid"] and r["calls"][0]["name"] == r["intended"]
                                                  for r in on_commands),
                 "commands": len(on_commands),
                 "chitchat_text": sum(not r["calls"] and bool((r["text"] or "").strip()) for r in on_chitchat),
                 "chitchat": len(on_chitchat),
                 "median_ttft_ms": _median([r["ttft_ms"] for r in auto]),
                 "median_wall_ms": _median([r["wall_ms"] for r in auto]), "rows": auto},
    }


def _less(a: float, b: float | None) -> float | None:
    return None if b is None else round(a - b, 1)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def summary(results: dict) -> dict:
    """Per set: required intended/valid/args of n, auto commands calling and chit-chat in text."""
    out = {}
    for name, r in results["sets"].items():
        req, auto = r["required"], r["auto"]
        out[name] = (f"required: intended {req['intended']}/{req['of']}, valid {req['valid']}/{req['of']}, "
                     f"args {req['args_match']}/{req['of']}; auto: {auto['commands_calling']}/{auto['commands']} "
                     f"commands call ({auto['commands_calling_intended']} the intended tool), "
                     f"{auto['chitchat_text']}/{auto['chitchat']} chit-chat in text; required's median: decision "
                     f"{req['median_decide_ms']} ms, whole answer {req['median_wall_ms']} ms of which "
                     f"{req['median_outside_generation_ms']} ms outside the generation")
    return out


def plot(out: Path) -> None:
    """The intended tool's share under `required`, per set, for every run (LABEL.json) in `out`."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    panels = []
    for name in SETS:
        labels = [label for label, r in runs.items() if name in r["sets"]]
        if labels:
            panels.append((f"{name}: intended tool (share)", labels,
                           [runs[lb]["sets"][name]["required"]["intended"] / runs[lb]["sets"][name]["required"]["of"]
                            for lb in labels]))
    if panels:
        model = next(iter(runs.values()))["settings"]["model"]
        bar_chart(out / "tool_choice.png", f"{model}: tool_choice required, greedy", panels)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--out", default="bench/results/issue38-tool-choice")
    ap.add_argument("--label", default="run", help="the results file's name: before, after, ...")
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    ap.add_argument("--policy", default="naive", help="decoding policy of every request")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--write-split", action="store_true", help="write SPLIT_RULE's halves into ha_commands.json")
    args = ap.parse_args(argv)
    if args.write_split:
        path = Path(str(resources.files("edgespec.bench").joinpath("prompts/ha_commands.json")))
        data = json.loads(path.read_text())
        for command, half in zip(data["commands"], split(data["commands"]), strict=True):
            command["split"] = half
        data["split_rule"] = SPLIT_RULE
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print({h: sum(c["split"] == h for c in data["commands"]) for h in ("tune", "check")})
        return
    if not args.url:
        ap.error("--url is required to measure")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=args.url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        sets = {name: run_set(client, model, name, args.policy, args.max_tokens) for name in args.sets.split(",")}
    results = {"settings": {"url": args.url, "model": model, "policy": args.policy, "max_tokens": args.max_tokens,
                            "split_rule": SPLIT_RULE}, "sets": sets}
    results["summary"] = summary(results)
    (out / f"{args.label}.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    plot(out)
    print(json.dumps(results["summary"], indent=1))


if __name__ == "__main__":
    main()
