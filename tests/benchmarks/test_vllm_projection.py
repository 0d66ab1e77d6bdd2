"""The vLLM projection's arithmetic (benchmarks/vllm_projection_math.py) and its pool sizes,
report and figure from recorded numbers (no vLLM, no model)."""

import json
import math

import pytest

from benchmarks.vllm_projection_math import (
    concurrency_in_memory,
    interpolate_log_c,
    project,
    projected_engine,
    step_profile,
)
from kvcore.errors import ConfigError

CURVE = [(1, 10.0), (2, 16.0), (4, 22.0), (8, 25.0), (16, 26.0)]


def test_interpolation_is_linear_in_log_concurrency():
    value, note = interpolate_log_c(CURVE, math.sqrt(2))  # halfway between 1 and 2 in log c
    assert value == pytest.approx(13.0) and note is None
    value, _ = interpolate_log_c(CURVE, 2 ** 0.25 * 4)  # a quarter of the way from 4 to 8
    assert value == pytest.approx(22.0 + 0.25 * 3.0)


def test_interpolation_returns_measured_points_and_ignores_their_order():
    shuffled = [CURVE[3], CURVE[0], CURVE[4], CURVE[2], CURVE[1]]
    for c, v in CURVE:
        assert interpolate_log_c(shuffled, c) == (v, None)


def test_beyond_the_measured_range_the_curve_is_clamped_and_says_so():
    value, note = interpolate_log_c(CURVE, 40)
    assert value == 26.0 and "above the largest measured concurrency 16: clamped" in note
    value, note = interpolate_log_c(CURVE, 0.5)
    assert value == 10.0 and "below the smallest measured concurrency 1: clamped" in note


def test_concurrency_from_the_held_ratio():
    assert concurrency_in_memory(2, 0.25) == 8
    assert concurrency_in_memory(2, 1.0) == 2
    assert concurrency_in_memory(2, 1.25) == pytest.approx(1.6)  # holds more than full: fewer


@pytest.mark.parametrize("ratio", [0, -0.1, float("nan"), float("inf")])
def test_a_held_ratio_that_is_not_positive_and_finite_is_refused(ratio):
    with pytest.raises(ConfigError, match="held_ratio"):
        concurrency_in_memory(2, ratio)


@pytest.mark.parametrize("curve", [[], [(2, 16.0)]])
def test_a_curve_with_fewer_than_two_points_is_refused(curve):
    with pytest.raises(ConfigError, match="interpolating needs at least 2"):
        interpolate_log_c(curve, 2)


def test_a_curve_with_a_repeated_or_non_positive_concurrency_is_refused():
    with pytest.raises(ConfigError, match="measured twice"):
        interpolate_log_c([(1, 1.0), (2, 2.0), (2, 3.0)], 1.5)
    with pytest.raises(ConfigError, match="concurrency must be positive"):
        interpolate_log_c([(0, 1.0), (2, 2.0)], 1.5)


def test_the_overhead_scales_only_the_decode_share():
    assert projected_engine(30.0, 0.5, 2.0) == pytest.approx(20.0)  # 30 / (0.5 + 1.0)
    assert projected_engine(30.0, 1.0, 2.0) == pytest.approx(15.0)
    assert projected_engine(30.0, 0.0, 2.0) == pytest.approx(30.0)
    assert projected_engine(30.0, 0.5, 1.0) == pytest.approx(30.0)  # no overhead: the bound
    with pytest.raises(ConfigError, match="overhead_ratio"):
        projected_engine(30.0, 0.5, 0)
    with pytest.raises(ConfigError, match="decode_share"):
        projected_engine(30.0, 1.5, 1.0)


def test_project_combines_concurrency_bound_and_overhead():
    shares = [(1, 0.6), (16, 0.2)]
    p = project(CURVE, shares, c_full=2, held_ratio=0.25, overhead_ratio=1.5)
    assert p["concurrency"] == 8 and p["upper_tok_s"] == 25.0
    share = 0.6 + (0.2 - 0.6) * math.log(8) / math.log(16)
    assert p["decode_share"] == pytest.approx(share)
    assert p["projected_tok_s"] == pytest.approx(25.0 / ((1 - share) + share * 1.5))
    assert p["clamped"] is None
    assert project(CURVE, shares, 2, 0.1, 1.0)["clamped"].startswith("c=20 above")


def test_step_profile_counts_decoding_requests_and_the_pure_decode_share():
    # two requests, one pool slot each in turn: r0 prefills (1 s) then decodes 2 steps of 0.5 s,
    # r1 the same after it
    times = [[1.0, 1.5, 2.0], [3.0, 3.5, 4.0]]
    profile = step_profile(times, wall_s=4.0)
    assert profile["max_decoding"] == 1 and profile["steps"] == 6
    assert profile["decode_share"] == pytest.approx(2.0 / 4.0)
    together = step_profile([[1.0, 1.5], [1.0, 1.5]], wall_s=1.5)
    assert together["max_decoding"] == 2
    assert together["decode_share"] == pytest.approx(0.5 / 1.5)


def test_outputs_read_microseconds_apart_are_one_engine_step():
    # r0 decodes alone until r1's prefill step (1.0 -> 3.0), which also gives r0 a token; the
    # worker stamps the two outputs of that step 20 us apart
    times = [[0.5, 1.0, 3.0, 3.5], [3.00002, 3.50001]]
    profile = step_profile(times, wall_s=3.5)
    assert profile["steps"] == 4 and profile["max_decoding"] == 2
    # r0 first token (0.5 s) and r1 prefill (2 s) are prefill steps; 1.0 and 3.5 decode only
    assert profile["decode_share"] == pytest.approx((0.5 + 0.5) / 3.5, abs=1e-4)


def test_pool_blocks_hold_whole_requests_plus_the_null_block():
    from benchmarks.vllm_projection import blocks_per_request, pool_blocks

    assert blocks_per_request(960, 64, 128) == 8  # 1023 tokens written: 8 blocks
    assert blocks_per_request(961, 64, 128) == 8
    assert blocks_per_request(962, 64, 128) == 9
    assert pool_blocks(4, 8) == 33


def test_log_facts_read_the_override_and_the_scheduler_lines():
    from benchmarks.vllm_projection import log_facts

    text = ("INFO kv_cache_utils.py: Overriding num_gpu_blocks=180 with "
            "num_gpu_blocks_override=17\nINFO CPU KV cache size: 2,048 tokens, Maximum "
            "concurrency for 1,024 tokens per request: 2.00x\nEngine 000: Avg prompt throughput: "
            "1.0 tokens/s, Running: 2 reqs, Waiting: 14 reqs, GPU KV cache usage: 99.5%, Prefix "
            "cache hit rate: 0.0%\n")
    facts = log_facts(text)
    assert facts["overriding"].endswith("num_gpu_blocks_override=17")
    assert "Maximum concurrency for 1,024 tokens per request: 2.00x" in facts["kv"]
    assert facts["running_max_logged"] == 2 and facts["kv_usage_pct_max_logged"] == 99.5


def test_report_and_figure_from_recorded_numbers(tmp_path):
    from benchmarks.vllm_projection import method_points, write_outputs

    cells = {name: {"4": {"kv_bytes_device_per_seq": dev, "kv_bytes_host_per_seq": host,
                          "decode_tokens_per_s": tps, "decode_ms_per_step": 4000 / tps,
                          "prefill_tokens_per_s": 2000.0}}
             for name, dev, host, tps in [("full", 100, 0, 40.0), ("h2o", 25, 0, 32.0),
                                          ("infinigen", 0, 110, 20.0)]}
    run = {"new_tokens": 64, "threads": 2, "methods": {},
           "contexts": {"960": {"load_avg": 3.0, "cells": cells}}}
    points, facts = method_points(run, 4)
    assert points["h2o"]["held_ratio"] == 0.25
    assert points["h2o"]["overhead_ratio"] == pytest.approx(40 / 32)
    assert points["infinigen"]["held_ratio"] == pytest.approx(1.1)
    curve = [{"concurrency": c, "throughput_tok_s": v, "decode_share": 0.5, "blocks": 8 * c + 1,
              "kv_mib": 40.0 * c, "max_decoding": c, "ttft_ms_p50": 900.0, "preemptions": 0,
              "point_s": 100.0, "load_before": 2.0, "load_after": 2.5,
              "engine": {"vllm": "0.32.0", "omp_threads_bind": "auto"},
              "log": {"overriding": "Overriding num_gpu_blocks=9 with num_gpu_blocks_override=9"}}
             for c, v in CURVE]
    out = {"command": "python benchmarks/vllm_projection.py", "c_full": 2.0,
           "workload": {"requests": 16, "length": 1024, "new_tokens": 64, "block_size": 128,
                        "prompt_tokens": [959, 960]},
           "omp_wait_policy": "PASSIVE", "curve": curve, "method_points": points,
           "method_run": facts}
    stem = tmp_path / "projection"
    write_outputs(out, stem)
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert saved["projected"]["h2o"]["upper_tok_s"] == 25.0  # c = 2 / 0.25 = 8
    assert saved["projected"]["full"]["upper_tok_s"] == 16.0
    text = stem.with_suffix(".md").read_text()
    assert "| h2o | 0.250 | 8.00 | 25.0 | 1.25 |" in text
    assert "**projected**" in text and stem.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("argv, says", [
    (["--concurrency", "4"], "--concurrency 4: at least 2 distinct positive integers"),
    (["--concurrency", "1", "32"], "--concurrency 32: above --requests 16"),
    (["--c-full", "0"], "--c-full 0.0: must be a positive number"),
    (["--methods", "full"], "--methods full: benchmarks/throughput.py measures"),
])
def test_bad_arguments_are_one_line_before_anything_runs(argv, says, capsys):
    from benchmarks.vllm_projection import parse

    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
