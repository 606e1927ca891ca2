"""A home for Home Assistant's `hass` test fixture, built with HA's own integrations, and a recorder of the
requests its conversation integrations send.

Each device is a template entity (HA's `template` integration) whose state is an input_boolean or an
input_number, so a tool call that HA executes (light.turn_on, ...) changes a state the test can read. Devices are
put in areas and exposed to Assist as a user does it in the UI (the area and entity registries, the exposed
entities store).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx
from homeassistant.components import conversation
from homeassistant.components.homeassistant.exposed_entities import async_expose_entity
from homeassistant.core import Context, HomeAssistant
from homeassistant.helpers import area_registry as ar
from homeassistant.helpers import entity_registry as er
from homeassistant.setup import async_setup_component
from homeassistant.util import slugify


@dataclass(frozen=True)
class Device:
    """One exposed device: its domain (light, switch, sensor, binary_sensor, cover), name and area."""

    domain: str
    name: str
    area: str

    @property
    def entity_id(self) -> str:
        return f"{self.domain}.{slugify(self.name)}"

    @property
    def backing(self) -> str:
        """The helper that holds its state (input_boolean, or input_number for sensors and covers)."""
        kind = "input_number" if self.domain in ("sensor", "cover") else "input_boolean"
        return f"{kind}.{slugify(self.name)}"


KITCHEN_LIGHT = Device("light", "Kitchen light", "Kitchen")
LIVING_ROOM_LAMP = Device("light", "Living room lamp", "Living room")

_AREAS = ("Kitchen", "Living room", "Bedroom", "Office", "Bathroom", "Hallway", "Garage", "Kids room")
_KINDS = (("light", "light"), ("switch", "plug"), ("sensor", "temperature"), ("binary_sensor", "window"),
          ("cover", "blinds"))


def a_home(n: int) -> list[Device]:
    """A home of n devices: the kitchen light first, then a light, plug, temperature sensor, window and blinds
    per area in turn (a typical mix of what people expose to Assist)."""
    devices = [KITCHEN_LIGHT]
    i = 0
    while len(devices) < n:
        (domain, word), area = _KINDS[i % len(_KINDS)], _AREAS[(i // len(_KINDS)) % len(_AREAS)]
        round_ = i // (len(_KINDS) * len(_AREAS))
        name = f"{area} {word}" + (f" {round_ + 1}" if round_ else "")
        if name != KITCHEN_LIGHT.name:
            devices.append(Device(domain, name, area))
        i += 1
    return devices


def _template(device: Device) -> dict[str, Any]:
    """The template entity of `device`, its state read from (and its actions written to) its backing helper."""
    on, off = ({"action": f"input_boolean.turn_{s}", "target": {"entity_id": device.backing}} for s in ("on", "off"))
    base = {"name": device.name, "unique_id": slugify(device.name)}
    if device.domain in ("light", "switch"):
        return {**base, "state": f"{{{{ is_state('{device.backing}', 'on') }}}}", "turn_on": on, "turn_off": off}
    if device.domain == "binary_sensor":
        return {**base, "state": f"{{{{ is_state('{device.backing}', 'on') }}}}", "device_class": "window"}
    return {**base, "state": f"{{{{ states('{device.backing}') | float }}}}", "unit_of_measurement": "°C",
            "device_class": "temperature", "state_class": "measurement"}


def _cover(device: Device) -> dict[str, Any]:
    """A legacy template cover (the template integration's own `cover` platform) whose position is its helper."""
    def set_to(position: int | str) -> dict[str, Any]:
        return {"action": "input_number.set_value", "target": {"entity_id": device.backing},
                "data": {"value": position}}
    return {"friendly_name": device.name, "unique_id": slugify(device.name),
            "position_template": f"{{{{ states('{device.backing}') | int }}}}",
            "open_cover": set_to(100), "close_cover": set_to(0),
            "set_cover_position": set_to("{{ position }}")}


async def build_home(hass: HomeAssistant, devices: list[Device]) -> None:
    """Set up Home Assistant's core, intents and `devices` in their areas, exposed to conversation agents."""
    assert await async_setup_component(hass, "homeassistant", {})
    assert await async_setup_component(hass, "intent", {})
    booleans = {slugify(d.name): {"name": d.name + " state"} for d in devices if d.backing.startswith("input_b")}
    numbers = {slugify(d.name): {"name": d.name + " value", "min": 0, "max": 100, "initial": 21 if d.domain ==
                                 "sensor" else 0} for d in devices if d.backing.startswith("input_n")}
    assert await async_setup_component(hass, "input_boolean", {"input_boolean": booleans})
    assert await async_setup_component(hass, "input_number", {"input_number": numbers})
    templates: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        if d.domain != "cover":
            templates.setdefault(d.domain, []).append(_template(d))
    assert await async_setup_component(hass, "template", {"template": [templates]})
    covers = {slugify(d.name): _cover(d) for d in devices if d.domain == "cover"}
    if covers:
        assert await async_setup_component(hass, "cover", {"cover": [{"platform": "template", "covers": covers}]})
    await hass.async_block_till_done()
    areas, entities = ar.async_get(hass), er.async_get(hass)
    for d in devices:
        area = areas.async_get_area_by_name(d.area) or areas.async_create(d.area)
        entry = entities.async_get(d.entity_id)
        assert entry is not None, f"{d.entity_id} is not registered"
        entities.async_update_entity(d.entity_id, area_id=area.id)
        async_expose_entity(hass, conversation.DOMAIN, d.entity_id, True)
    for helper in {d.backing for d in devices}:
        async_expose_entity(hass, conversation.DOMAIN, helper, False)
    await hass.async_block_till_done()


async def converse(hass: HomeAssistant, text: str, agent_id: str) -> str:
    """One turn through `conversation.async_converse`, as Assist sends it; the speech HA would say."""
    result = await conversation.async_converse(hass, text, None, Context(), agent_id=agent_id)
    await hass.async_block_till_done()
    return result.response.speech.get("plain", {}).get("speech", "")


@contextmanager
def recording(base_url: str, out: Path) -> Iterator[list[dict[str, Any]]]:
    """Every request sent through httpx to `base_url` while the block runs, as {"method", "path", "body"}: the
    bytes the integrations' own clients (openai, ollama) put on the wire, parsed as JSON. Written to `out`
    (a JSON list) when the block ends, however it ends: the exact requests to replay by hand."""
    sent: list[dict[str, Any]] = []
    send = httpx.AsyncClient.send

    async def recorded(client: httpx.AsyncClient, request: httpx.Request, *args: Any, **kwargs: Any):
        if str(request.url).startswith(base_url):
            body = request.content
            sent.append({"method": request.method, "path": request.url.path,
                         "body": json.loads(body) if body else None})
        return await send(client, request, *args, **kwargs)

    try:
        with patch.object(httpx.AsyncClient, "send", recorded):
            yield sent
    finally:
        out.write_text(json.dumps(sent, indent=1))


async def recorded_turn(hass: HomeAssistant, text: str, agent_id: str, base_url: str,
                        folder: Path) -> tuple[str, list[dict[str, Any]], str]:
    """`converse` with the requests sent to `base_url` recorded into `folder`/requests.json: the speech, the
    requests, and a line naming both for the tests' assertion messages."""
    out = folder / "requests.json"
    with recording(base_url, out) as sent:
        speech = await converse(hass, text, agent_id)
    return speech, sent, f"speech {speech!r}; requests: {out}"
