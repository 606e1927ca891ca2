"""The live dashboard: GET /dashboard/state in-process (one device holding every layer), and the page itself in a
real headless Chromium against `edgespec serve --local-workers 2`, updating as a completion runs.

The browser is the system's Chromium (Debian's package: `make install-test` installs it), driven by playwright
through `executable_path`; playwright's own browser download is never used, so nothing is fetched at test time.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from inprocess import LoopClient, controller_app

from edgespec.decoding.headsplit import HEADSPLIT
from edgespec.engine.executor import Executor
from edgespec.engine.sessions import Sessions
from edgespec.model.headsplit import HeadSplitPipeline
from edgespec.planning.headsplit import LayerPlace

KEY = "dash-key"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Name three rivers."}], "temperature": 0,
        "max_tokens": 12}


@pytest.fixture(scope="module")
def served(tiny):
    """(client, service) of the in-process controller, with an API key on /v1."""
    app, service = controller_app(tiny, api_key=[KEY], served_model_name="tiny")
    c = LoopClient(app)
    yield c, service
    c.close()
    service.engine.close()


@pytest.fixture
def client(served):
    return served[0]


def test_state_in_process_shows_one_device_holding_every_layer(client):
    # no key: like /health and /metrics, the dashboard is read-only figures
    state = client.get("/dashboard/state").json()
    assert state["mode"] == "in-process" and state["model"] == "tiny" and state["n_layers"] == 4
    [device] = state["devices"]
    assert device["name"] == "controller" and device["layers"] == [{"first": 0, "last": 4}]
    assert 0 <= device["memory_use"] <= 1 and device["memory_budget_bytes"] == 2**28  # kv_cache_gib 0.25
    assert state["links"] == [] and state["headsplit"] is None

    r = client.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    after = client.get("/dashboard/state").json()
    tokens = r.json()["usage"]["completion_tokens"]
    assert after["generated_tokens"] == state["generated_tokens"] + tokens
    assert after["prompt_tokens"] > state["prompt_tokens"]
    assert [p["policy"] for p in after["policies"]] == ["naive"]
    assert after["requests"] == {"running": 0, "waiting": 0, "in_flight": 0}


def test_replans_show_as_events_and_headsplit_groups_per_device(served):
    client, service = served
    client.get("/dashboard/state")  # the starting point: what came before has no time to show
    service.metrics.replans.labels("memory", "kept").inc()
    state = client.get("/dashboard/state").json()
    assert {"reason": "memory", "outcome": "kept", "count": 1.0} in state["replans"]
    assert [(e["kind"], e["text"]) for e in state["events"]][-1] == ("replan", "memory: kept")

    # a HeadSplit placement, once the engine has built its lane: in-process its one device is "local" (a lane
    # over a pipeline of that placement, its devices never called here)
    executor = service.engine.executor
    layers = [LayerPlace({"local": [0, 1]}, "local", "local"), LayerPlace({"local": [0], "w": [1]}, "w", "local", True),
              *(LayerPlace({"w": [0, 1]}, "w", "w") for _ in range(2))]
    pipeline = HeadSplitPipeline({}, layers, executor.cfg)
    service.engine.lanes[HEADSPLIT] = Sessions(Executor(executor.cfg, executor.ends, pipeline, executor.thread))
    try:
        state = client.get("/dashboard/state").json()
    finally:
        del service.engine.lanes[HEADSPLIT]
    assert state["headsplit"][1] == {"layer": 1, "groups": {"local": [0], "w": [1]}, "proj": "w", "ffn": "local",
                                     "speculate": True}
    assert state["devices"][0]["head_groups"] == 3


def test_page_is_self_contained_and_state_is_documented(client):
    r = client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<script>" in page and "<style>" in page
    # nothing from elsewhere: no external script, stylesheet, font or image
    assert not re.search(r"""(src|href)\s*=|@import|url\(|https?://""", page)
    schema = client.get("/openapi.json").json()
    ref = schema["paths"]["/dashboard/state"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    state = schema["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
    assert {"devices", "links", "requests", "policies", "replans", "memory_threshold"} <= set(state["properties"])
    assert state["properties"]["memory_threshold"]["description"]


def chromium() -> str:
    path = os.environ.get("EDGESPEC_CHROMIUM") or shutil.which("chromium")
    if path is None:
        pytest.fail("no Chromium on PATH: `make install-test` installs Debian's (apt-get install chromium)")
    return path


def number(page, selector: str) -> float:
    return float(page.locator(selector).text_content().replace(",", ""))


@pytest.mark.slow
def test_dashboard_in_chromium_over_two_workers(tiny, tmp_path):
    from playwright.sync_api import expect, sync_playwright
    from processes import model_id, start_server

    proc, url = start_server(tmp_path, "dashboard", "--model", tiny, "--local-workers", "2", "--worker-threads", "1",
                             "--placement", "even", "--monitor-interval-s", "0.5")
    try:
        with sync_playwright() as pw:
            # --disable-dev-shm-usage: a container's small /dev/shm crashes Chromium's renderer
            browser = pw.chromium.launch(executable_path=chromium(), args=["--disable-dev-shm-usage"])
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 1000})
                page.goto(url + "/dashboard")
                expect(page.locator("#status")).to_have_text("live", timeout=15_000)
                expect(page.locator('tr[data-device="worker0"] td.layers')).to_contain_text("[0, 2)")
                expect(page.locator('tr[data-device="worker1"] td.layers')).to_contain_text("[2, 4)")
                expect(page.locator('tr[data-device="controller"] td.layers')).to_contain_text("none")
                # the workers' memory against their budget, once the controller has checked them
                expect(page.locator('tr[data-device="worker0"] td.memory')).to_contain_text("re-plan at 85%",
                                                                                          timeout=15_000)
                tokens = number(page, "#generated-tokens")

                body = {**CHAT, "model": model_id(url), "max_tokens": 16}
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                made = r.json()["usage"]["completion_tokens"]

                # the page's next polls show the tokens and the traffic over every link of the route
                expect(page.locator("#generated-tokens")).to_have_text(f"{tokens + made:,.0f}", timeout=10_000)
                for link in ("controller->worker0", "worker0->worker1", "worker1->controller"):
                    row = page.locator(f'tr[data-link="{link}"]')
                    expect(row.locator("td.messages")).not_to_have_text("0")
                    assert float(row.locator("td.bytes").get_attribute("data-value")) > 0
                expect(page.locator('tr[data-device="worker1"]')).to_contain_text("ms ×")  # stage forward time
                expect(page.locator("#policies tbody tr").first).to_have_attribute("data-policy", re.compile(r"\w"))
                screenshot(page, tmp_path)
            finally:
                browser.close()
    finally:
        proc.stop()


def screenshot(page, tmp_path: Path) -> None:
    """A PNG of the whole page, in the test's folder and in $EDGESPEC_SCREENSHOT_DIR when set."""
    png = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    folder = os.environ.get("EDGESPEC_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "dashboard.png").write_bytes(png)
