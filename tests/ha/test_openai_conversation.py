"""Home Assistant's own OpenAI integration (openai_conversation, 2025.4.4) against a real edgespec.

The integration builds `openai.AsyncOpenAI()` with no base URL, so the SDK reads OPENAI_BASE_URL, as a user sets
it in Home Assistant's environment; it talks the Responses API, streamed, with the Assist API's function tools.
The entry is made through the integration's config flow (the API key is checked by listing models) and its
options flow (the served model, temperature 0), as a user does it in the UI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from edgespec_proc import Edgespec
from home import KITCHEN_LIGHT, LIVING_ROOM_LAMP, build_home, recorded_turn
from homeassistant.components.openai_conversation.const import (
    CONF_CHAT_MODEL,
    CONF_MAX_TOKENS,
    CONF_PROMPT,
    CONF_RECOMMENDED,
    CONF_TEMPERATURE,
    CONF_TOP_P,
    DOMAIN,
)
from homeassistant.config_entries import ConfigEntryState
from homeassistant.const import CONF_API_KEY, CONF_LLM_HASS_API
from homeassistant.core import HomeAssistant
from homeassistant.data_entry_flow import FlowResultType
from homeassistant.helpers import llm

pytestmark = pytest.mark.usefixtures("socket_enabled", "fixed_clock")


async def openai_agent(hass: HomeAssistant, server: Edgespec, monkeypatch: pytest.MonkeyPatch) -> str:
    """The integration set up through its config and options flows against `server`; its agent id."""
    monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1")
    flow = await hass.config_entries.flow.async_init(DOMAIN, context={"source": "user"})
    made = await hass.config_entries.flow.async_configure(flow["flow_id"], {CONF_API_KEY: "edgespec-needs-none"})
    assert made["type"] is FlowResultType.CREATE_ENTRY, made
    entry = made["result"]
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED
    # Unticking "recommended" shows the model and sampling fields; then they are filled in.
    shown = {CONF_RECOMMENDED: False, CONF_PROMPT: llm.DEFAULT_INSTRUCTIONS_PROMPT,
             CONF_LLM_HASS_API: llm.LLM_API_ASSIST}
    options = await hass.config_entries.options.async_init(entry.entry_id)
    options = await hass.config_entries.options.async_configure(options["flow_id"], shown)
    assert options["type"] is FlowResultType.FORM, options
    options = await hass.config_entries.options.async_configure(options["flow_id"], {
        **shown, CONF_CHAT_MODEL: server.model, CONF_TEMPERATURE: 0, CONF_TOP_P: 1, CONF_MAX_TOKENS: 150})
    assert options["type"] is FlowResultType.CREATE_ENTRY, options
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED
    return entry.entry_id


async def test_turn_on_the_kitchen_light(hass: HomeAssistant, edgespec: Edgespec, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    """"Turn on the kitchen light": HA offers its tools, the answer calls HassTurnOn, HA executes it and the
    light is on; the spoken reply after the tool's result is text, not markup."""
    await build_home(hass, [KITCHEN_LIGHT, LIVING_ROOM_LAMP])
    agent = await openai_agent(hass, edgespec, monkeypatch)
    assert hass.states.get(KITCHEN_LIGHT.entity_id).state == "off"
    speech, sent, where = await recorded_turn(hass, "Turn on the kitchen light", agent, edgespec.url, tmp_path)
    turns = [r for r in sent if r["path"] == "/v1/responses"]
    assert turns and {t["name"] for t in turns[0]["body"]["tools"]} >= {"HassTurnOn", "HassTurnOff"}, where
    assert hass.states.get(KITCHEN_LIGHT.entity_id).state == "on", where
    assert hass.states.get(LIVING_ROOM_LAMP.entity_id).state == "off", where
    assert "<tool_" not in speech and speech.strip(), where


async def test_a_question_answered_in_text(hass: HomeAssistant, edgespec: Edgespec, monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """"What is the capital of France?" with the same tools offered: one request, answered in text."""
    await build_home(hass, [KITCHEN_LIGHT, LIVING_ROOM_LAMP])
    agent = await openai_agent(hass, edgespec, monkeypatch)
    speech, sent, where = await recorded_turn(hass, "What is the capital of France?", agent, edgespec.url, tmp_path)
    assert len([r for r in sent if r["path"] == "/v1/responses"]) == 1, where
    assert "Paris" in speech, where
    assert hass.states.get(KITCHEN_LIGHT.entity_id).state == "off", where
