"""Records the exact requests Home Assistant's conversation integrations send for a home of n exposed devices,
for bench/ha_latency.py to replay (deliverable 5 of issue 38). Not a test: pytest collects it only when named.

    .venv-ha/bin/python -m pytest -q tests/ha/record_requests.py

For each n in SIZES, a `hass` with a_home(n) (home.py) and the OpenAI integration set up as the tests set it up
(its config and options flows, against a real edgespec) is asked two spoken commands, each a new conversation
as Assist starts one, a couple of seconds apart (HA renders the time, to the second, at the top of its system
prompt on every turn). The first request of each turn, as its client put it on the wire, goes to
bench/prompts/ha_request_<n>.json.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import homeassistant.const
import pytest
from edgespec_proc import REPO, Edgespec
from home import a_home, build_home, converse, recording
from homeassistant.core import HomeAssistant
from test_openai_conversation import openai_agent

SIZES = (20, 40)
COMMANDS = ("Turn on the kitchen light", "Turn off the office light")
OUT = REPO / "bench" / "prompts"

pytestmark = pytest.mark.usefixtures("socket_enabled")


@pytest.mark.parametrize("n", SIZES)
async def test_record(hass: HomeAssistant, edgespec: Edgespec, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                      n: int) -> None:
    devices = a_home(n)
    await build_home(hass, devices)
    agent = await openai_agent(hass, edgespec, monkeypatch)
    turns = []
    for i, command in enumerate(COMMANDS):
        if i:
            await asyncio.sleep(2)  # the next turn renders another time into the prompt, as it would in a home
        with recording(edgespec.url, tmp_path / f"turn{i}.json") as sent:
            await converse(hass, command, agent)
        first = next(r for r in sent if r["path"] == "/v1/responses")
        turns.append({"command": command, "path": first["path"], "body": first["body"]})
    record = {
        "about": "the first request of two Assist turns, as Home Assistant's openai_conversation sent them "
                 "(tests/ha/record_requests.py)",
        "homeassistant": homeassistant.const.__version__, "integration": "openai_conversation",
        "exposed_entities": n, "devices": [[d.entity_id, d.area] for d in devices], "turns": turns,
    }
    (OUT / f"ha_request_{n}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
