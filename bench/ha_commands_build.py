"""Renders homes through Home Assistant's own LLM API (release 2025.4.4, homeassistant/helpers/llm.py) and
writes each one's tools and system prompt into its data file under bench/prompts/, keeping the hand-written
commands already there (the dataset: each file's "commands" and "chitchat"):

- ha_commands.json: 34 entities in 10 areas and a voice satellite in the living room that can run timers (so
  the timer intents are offered, as to a Home Assistant Voice PE);
- ha_two_lights.json: issue 38's case, two exposed lights and only the `intent` integration set up (HassTurnOn,
  HassTurnOff, HassCancelAllTimers, GetLiveContext), no satellite.

Runs in a Python 3.13 virtual environment with `homeassistant==2025.4.4`, not in edgespec's:

    $(pyenv prefix 3.13.0)/bin/python -m venv /tmp/toolchoice/venv
    /tmp/toolchoice/venv/bin/pip install homeassistant==2025.4.4
    /tmp/toolchoice/venv/bin/python bench/ha_commands_build.py bench/prompts

What is Home Assistant's own: the Assist API's tools (`AssistAPI._async_get_tools`: the intents of the
integrations set up here whose platforms are exposed, less IGNORE_INTENTS, plus GetLiveContext), their
parameters as its Ollama integration sends them (`voluptuous_openapi.convert` with the API's
`custom_serializer`, `_format_tool`'s shape), and the system prompt as `ChatLog.async_update_llm_data` joins it
(BASE_PROMPT and DEFAULT_INSTRUCTIONS_PROMPT rendered by its template engine at a fixed time, then the API's
prompt with the exposed entities' YAML). What is written here: the homes below (entities, names, aliases,
areas, which integrations are set up, where the satellite is).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

from homeassistant import auth, bootstrap, config_entries, loader
from homeassistant.components.homeassistant.exposed_entities import async_expose_entity
from homeassistant.components.intent import async_register_timer_handler
from homeassistant.const import __version__ as HA_VERSION
from homeassistant.core import HomeAssistant
from homeassistant.helpers import area_registry as ar
from homeassistant.helpers import device_registry as dr
from homeassistant.helpers import entity_registry as er
from homeassistant.helpers import llm, template
from homeassistant.setup import async_setup_component
from voluptuous_openapi import convert

# (entity_id, name, area or None, aliases, state, attributes)
HOME = [
    ("light.ceiling_light", "Ceiling Light", "Living Room", [], "on", {}),
    ("light.floor_lamp", "Floor Lamp", "Living Room", ["Reading Lamp"], "off", {}),
    ("light.kitchen_light", "Kitchen Light", "Kitchen", [], "off", {}),
    ("light.pendant_lights", "Pendant Lights", "Kitchen", [], "off", {}),
    ("light.bedside_lamp", "Bedside Lamp", "Bedroom", [], "off", {}),
    ("light.desk_lamp", "Desk Lamp", "Office", [], "on", {}),
    ("light.hallway_light", "Hallway Light", "Hallway", [], "off", {}),
    ("light.porch_light", "Porch Light", "Front Yard", [], "off", {}),
    ("light.mirror_light", "Mirror Light", "Bathroom", [], "off", {}),
    ("light.night_light", "Night Light", "Kids Room", [], "off", {}),
    ("switch.coffee_maker", "Coffee Maker", "Kitchen", [], "off", {}),
    ("switch.christmas_tree", "Christmas Tree", "Living Room", [], "off", {}),
    ("switch.towel_warmer", "Towel Warmer", "Bathroom", [], "off", {}),
    ("fan.ceiling_fan", "Ceiling Fan", "Bedroom", [], "off", {}),
    ("fan.desk_fan", "Desk Fan", "Office", [], "off", {}),
    ("fan.air_purifier", "Air Purifier", "Kids Room", [], "on", {}),
    ("climate.thermostat", "Thermostat", "Hallway", ["Heating"], "heat", {"temperature": 20}),
    ("climate.bedroom_ac", "Bedroom Air Conditioner", "Bedroom", ["AC"], "off", {"temperature": 22}),
    ("media_player.living_room_tv", "TV", "Living Room", [], "playing", {}),
    ("media_player.kitchen_speaker", "Kitchen Speaker", "Kitchen", [], "playing", {}),
    ("media_player.office_speaker", "Office Speaker", "Office", [], "paused", {}),
    ("cover.garage_door", "Garage Door", "Garage", [], "closed", {"device_class": "garage"}),
    ("cover.blinds", "Blinds", "Living Room", [], "open", {"device_class": "blind"}),
    ("cover.curtains", "Curtains", "Bedroom", [], "closed", {"device_class": "curtain"}),
    ("lock.front_door", "Front Door", "Hallway", [], "locked", {}),
    ("lock.back_door", "Back Door", "Kitchen", [], "unlocked", {}),
    ("vacuum.robot_vacuum", "Robot Vacuum", "Living Room", ["Roomba"], "docked", {}),
    ("todo.shopping_list", "Shopping List", None, [], "3", {}),
    ("todo.chores", "Chores", None, [], "1", {}),
    ("sensor.outdoor_temperature", "Outdoor Temperature", "Front Yard", [], "12.5",
     {"device_class": "temperature", "unit_of_measurement": "°C"}),
    ("sensor.bathroom_humidity", "Bathroom Humidity", "Bathroom", [], "61",
     {"device_class": "humidity", "unit_of_measurement": "%"}),
    ("sensor.washing_machine", "Washing Machine", "Laundry Room", [], "running", {}),
    ("binary_sensor.garage_motion", "Garage Motion", "Garage", [], "off", {"device_class": "motion"}),
    ("scene.movie_night", "Movie Night", None, [], "unknown", {}),
]
TWO_LIGHTS = [
    ("light.kitchen_light", "Kitchen Light", "Kitchen", [], "off", {}),
    ("light.living_room_light", "Living Room Light", "Living Room", [], "off", {}),
]


@dataclass(frozen=True)
class Home:
    """Entities (entity_id, name, area or None, aliases, state, attributes); the integrations set up (each
    registers its intent handlers); the area of a voice satellite that runs timers, or None for none."""

    entities: list[tuple]
    integrations: list[str]
    satellite_area: str | None


HOMES = {
    "ha_commands.json": Home(HOME, ["homeassistant", "intent", "light", "switch", "fan", "climate", "media_player",
                                    "cover", "lock", "vacuum", "todo", "sensor", "binary_sensor", "scene"],
                             "Living Room"),
    "ha_two_lights.json": Home(TWO_LIGHTS, ["homeassistant", "intent"], None),
}
FIXED_NOW = dt.datetime(2025, 4, 26, 18, 30, 0, tzinfo=dt.UTC)  # BASE_PROMPT prints the time; the data is fixed


async def render(home: Home) -> tuple[str, list[dict], list[dict]]:
    """(system prompt, tools in the Ollama integration's shape, the home's entities as exposed)."""
    with tempfile.TemporaryDirectory() as config_dir:
        hass = HomeAssistant(config_dir)  # as bootstrap.async_from_config_dict sets one up
        loader.async_setup(hass)
        hass.config_entries = config_entries.ConfigEntries(hass, {})
        await bootstrap.async_load_base_functionality(hass)
        hass.auth = await auth.auth_manager_from_config(hass, [{"type": "homeassistant"}], [])
        await hass.async_start()
        # intent needs http (its views): on a free local port, so that nothing else is disturbed
        assert await async_setup_component(hass, "http", {"http": {"server_host": "127.0.0.1",
                                                                     "server_port": _free_port()}})
        await hass.config.async_set_time_zone("UTC")
        for domain in home.integrations:
            assert await async_setup_component(hass, domain, {}), domain
        areas, entities, devices = ar.async_get(hass), er.async_get(hass), dr.async_get(hass)
        by_name = {}
        for _, _, area, _, _, _ in home.entities:
            if area and area not in by_name:
                by_name[area] = areas.async_create(area)
        for entity_id, name, area, aliases, state, attributes in home.entities:
            domain, object_id = entity_id.split(".")
            entry = entities.async_get_or_create(domain, "bench", object_id, suggested_object_id=object_id)
            entities.async_update_entity(entry.entity_id, area_id=by_name[area].id if area else None,
                                         aliases=set(aliases))
            hass.states.async_set(entry.entity_id, state, {"friendly_name": name, **attributes})
            async_expose_entity(hass, "conversation", entry.entity_id, True)
        device_id = None
        if home.satellite_area:  # a voice satellite that runs timers (Home Assistant Voice PE does)
            config_entry = _config_entry(hass)
            satellite = devices.async_get_or_create(config_entry_id=config_entry.entry_id,
                                                    identifiers={("bench", "satellite")}, name="Satellite")
            devices.async_update_device(satellite.id, area_id=by_name[home.satellite_area].id)
            async_register_timer_handler(hass, satellite.id, lambda *_: None)
            device_id = satellite.id
        await hass.async_block_till_done()

        context = llm.LLMContext(platform="ollama", context=None, user_prompt=None, language="en",
                                 assistant="conversation", device_id=device_id)
        api = await llm.async_get_api(hass, llm.LLM_API_ASSIST, context)
        with patch("homeassistant.util.dt.now", return_value=FIXED_NOW):
            head = template.Template(llm.BASE_PROMPT + llm.DEFAULT_INSTRUCTIONS_PROMPT, hass).async_render(
                {"ha_name": hass.config.location_name, "user_name": None, "llm_context": context},
                parse_result=False)
        system = "\n".join([head, api.api_prompt])  # ChatLog.async_update_llm_data's join
        tools = [_format_tool(t, api.custom_serializer) for t in api.tools]
        exposed = llm._get_exposed_entities(hass, "conversation", include_state=False)  # what the YAML lists
        home = [{"entity_id": k, **v} for k, v in exposed["entities"].items()]
        await hass.async_stop(force=True)
    return system, tools, home


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_entry(hass: HomeAssistant):
    from homeassistant.config_entries import ConfigEntry, ConfigEntryState

    entry = ConfigEntry(data={}, discovery_keys={}, domain="bench", minor_version=1, options={}, source="user",
                        title="bench", unique_id=None, version=1, state=ConfigEntryState.LOADED,
                        subentries_data=None)
    hass.config_entries._entries[entry.entry_id] = entry
    return entry


def _format_tool(tool: llm.Tool, custom_serializer) -> dict:
    """homeassistant/components/ollama/conversation.py's _format_tool, as 2025.4.4 writes it."""
    spec = {"name": tool.name, "parameters": convert(tool.parameters, custom_serializer=custom_serializer)}
    if tool.description:
        spec["description"] = tool.description
    return {"type": "function", "function": spec}


def main() -> None:
    folder = Path(sys.argv[1])
    for name, home in HOMES.items():
        out = folder / name
        data = json.loads(out.read_text()) if out.exists() else {}
        system, tools, exposed = asyncio.run(render(home))
        rendered = {"about": data.get("about", ""),
                    "rendered_by": f"homeassistant=={HA_VERSION}, bench/ha_commands_build.py",
                    "system": system, "tools": tools, "home": exposed}
        out.write_text(json.dumps(rendered | {k: v for k, v in data.items() if k not in rendered}, indent=1,
                                  ensure_ascii=False) + "\n")
        print(f"{out}: {len(tools)} tools, {len(exposed)} entities, system prompt {len(system)} characters")


if __name__ == "__main__":
    main()
