"""Projected decode time: the ledger's bytes over a profile's link bandwidth, labelled projected."""

import pytest
import yaml

from harness.core.projection import project
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


def _llama_config(tmp_path, **kw):
    from transformers import LlamaConfig

    cfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=1000)
    LlamaConfig(**{**cfg, **kw}).save_pretrained(tmp_path)
    return tmp_path / "config.json"


def test_capacity_projection_by_hand(tmp_path):
    """Weights from the meta-device model, KV bytes exact, batch and roofline step by hand."""
    from harness.core.projection import MethodRatios, project_capacity, shape_from_config

    shape = shape_from_config(_llama_config(tmp_path), "bfloat16")
    # embed + lm_head 2*1000*256; per layer q,o 256*256, k,v 256*64, mlp 3*256*512, 2 norms; final norm
    layer = 2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 512 + 2 * 256
    assert shape.parameters == 2 * 1000 * 256 + 4 * layer + 256
    assert shape.full_bytes_per_token == 2 * 4 * 2 * 32 * 2  # K and V, layers, kv heads, dim, bf16
    hw = {"name": "toy", "device_memory_gib": 1.0, "memory_gb_per_s": 1000.0, "link_gb_per_s": 10.0}
    half = MethodRatios("half", device_ratio=0.5, read_ratio=0.25, moved_ratio=0.1, source="t")
    r = project_capacity(shape, hw, half, context_tokens=1000)
    free = 2**30 * 0.9 - shape.weight_bytes
    assert r["max_batch"] == int(free // (1000 * 1024 * 0.5))
    b = r["max_batch"]
    step_ms = ((shape.weight_bytes + b * 1000 * 1024 * 0.25) / 1e12
               + b * 1000 * 1024 * 0.1 / 1e10) * 1e3
    assert abs(r["step_ms_at_batch"] - round(step_ms, 3)) < 1e-9 and r["label"] == "projected"


def test_projection_cli_reads_runs_and_refuses_bad_input(tmp_path, capsys):
    import json

    from harness.core.projection import main

    config = _llama_config(tmp_path / "m")
    run = tmp_path / "runs" / "h2o"
    run.mkdir(parents=True)
    kv = {"full_cache_bytes": 1000.0, "seen_tokens_mean": 10.0, "bytes_total": 200.0,
          "bytes_device_total": 200.0, "held_ratio": 0.2, "attended_fraction_all_layers": 0.21,
          "method_active": True}
    (run / "metrics.json").write_text(json.dumps({
        "kv": kv, "transfer": {}, "method": {"name": "h2o", "hyperparameters": {"budget_ratio": 0.2},
                                             "axis_keys": ["budget_ratio"]}}))
    lazy = tmp_path / "runs" / "kivi"
    lazy.mkdir()
    (lazy / "metrics.json").write_text(json.dumps({
        "kv": {**kv, "held_ratio": 1.0, "method_active": False, "inactive_reason": "short"},
        "transfer": {}, "method": {"name": "kivi", "hyperparameters": {}}}))
    assert main(["--model-config", str(config), "--context-tokens", "4096", "--runs",
                 str(tmp_path / "runs"), "--hardware", "h200_sxm"]) == 0
    out, err = capsys.readouterr()
    assert "| h200_sxm | h2o budget_ratio=0.2 |" in out and out.startswith("Projected")
    assert "kivi" not in out and "did not act" in err
    assert main(["--model-config", str(tmp_path / "nope.json")]) == 2
    assert main(["--model-config", str(config), "--hardware", "tpu_v9"]) == 2
    assert "unknown; allowed:" in capsys.readouterr().err
