"""Home Assistant's own Ollama integration (ollama, 2025.4.4, with the ollama client 0.4.7 it pins) against a real
edgespec's Ollama API.

The entry is made as a user makes it in the UI: the config flow with edgespec's URL (the integration lists the
models with client.list() and offers the downloaded ones first), the served model chosen, then the options flow
turning on the Assist API. Each turn is `client.chat(model, messages, tools, stream=True, keep_alive, options=
{"num_ctx": ...})`; the integration sets no temperature, so the server's defaults for the Ollama API apply
(`serve --ollama-options`, conftest.OLLAMA: greedy).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from edgespec_proc import Edgespec
from home import KITCHEN_LIGHT, LIVING_ROOM_LAMP, build_home, recorded_turn
from homeassistant.components.ollama.const import (
    CONF_KEEP_ALIVE,
    CONF_MAX_HISTORY,
    CONF_MODEL,
    CONF_NUM_CTX,
    CONF_PROMPT,
    DEFAULT_KEEP_ALIVE,
    DEFAULT_MAX_HISTORY,
    DEFAULT_NUM_CTX,
    DOMAIN,
)
from homeassistant.config_entries import ConfigEntryState
from homeassistant.const import CONF_LLM_HASS_API, CONF_URL
from homeassistant.core import HomeAssistant
from homeassistant.data_entry_flow import FlowResultType
from homeassistant.helpers import llm

pytestmark = pytest.mark.usefixtures("socket_enabled", "fixed_clock")


def offered_models(form: dict) -> dict[str, str]:
    """The model step's choices, label to value, as the form shows them."""
    selector = next(v for k, v in form["data_schema"].schema.items() if k == CONF_MODEL)
    return {o["label"]: o["value"] for o in selector.config["options"]}


async def ollama_agent(hass: HomeAssistant, server: Edgespec) -> str:
    """The integration set up through its config flow (edgespec's URL, the downloaded model) and options flow
    (the Assist API); its agent id."""
    flow = await hass.config_entries.flow.async_init(DOMAIN, context={"source": "user"})
    assert flow["type"] is FlowResultType.FORM and flow["step_id"] == "user", flow
    models = await hass.config_entries.flow.async_configure(flow["flow_id"], {CONF_URL: server.url})
    assert models["type"] is FlowResultType.FORM and not models.get("errors"), models
    downloaded = [value for label, value in offered_models(models).items() if label.endswith("(downloaded)")]
    assert len(downloaded) == 1, offered_models(models)  # the one model edgespec serves, listed by /api/tags
    made = await hass.config_entries.flow.async_configure(flow["flow_id"], {CONF_MODEL: downloaded[0]})
    assert made["type"] is FlowResultType.CREATE_ENTRY, made  # listed: no download step
    entry = made["result"]
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED
    options = await hass.config_entries.options.async_init(entry.entry_id)
    options = await hass.config_entries.options.async_configure(options["flow_id"], {
        CONF_PROMPT: llm.DEFAULT_INSTRUCTIONS_PROMPT, CONF_LLM_HASS_API: llm.LLM_API_ASSIST,
        CONF_NUM_CTX: DEFAULT_NUM_CTX, CONF_MAX_HISTORY: DEFAULT_MAX_HISTORY, CONF_KEEP_ALIVE: DEFAULT_KEEP_ALIVE})
    assert options["type"] is FlowResultType.CREATE_ENTRY, options
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED
    return entry.entry_id


async def test_turn_on_the_kitchen_light(hass: HomeAssistant, edgespec: Edgespec, tmp_path: Path) -> None:
    """"Turn on the kitchen light": HA offers its tools over /api/chat, the answer calls HassTurnOn (arguments
    as an object), HA executes it and the light is on; the reply after the tool's result is words."""
    await build_home(hass, [KITCHEN_LIGHT, LIVING_ROOM_LAMP])
    agent = await ollama_agent(hass, edgespec)
    speech, sent, where = await recorded_turn(hass, "Turn on the kitchen light", agent, edgespec.url, tmp_path)
    turns = [r for r in sent if r["path"] == "/api/chat"]
    assert turns and {t["function"]["name"] for t in turns[0]["body"]["tools"]} >= {"HassTurnOn"}, where
    assert hass.states.get(KITCHEN_LIGHT.entity_id).state == "on", where
    assert hass.states.get(LIVING_ROOM_LAMP.entity_id).state == "off", where
    assert "<tool_" not in speech and speech.strip(), where


async def test_a_question_answered_in_text(hass: HomeAssistant, edgespec: Edgespec, tmp_path: Path) -> None:
    """"What is the capital of France?" with the same tools offered: one chat request, answered in text."""
    await build_home(hass, [KITCHEN_LIGHT, LIVING_ROOM_LAMP])
    agent = await ollama_agent(hass, edgespec)
    speech, sent, where = await recorded_turn(hass, "What is the capital of France?", agent, edgespec.url, tmp_path)
    assert len([r for r in sent if r["path"] == "/api/chat"]) == 1, where
    assert "Paris" in speech, where
    assert hass.states.get(KITCHEN_LIGHT.entity_id).state == "off", where
