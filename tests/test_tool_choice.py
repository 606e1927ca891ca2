"""Tool choice's mechanism through the chat API, in-process on the tiny model (random weights: which tool it
likes is noise, so what decides here is what the request's text and the tools' schemas say): the named entity's
domain leaves out the tools whose schema does not admit it, `required` always answers a valid call of a listed
tool that opens with the route's choice, and the same request is decided the same way. How often the choice is
the intended one is measured on the real model by bench/tool_choice_eval.py."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from inprocess import LoopClient, controller_app
from model_fixtures import smollm2_folder
from processes import tiny_chat_model

HA = json.loads((Path(__file__).resolve().parents[1] / "bench/prompts/ha_commands.json").read_text())
HA_PROPERTIES = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in HA["tools"]}
MODEL = "tiny"
HOME = ("Static Context: An overview of the areas and the devices in this smart home:\n"
        "- names: Soundbar\n  domain: media_player\n  areas: Lounge\n"
        "- names: Roomba, Robot\n  domain: vacuum\n  areas: Hall\n")


def stopper(name: str, domain: str) -> dict:
    """A tool that only its schema's domain enum tells apart from the other stopper."""
    return {"type": "function", "function": {"name": name, "description": "Stops a device", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "domain": {"type": "array", "items": {"type": "string", "enum": [domain]}}}}}}


STOPPERS = [stopper("ToolA", "media_player"), stopper("ToolB", "vacuum")]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # Home Assistant's prompt and 23 tools take about 2,500 tokens: more than the session's tiny model holds
    tiny = tiny_chat_model(tmp_path_factory.mktemp("tiny-4k"), smollm2_folder(), max_position_embeddings=4096)
    app, service = controller_app(str(tiny), served_model_name=MODEL)
    client = LoopClient(app)
    yield client
    client.close()
    service.engine.close()


def chat(client, system: str, prompt: str, tools: list[dict], **kw) -> dict:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 160, "tools": tools,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}]} | kw
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def calls(answer: dict, tools: list[dict]) -> list[str]:
    """The answer's calls' names, each a listed tool whose arguments validate against the client's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for call in answer["choices"][0]["message"]["tool_calls"] or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        out.append(call["function"]["name"])
    return out


@pytest.mark.parametrize(("prompt", "tool", "left_out"), [
    ("Stop the Roomba.", "ToolB", "ToolA"),
    ("Please stop the robot in the hall.", "ToolB", "ToolA"),  # an alias
    ("Stop the soundbar.", "ToolA", "ToolB"),
])
def test_the_named_entitys_domain_chooses_between_tools_alike(client, prompt, tool, left_out):
    answer = chat(client, HOME, prompt, STOPPERS, tool_choice="required")
    route = answer["decoding"]["tool_choice"]["route"]
    assert route["left_out"] == [left_out] and route["chose"] == tool
    assert calls(answer, STOPPERS)[0] == tool


def test_without_a_named_domain_both_stay(client):
    route = chat(client, HOME, "Stop everything in the lounge.", STOPPERS,
                 tool_choice="required")["decoding"]["tool_choice"]["route"]
    assert route["left_out"] == [] and set(route["scores"]) == {"ToolA", "ToolB"}
    assert route["named"] == {"entities": [], "areas": ["Lounge"], "domains": []}


@pytest.mark.parametrize("prompt", [c["prompt"] for c in HA["commands"][::16]])
def test_required_answers_a_valid_call_that_opens_with_the_choice(client, prompt):
    answer = chat(client, HA["system"], prompt, HA["tools"], tool_choice="required")
    choice = answer["decoding"]["tool_choice"]
    names = calls(answer, HA["tools"])
    assert answer["choices"][0]["finish_reason"] == "tool_calls" and names
    scores = choice["route"]["scores"]
    assert names[0] == choice["route"]["chose"] == max(scores, key=scores.get)
    # the tools that act on entities are grounded in the listed home, whatever the random model would write
    for call in answer["choices"][0]["message"]["tool_calls"]:
        args = json.loads(call["function"]["arguments"])
        assert set(args.get("domain", [])) <= {e["domain"] for e in HA["home"]}
        if "domain" in HA_PROPERTIES[call["function"]["name"]]:
            assert args.get("name", "Kitchen Light") in {n.strip() for e in HA["home"] for n in e["names"].split(",")}
    assert choice["decide_ms"] >= 0


def test_the_same_request_is_decided_the_same_way(client):
    first, again = (chat(client, HA["system"], "Pause the TV.", HA["tools"], tool_choice="required")
                    for _ in range(2))
    assert first["decoding"]["tool_choice"]["route"] == again["decoding"]["tool_choice"]["route"]
    assert first["choices"][0]["message"]["tool_calls"][0]["function"] == \
        again["choices"][0]["message"]["tool_calls"][0]["function"]
