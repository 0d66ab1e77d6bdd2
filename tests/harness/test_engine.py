"""The engine's greedy loop reproduces known outputs exactly, and accounts what it does."""

import pytest
import torch

from methods import build_method
from tests.conftest import make_engine

STORY_60 = (
    "<s> Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.\nLily"
)


def test_stories260k_greedy_reproduces_the_readme_story(stories):
    model, tok = stories
    engine = make_engine(model, build_method("full"), tok)
    prompt = tok("Once upon a time")["input_ids"]
    assert prompt == [1, 403, 407, 261, 378]
    with engine.request() as req:
        new = req.generate(prompt, max_new_tokens=60, stop_ids=set())
    assert tok.decode(prompt + new) == STORY_60
    assert new[-6:] == [333, 415, 426, 13, 438, 310]
    speed = engine.speed().as_dict()
    assert speed["decode_steps"] == 59 and speed["prefill_tokens"] == 5


def test_stories260k_from_bos_matches_llama2c_oracle_prefix(stories):
    model, tok = stories
    engine = make_engine(model, build_method("full"), tok)
    with engine.request() as req:
        new = req.generate([1], max_new_tokens=200, stop_ids=set())
    assert new[:10] == [403, 407, 261, 378, 432, 383, 286, 261, 376, 298]
    text = tok.decode(new, skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily.")
    assert text.endswith("Lily didn't want to help her mom, so she")


def test_generate_stops_at_stop_token(stories):
    model, tok = stories
    engine = make_engine(model, build_method("full"), tok)
    with engine.request() as req:
        first = req.generate([1, 403, 407], max_new_tokens=5, stop_ids=set())
    with engine.request() as req:
        stopped = req.generate([1, 403, 407], max_new_tokens=5, stop_ids={first[1]})
    assert stopped == first[:2]


def test_bind_is_undone_even_on_error(tiny_model):
    engine = make_engine(tiny_model, build_method("full"))
    try:
        with engine.request() as req:
            req.prefill(torch.arange(3, 10))
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert not any(hasattr(m, "_kvh_layer") for m in tiny_model.model.layers)


@pytest.mark.parametrize("name, hyper", [
    ("h2o", {"budget_tokens": 8}),
    ("streaming_llm", {"sink_tokens": 2, "window_tokens": 6}),  # prepared sink rotation
    ("kivi", {"group_size": 8, "residual_tokens": 8}),  # packed namedtuples, token-major rows
    ("kvquant", {"calibration_tokens": 64, "calibration_samples": 1}),  # codes, outlier columns
])
def test_snapshot_restore_rewinds_the_request(tiny_model, name, hyper, monkeypatch, tmp_path):
    """Rewinding to a snapshot replays a continuation bit for bit (an evicting method's state
    included); a method holding a host store is not forkable and says so with None."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the rewinding, not the kernels: CPU paths
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    ids = torch.randint(3, 250, (30,), generator=torch.Generator().manual_seed(0))
    engine = make_engine(tiny_model, build_method(name, **hyper))
    with engine.request() as req:
        req.prefill(ids[:20])
        snap = req.snapshot()
        assert snap is not None
        first = [req.step(t) for t in ids[20:25]]
        req.restore(snap)
        again = [req.step(t) for t in ids[20:25]]
        assert req.pos == 25
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    offload = make_engine(tiny_model, build_method("full_offload"))
    with offload.request() as req:
        req.prefill(ids[:10])
        assert req.snapshot() is None
