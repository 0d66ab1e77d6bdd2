"""The terminal summary and metrics.json name the held ratio (held / full); "compression" only
where it is one (held < full, printed as full / held > 1)."""

import json

import pytest

from harness.core.accounting import KVLedger
from harness.run import held_words, summary
from methods.model import ModelInfo
from tests.helpers.reports import fake_run


@pytest.mark.parametrize("held, words", [
    (0.25, "held ratio 0.25, compression 4x"),
    (1.469, "held ratio 1.469: more than the full cache"),
    (1.0, "held ratio 1"),
    (None, "held ratio unknown"),
])
def test_held_words_name_compression_only_when_it_is_one(held, words):
    assert held_words(held) == words


def test_the_summary_of_a_method_holding_more_than_full_never_says_compression(tmp_path):
    folder = fake_run(tmp_path / "r", "infinigen", 10.0, 100.0)
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["kv"] = {"bytes_total": 66.06 * 2**20, "full_cache_bytes": 44.96 * 2**20,
                     "bytes_device_total": 66.06 * 2**20, "held_ratio": 1.469,
                     "tokens_per_layer": [100.0, 100.0]}
    metrics["memory"], metrics["transfer"] = {"kind": "cpu", "peak_bytes": 0}, {}
    metrics["speed"].update(prefill_ms_total=1.0, prefill_tokens=1, decode_ms_per_token_p90=1.0)
    text = summary(metrics, folder)
    assert "66.06 MiB held (full cache 44.96 MiB, held ratio 1.469: more than the full cache)" in text
    assert "compression" not in text


def test_metrics_json_names_the_held_ratio_not_a_compression_ratio():
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, max_positions=64)
    ledger = KVLedger(info)
    full = 10 * info.kv_bytes_per_token()
    ledger.samples.append({  # one request that held 1.5x the full cache (a host copy + partial keys)
        "seen_tokens": 10, "tokens_per_layer": [10], "bytes_per_layer": [1.5 * full],
        "device_bytes_per_layer": [0.5 * full], "budget_per_layer": [None],
        "selected_per_layer": [None], "storage_used_per_layer": [None],
        "storage_allocated_per_layer": [None], "method_facts": {}})
    kv = ledger.summary()
    assert kv["held_ratio"] == 1.5 and "compression_ratio" not in kv
