"""Projected decode time: the ledger's bytes over a profile's link bandwidth, labelled projected."""

import pytest
import yaml

from harness.projection import project
from tests.conftest import PROJECT


def test_projection_arithmetic():
    hw = {"name": "pcie3_a6000", "link_gb_per_s": 12.0}
    speed = {"decode_ms_per_token_median": 10.0}
    transfer = {"decode_steps": 4, "bytes_per_decode_step": 24e6, "exposed_ms": 8.0}
    p = project(hw, speed, transfer)
    assert p["compute_ms_measured"] == 8.0  # 10 ms - 2 ms exposed per step
    assert p["transfer_ms"] == 2.0  # 24 MB / 12 GB/s
    assert p["decode_ms_serial"] == 10.0 and p["decode_ms_overlapped"] == 8.0
    assert "projected" in p["label"]


def test_no_projection_without_hardware():
    assert project({"name": "none"}, {}, {}) is None


@pytest.mark.parametrize("name", ["pcie3_a6000", "pcie4_a100", "pcie5_h100", "h200_sxm"])
def test_profiles_are_complete(name):
    hw = yaml.safe_load((PROJECT / "conf" / "hardware" / f"{name}.yaml").read_text())
    assert hw["name"] == name and hw["link_gb_per_s"] > 0 and hw["memory_gb_per_s"] > 0
