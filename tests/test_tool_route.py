"""The text half of tool choice (server/home_context.py, server/tool_route.py), against Home Assistant's own
render: bench/prompts/ha_commands.json holds the system prompt and tools that Home Assistant 2025.4.4's LLM API
wrote for a home (bench/ha_commands_build.py), and the entities as its `_get_exposed_entities` listed them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.server.chat_input import ChatInput, Message, ToolSpec
from edgespec.server.home_context import Entity, admitted_domains, as_domains, grounded, listed_entities, mention
from edgespec.server.tool_route import ToolRouter

HA = json.loads((Path(__file__).resolve().parents[1] / "bench/prompts/ha_commands.json").read_text())
HA_TOOLS = tuple(ToolSpec(t["function"]["name"], t["function"].get("description", ""), t["function"]["parameters"])
                 for t in HA["tools"])
HOME = listed_entities([HA["system"]])


def split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",")) if value else ()


def test_the_entities_are_the_ones_home_assistant_exposed():
    assert [(e.names, e.domain, e.areas) for e in HOME] == [
        (split(e["names"]), e["domain"], split(e.get("areas"))) for e in HA["home"]]
    assert Entity(("Robot Vacuum", "Roomba"), "vacuum", ("Living Room",)) in HOME


def test_text_that_is_not_an_entity_list_is_passed_over():
    text = "Some rules:\n- be brief\n- be kind\n\n- names: Lamp\n  domain: light\n\n- {broken: [yaml\n"
    assert listed_entities([text]) == (Entity(("Lamp",), "light"),)


def test_a_tool_admits_the_domains_its_schema_enumerates():
    admitted = {t.name: admitted_domains(t) for t in HA_TOOLS}
    assert admitted["HassMediaPause"] == {"media_player"} and admitted["HassVacuumStart"] == {"vacuum"}
    # HassTurnOn's domain is an open array of strings, HassClimateSetTemperature has none: any domain
    assert admitted["HassTurnOn"] is None and admitted["HassClimateSetTemperature"] is None
    assert admitted["GetLiveContext"] is None


@pytest.mark.parametrize(("request_text", "entities", "areas", "domains"), [
    ("Have the Roomba clean the house.", ["Robot Vacuum"], [], ["vacuum"]),  # an alias
    ("Continue playing on the kitchen speaker.", ["Kitchen Speaker"], [], ["media_player"]),  # not the area
    ("Pause the music in the kitchen.", [], ["Kitchen"], []),  # an area alone says no domain
    ("Send the vacuum back to its dock.", [], [], ["vacuum"]),  # a domain by its own word
    ("Set a timer for 10 minutes.", [], [], []),
])
def test_what_a_request_names(request_text, entities, areas, domains):
    named = mention(request_text, HOME)
    assert ([e.names[0] for e in named.entities], list(named.areas), list(named.domains)) == (entities, areas,
                                                                                              domains)


def test_named_entities_are_written_as_their_domains():
    assert as_domains("Pause the TV.", mention("Pause the TV.", HOME)) == "Pause the media player."
    assert as_domains("Could you set the heating to 22?", mention("Could you set the heating to 22?", HOME)) == \
        "Could you set the climate to 22?"


def plan(tools, system: str, request: str):
    chat = ChatInput((Message("system", system), Message("user", request)), tuple(tools), "required")
    return ToolRouter().plan(chat, request, mention(request, listed_entities([system])))


def test_tools_whose_schema_leaves_out_the_named_domain_are_no_candidates():
    route = plan(HA_TOOLS, HA["system"], "Start the coffee maker.")  # a switch
    left = {"HassVacuumStart", "HassVacuumReturnToBase", "HassMediaPause", "HassMediaUnpause", "HassMediaNext",
            "HassMediaPrevious", "HassSetVolume"}
    assert set(route.figures["left_out"]) == left
    assert [HA_TOOLS[i].name for i in route.candidates] == [t.name for t in HA_TOOLS if t.name not in left]
    assert len(route.overlap) == len(route.candidates)
    # nothing named, or an area alone: every tool stays
    assert plan(HA_TOOLS, HA["system"], "Pause the music in the kitchen.").figures["left_out"] == []


def test_the_prompts_sentences_about_a_tool_are_its_note():
    notes = dict(zip([t.name for t in HA_TOOLS], plan(HA_TOOLS, HA["system"], "Lock the front door.").notes,
                     strict=True))
    assert notes["HassTurnOn"] == notes["HassTurnOff"] == "Use HassTurnOn to lock and HassTurnOff to unlock a lock."
    assert "You MUST call `GetLiveContext`." in notes["GetLiveContext"]
    assert notes["HassLightSet"] == ""


def test_a_rare_shared_word_outweighs_a_common_one():
    tools = [ToolSpec("Alpha", "Sets the volume of a player"), ToolSpec("Beta", "Sets the brightness of a light"),
             ToolSpec("Gamma", "Sets the mode of a fan")]
    route = plan(tools, "You control a home.", "Set the volume to 20")
    overlap = dict(zip(["Alpha", "Beta", "Gamma"], route.overlap, strict=True))
    # "set" and "the" are every tool's: they weigh alike; "volume" is Alpha's alone
    assert 0 < overlap["Beta"] == overlap["Gamma"] < overlap["Alpha"]
    assert route.request == "Set the volume to 20"
    # words that every tool and every sentence of the prompt hold weigh nothing
    assert plan(tools, "Set the scene.", "Set the volume to 20").overlap == pytest.approx(
        [overlap["Alpha"] - overlap["Beta"], 0, 0])


def test_a_tool_acting_on_the_home_is_grounded_in_its_listed_entities():
    home = (Entity(("Kitchen Light",), "light", ("Kitchen",)), Entity(("TV", "Telly"), "media_player", ("Lounge",)),
            Entity(("Lounge Lamp",), "light", ("Lounge",)))
    # Home Assistant's Ollama integration sends HassTurnOn's arrays without their items
    ollama = ToolSpec("HassTurnOn", "Turns on/opens a device or entity", {
        "type": "object", "required": [],
        "properties": {"name": {"type": "string"}, "area": {"type": "string"}, "floor": {"type": "string"},
                       "domain": {"type": "array"}, "device_class": {"type": "array"}}})

    def props(tool, request):
        return grounded(tool, home, mention(request, home)).parameters["properties"]

    # nothing named: every listed entity; the array without items left out
    assert props(ollama, "Turn everything on") == {
        "name": {"type": "string", "enum": ["Kitchen Light", "Lounge Lamp", "TV", "Telly"]},
        "area": {"type": "string", "enum": ["Kitchen", "Lounge"]}, "floor": {"type": "string"},
        "domain": {"type": "array", "items": {"type": "string", "enum": ["light", "media_player"]}}}
    # an entity named: it alone, its area and domain
    named = props(ollama, "Turn on the kitchen light")
    assert [named[k].get("enum") or named[k]["items"]["enum"] for k in ("name", "area", "domain")] == [
        ["Kitchen Light"], ["Kitchen"], ["light"]]
    # an area named: the entities there, that area
    area = props(ollama, "Switch on the lounge")
    assert (area["name"]["enum"], area["area"]["enum"]) == (["Lounge Lamp", "TV", "Telly"], ["Lounge"])
    # the tool's own domain enum keeps the entities it admits; item enums (the OpenAI integration's) stay
    pause = next(t for t in HA_TOOLS if t.name == "HassMediaPause")
    media = props(pause, "Pause it")
    assert media["name"]["enum"] == ["TV", "Telly"] and media["domain"]["items"]["enum"] == ["media_player"]
    # another optional enum (device_class, the OpenAI integration's): only the values the request names, left
    # out where it names none (a call otherwise filled it with the enum's first values, whatever they were)
    assert "device_class" not in media
    turn_on = next(t for t in HA_TOOLS if t.name == "HassTurnOn")
    assert "device_class" not in props(turn_on, "Turn on the kitchen light")
    assert props(turn_on, "Open the garage door")["device_class"] == {
        "type": "array", "items": {"type": "string", "enum": ["door", "garage"]}}


def test_tools_that_do_not_act_on_entities_and_homes_listing_none_stay_as_sent():
    nothing = mention("Start a timer", HOME)
    timer = next(t for t in HA_TOOLS if t.name == "HassStartTimer")  # its `name` is the timer's: no `domain`
    assert grounded(timer, HOME, nothing) is timer
    turn_on = next(t for t in HA_TOOLS if t.name == "HassTurnOn")
    assert grounded(turn_on, (), nothing) is turn_on
