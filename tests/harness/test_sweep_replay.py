"""A prompt's recorded dense forward, replayed into a method's fresh layers (harness.sweep.replay),
leaves them as the method's own forward does: for every method, on stories260K (a trained model,
so kept sets depend on the scores), with the prompt in three chunks, the layers then compress the
prompt and decode; every decode step's logits, kept positions and held figures are equal."""

import time

import pytest
import torch

from harness.core import hf_adapter
from harness.sweep import replay as sweep_replay
from harness.core.engine import Engine
from methods import available_methods, build_method, method_class
from tests.conftest import make_engine

PROMPT_TOKENS, CHUNK_TOKENS, DECODE_STEPS = 72, 24, 4


@pytest.fixture(autouse=True)
def cpu_dispatch(monkeypatch):
    """Kernels dispatch as in a CPU run (tests/conftest.py sets TRITON_INTERPRET=1, which sends
    the quantizers' kernels through Triton's interpreter: seconds per step)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def continuation(req, ids):
    """After the prompt is fed: compress it, decode; what each step attended and computed."""
    req.close_prompt()
    seen = []
    for i in range(PROMPT_TOKENS, ids.shape[1]):
        logits = req.step(ids[:, i])
        seen.append((logits, [(kv.kept_positions().clone(), kv.stats())
                              for kv in req.cache.kv_layers]))
    return seen


def replayed(engine, method, prompt):
    """The prompt's state in a request of `engine`, replayed from a recording: the model's
    attention first, the eager recording when the layers attend with probabilities."""
    for eager in (False, True):
        recorder = Engine(engine.model, None, sweep_replay.recorder_for([method], eager),
                          engine.info, sweep_replay.recording_settings(engine.settings))
        recording = sweep_replay.record_prompt(recorder, prompt)
        ctx = engine.request()
        req = ctx.__enter__()
        try:
            logits = sweep_replay.replay_prompt(req, recording)
        except sweep_replay.Diverged:
            ctx.__exit__(None, None, None)
            continue
        return ctx, req, logits
    pytest.fail(f"{method.name}: neither recording replays into its layers")


def assert_replay_continues_as_own_forward(model, name, monkeypatch, tmp_path):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))  # prepared artefacts stay in the test
    method = build_method(name, **method_class(name).compressing_hyperparameters(
        PROMPT_TOKENS + DECODE_STEPS))
    ids = torch.randint(3, 250, (1, PROMPT_TOKENS + DECODE_STEPS),
                        generator=torch.Generator().manual_seed(5))
    prompt = ids[0, :PROMPT_TOKENS].tolist()
    engine = make_engine(model, method, chunk=CHUNK_TOKENS)
    with engine.request() as req:
        own_logits = req.feed_prompt(prompt)
        own = continuation(req, ids)
    ctx, req, logits = replayed(engine, method, prompt)
    try:
        assert torch.equal(logits, own_logits)
        again = continuation(req, ids)
    finally:
        ctx.__exit__(None, None, None)
    for step, ((a, layers_a), (b, layers_b)) in enumerate(zip(own, again)):
        assert torch.equal(a, b), f"{name}: decode step {step}: logits differ"
        for layer, ((pos_a, stats_a), (pos_b, stats_b)) in enumerate(zip(layers_a, layers_b)):
            assert torch.equal(pos_a, pos_b), f"{name}: step {step} layer {layer}: kept set"
            assert stats_a == stats_b, f"{name}: step {step} layer {layer}: held figures"


@pytest.mark.parametrize("name", available_methods())
def test_a_replayed_prompt_continues_as_the_methods_own_forward(name, stories, monkeypatch,
                                                                tmp_path):
    model = stories[0]
    method = build_method(name, **method_class(name).compressing_hyperparameters(
        PROMPT_TOKENS + DECODE_STEPS))
    reasons = method.validate(hf_adapter.model_info(model.config), {"batch_size": 1})
    if reasons:
        pytest.skip(f"refused on stories260K: {'; '.join(reasons)}")
    assert_replay_continues_as_own_forward(model, name, monkeypatch, tmp_path)


@pytest.mark.parametrize("name", ["h2o", "snapkv", "kvzip"])
def test_a_replay_that_skips_a_layer_call_is_caught(name, stories, monkeypatch, tmp_path):
    """Planted bugs: the replay leaves out a layer's `attend` (H2O's accumulated attention,
    SnapKV's window queries are never recorded) or its token ids (KVzip's reconstruction reads
    them): the comparison above fails, or the method cannot run at all."""
    real = sweep_replay._replay_layer

    def planted(cache, kv, call, lookahead, eager):
        if name == "kvzip":
            cache.needs_token_ids = False
            return real(cache, kv, call, lookahead, eager)
        cache.replay_update(kv.layer_idx, call.keys_new, call.values_new, call.position_ids)

    monkeypatch.setattr(sweep_replay, "_replay_layer", planted)
    with pytest.raises((AssertionError, AttributeError, TypeError, RuntimeError)):
        assert_replay_continues_as_own_forward(stories[0], name, monkeypatch, tmp_path)


def test_a_replay_made_while_recording_is_timed_as_the_settings_not_the_recordings(
        stories, monkeypatch):
    """Settings replayed as the prompt is recorded (`record_replaying`) run inside the
    recording's forward: their time is theirs (each engine's prefill), and is taken out of the
    recording's own cost, which every setting is charged as its forward. Planted: each
    replayed layer call takes 20 ms more."""
    model = stories[0]
    method = build_method("h2o", **method_class("h2o").compressing_hyperparameters(
        PROMPT_TOKENS))
    prompt = list(range(3, 3 + PROMPT_TOKENS))
    real, slow_ms = sweep_replay._replay_layer, 20.0

    def slow(*args):
        time.sleep(slow_ms / 1e3)
        return real(*args)

    monkeypatch.setattr(sweep_replay, "_replay_layer", slow)
    engines = [make_engine(model, method, chunk=CHUNK_TOKENS) for _ in range(2)]
    recorder = Engine(model, None, sweep_replay.recorder_for([method], True), engines[0].info,
                      sweep_replay.recording_settings(engines[0].settings))
    with engines[0].request() as a, engines[1].request() as b:
        recording, results = sweep_replay.record_replaying(recorder, prompt, [a, b])
    assert all(isinstance(r, torch.Tensor) for r in results)
    chunks, layers = PROMPT_TOKENS // CHUNK_TOKENS, model.config.num_hidden_layers
    planted_ms = chunks * layers * slow_ms  # per setting
    for engine in engines:
        assert sum(engine.timer.values("prefill")) >= planted_ms
    own = recording.cost["prefill_ms"]
    assert len(own) == chunks and min(own) >= 0
    assert sum(own) < planted_ms / 2, own  # neither setting's replay counted as the forward's


def test_a_layer_masked_otherwise_than_the_recorder_is_not_given_the_recorded_mask(stories):
    """The replay hands a layer the recorded mask only at the recorder's sizes. Planted: layer 1
    of the setting holds the same keys but places them one token later (`kv_offset` + 1), so its
    own forward masks them otherwise and attends otherwise: the replay must diverge, not answer
    it from the recording."""
    model = stories[0]
    method = build_method("full")
    engine = make_engine(model, method, chunk=CHUNK_TOKENS)
    recorder = Engine(model, None, sweep_replay.recorder_for([method], False), engine.info,
                      sweep_replay.recording_settings(engine.settings))
    prompt = list(range(3, 3 + PROMPT_TOKENS))
    recording = sweep_replay.record_prompt(recorder, prompt)
    with engine.request() as req:  # unplanted: it replays
        assert torch.equal(sweep_replay.replay_prompt(req, recording), recording.logits)
    with engine.request() as req:
        layer = req.cache.kv_layers[1]
        sizes = layer.mask_sizes
        layer.mask_sizes = lambda q_len: (sizes(q_len)[0], sizes(q_len)[1] + 1)
        with pytest.raises(sweep_replay.Diverged, match="layer 1"):
            sweep_replay.replay_prompt(req, recording)
