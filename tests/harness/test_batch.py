"""Batched ragged requests (harness.core.batch): per-sequence caches, no padding stored or attended,
sequences leaving the batch when they stop, batch-aware speed figures and runner refusals.
(Every method's B=3 equivalence with batch 1 is in tests/methods/contract/test_contract.py.)"""

import dataclasses
import json

import pytest

from harness.core import batch as batching
from harness.config.runner import RunnerSettings, protocol_reasons
from harness.run import run
from methods import build_method
from methods.protocol import Protocol
from tasks import build_task
from tests.conftest import STORIES, make_engine, need_shared
from tests.helpers.generation import prompts_of
from tests.helpers.runs import cfg_for


def test_padding_is_never_stored(tiny_model):
    """Each sequence's layers hold exactly its own tokens after a ragged, chunked prefill."""
    engine = make_engine(tiny_model, build_method("full"), chunk=8)
    lengths = [5, 19, 12]
    with engine.batch(3) as batch:
        batch.prefill(prompts_of(lengths))
        held = [[kv.kept_tokens() for kv in cache.kv_layers] for cache in batch.caches]
    assert held == [[n] * 2 for n in lengths]


def test_generate_many_equals_batch_one_and_sequences_leave_when_done(tiny_model):
    """Five prompts, batch 3 (a group of 3, then 2), different lengths and generation limits, a
    stop token hit by some sequences: the same continuations as batch 1, and every decode step
    of a finished sequence is saved (fewer rows per step, not wasted rows)."""
    prompts = prompts_of([9, 30, 17, 4, 22], seed=2)
    limits = [3, 12, 7, 12, 1]
    method = build_method("h2o", budget_tokens=10)
    one = make_engine(tiny_model, method, chunk=8)
    reference = list(one.generate_many(prompts, limits, stop_ids=set()))
    stop = {reference[1][4]}  # sequence 1 stops early at its 5th token
    reference = list(one.generate_many(prompts, limits, stop_ids=stop))
    batched = make_engine(tiny_model, method, chunk=8)
    batched.settings = dataclasses.replace(batched.settings, batch_size=3)
    got = list(batched.generate_many(prompts, limits, stop_ids=stop))
    assert got == reference
    assert [len(out) for out in got][:2] == [3, 5] and len(got[4]) == 1
    speed = batched.speed().as_dict()
    # tokens after the first of each output come from decode steps (the first from prefill)
    assert speed["decode_tokens"] == sum(len(out) - 1 for out in got)
    assert speed["decode_steps"] < speed["decode_tokens"]  # steps carried several sequences
    assert len(batched.ledger.samples) == len(prompts)


def test_min_new_tokens_masks_stop_tokens_in_batches(tiny_model):
    prompts = prompts_of([6, 11])
    engine = make_engine(tiny_model, build_method("full"))
    first = [out[0] for out in engine.generate_many(prompts, 1, stop_ids=set())]
    engine.settings = dataclasses.replace(engine.settings, batch_size=2)
    outs = list(engine.generate_many(prompts, 3, stop_ids=set(first), min_new_tokens=1))
    assert [out[0] for out in outs] != first and all(out[0] not in first for out in outs)


def test_tasks_that_cannot_batch_are_refused_before_loading(tiny_model):
    from harness.core import hf_adapter

    info = hf_adapter.model_info(tiny_model.config)
    method = build_method("full")
    for name, refused in (("perplexity", True), ("multiturn", True), ("ruler", False),
                          ("xsum", False), ("longbench", False)):
        reasons = protocol_reasons(method, build_task(name), info, Protocol(),
                                   RunnerSettings(batch_size=4))
        assert bool(reasons) == refused, (name, reasons)
        if refused:
            assert "runner.batch_size=4" in reasons[0] and f"task={name}" in reasons[0]


def test_ruler_batched_run_writes_the_same_answers(tmp_path):
    """The runner end to end at runner.batch_size=2 (3 samples: a batch of 2, then 1) gives the
    same predictions as batch 1, and metrics.json carries the batch, the decode token count and
    both seeds (the runner's and the task's needle seed, neither hiding the other)."""
    need_shared(STORIES)
    common = ["model=stories260k", "task=ruler", "task.lengths=[480]", "task.depths=[0,50,100]",
              "task.subtasks=[niah_single]", "task.seed=7", "runner.seed=3",
              "task.max_new_tokens=4", f"runner.results_root={tmp_path}"]
    outs = [run(cfg_for(*common, f"runner.batch_size={b}", f"runner.output_dir={tmp_path}/b{b}"))
            for b in (1, 2)]
    samples = [[json.loads(line) for line in (o / "samples.jsonl").read_text().splitlines()]
               for o in outs]
    assert [s["prediction"] for s in samples[0]] == [s["prediction"] for s in samples[1]]
    metrics = json.loads((outs[1] / "metrics.json").read_text())
    assert metrics["protocol"]["batch_size"] == 2
    assert (metrics["protocol"]["seed"], metrics["protocol"]["task_seed"]) == (3, 7)
    assert metrics["speed"]["decode_tokens"] == sum(s["generated_tokens"] - 1 for s in samples[1])


@pytest.mark.parametrize("batch", [2])
def test_batched_decode_counts_every_sequence_in_throughput(tiny_model, batch):
    engine = make_engine(tiny_model, build_method("full"))
    with engine.batch(batch) as req:
        req.prefill(prompts_of([7, 13]))
        for _ in range(4):
            req.step([0, 1], [5, 6])
    speed = engine.speed().as_dict()
    assert speed["decode_steps"] == 4 and speed["decode_tokens"] == 8
    total_ms = sum(engine.timer.values("decode"))
    assert speed["decode_tokens_per_s"] == pytest.approx(8 * 1e3 / total_ms, rel=1e-3)


def decode_alone_and_together(model, methods, lengths, limits):
    """Each request decoded by its own `Request.answer`, then all of them together by
    `decode_requests` (one engine per method, as a sweep's settings): both outputs, and each
    engine's decode figures after the second."""
    from contextlib import ExitStack

    from harness.core.batch import decode_requests

    prompts = prompts_of(lengths, seed=5)
    engines = [make_engine(model, method, chunk=8) for method in methods]
    alone = []
    for engine, prompt, limit in zip(engines, prompts, limits):
        with engine.request() as req:
            alone.append(req.answer(req.prefill(prompt), limit, set()))
    engines = [make_engine(model, method, chunk=8) for method in methods]
    with ExitStack() as stack:
        reqs = [stack.enter_context(engine.request()) for engine in engines]
        logits = [req.prefill(prompt)[0, -1] for req, prompt in zip(reqs, prompts)]
        together = decode_requests(reqs, logits, limits, set())
    return alone, together, engines


def test_requests_of_different_methods_decode_together_as_alone(tiny_model):
    """A sweep's settings decoded together (harness.core.batch.decode_requests): three methods, three
    prompt lengths (so positions differ per row), three limits (rows leave the batch): each row
    equals its request decoded alone, and each engine counts its own steps only."""
    methods = [build_method("h2o", budget_tokens=10), build_method("full"),
               build_method("streaming_llm", sink_tokens=2, window_tokens=6)]
    limits = [6, 3, 9]
    alone, together, engines = decode_alone_and_together(tiny_model, methods, [14, 23, 9], limits)
    assert together == alone
    assert [len(out) for out in together] == limits
    for engine, limit in zip(engines, limits):
        speed = engine.speed().as_dict()
        assert speed["decode_tokens"] == speed["decode_steps"] == limit - 1
        assert len(engine.ledger.samples) == 1


def test_rows_crossed_between_requests_are_caught(tiny_model, monkeypatch):
    """The planted bug: each batched step routes row r to the next request's cache: the outputs
    no longer equal the requests decoded alone (or a cache breaks outright)."""
    original = batching.Routing.set

    def rotated(self, seqs, valid):
        original(self, seqs[1:] + seqs[:1], valid)

    monkeypatch.setattr(batching.Routing, "set", rotated)
    methods = [build_method("h2o", budget_tokens=10), build_method("full")]
    try:
        alone, together, _ = decode_alone_and_together(tiny_model, methods, [14, 23], [6, 6])
    except (RuntimeError, ValueError, IndexError):
        return
    assert together != alone
