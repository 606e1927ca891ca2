"""compare-headsplit's settings without running anything (bench/headsplit_net.py): shaped links from
config/devices.toml, worker pinning, and where a mode overtakes layer-based."""

from __future__ import annotations

import os

import pytest

from edgespec.bench.headsplit_net import link_spec, overtakes, tc_mbit, worker_cpus


def test_links_from_devices_toml_and_overrides():
    wifi = link_spec("wifi", None, None)
    # a device-to-device round trip crosses four shaped egresses (two each way)
    assert (wifi.rate, wifi.delay_ms, wifi.rtt_ms, wifi.bandwidth_mbit_s) == ("200mbit", 1.0, 4.0, 200.0)
    custom = link_spec(None, "100mbit", 2.0)
    assert (custom.name, custom.rtt_ms, custom.bandwidth_mbit_s) == ("custom", 8.0, 100.0)
    assert link_spec("wifi", "50mbit", 0.0).rate == "50mbit"
    assert link_spec(None, None, None) is None  # loopback
    with pytest.raises(ValueError):
        link_spec(None, None, 1.0)
    with pytest.raises(ValueError):
        link_spec("carrier-pigeon", None, None)
    assert tc_mbit("1gbit") == 1000.0 and tc_mbit("500kbit") == 0.5


def test_workers_pinned_one_per_core_then_sharing():
    cores = sorted(os.sched_getaffinity(0))
    cpus = worker_cpus(len(cores) + 2)
    assert cpus[:len(cores)] == cores and cpus[len(cores):] == cores[:2]


def test_overtakes_per_worker_count():
    def row(measured, predicted):
        return {"modes": {"layer": {"speedup_over_layer": 1.0},
                          "head": {"speedup_over_layer": measured, "predicted_speedup_over_layer": predicted}}}

    got = overtakes({"2": row(0.9, 1.1), "3": row(1.05, 1.2), "4": row(0.8, 0.95)})
    assert got == {"head": {"measured": [3], "predicted": [2, 3]}}
