"""Perplexity: the two protocols agree when nothing is evicted, and match transformers itself."""

import math

import pytest
import torch

from kvcore.errors import ConfigError
from methods import build_method
from tasks import build_task
from tests.conftest import make_engine


def run_ppl(model, tok, **options):
    task = build_task("perplexity", **options)
    return task.evaluate(make_engine(model, build_method("full"), tok, chunk=128))


def test_streaming_equals_chunked_when_window_covers_text(stories, data_dir):
    model, tok = stories
    common = dict(dataset="pg19", data_dir=str(data_dir), max_tokens=300)
    chunked = run_ppl(model, tok, mode="chunked", window_tokens=300, **common).metrics
    streaming = run_ppl(model, tok, mode="streaming", block_tokens=100, **common).metrics
    assert chunked["tokens_scored"] == streaming["tokens_scored"] == 299
    assert abs(streaming["ppl"] / chunked["ppl"] - 1) < 1e-4
    assert len(streaming["nll_per_block"]) == 3


def test_chunked_windows_are_independent(stories, data_dir):
    model, tok = stories
    res = run_ppl(model, tok, dataset="pg19", data_dir=str(data_dir), mode="chunked",
                  max_tokens=250, window_tokens=100)
    assert [s["tokens"] for s in res.samples] == [100, 100, 50]
    assert res.metrics["tokens_scored"] == 99 + 99 + 49


def test_stories260k_pg19_matches_reference(stories, data_dir):
    """Reference value: PG-19 first book, first 512 tokens (BOS included) -> 48.61."""
    model, tok = stories
    res = run_ppl(model, tok, dataset="pg19", data_dir=str(data_dir), mode="chunked",
                  max_tokens=512, window_tokens=512)
    assert res.protocol["bos"] is True
    assert abs(res.metrics["ppl"] - 48.61) < 0.05


def test_smollm2_wikitext2_matches_independent_transformers(smollm2, data_dir):
    model, tok = smollm2
    res = run_ppl(model, tok, dataset="wikitext2", data_dir=str(data_dir), mode="chunked",
                  max_tokens=1024, window_tokens=1024)
    # independent: read the file in text mode, tokenize, one plain transformers forward
    text = (data_dir / "wikitext2" / "wikitext-test.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok(text)["input_ids"][:1024])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    expected = math.exp(float(nll))
    assert abs(res.metrics["ppl"] / expected - 1) < 1e-3
    assert abs(expected - 14.09) < 0.05  # reference value (fp32, no BOS, text-mode read)


@pytest.mark.parametrize("options, key", [
    ({"dataset": "wikitext3"}, "task.dataset"),
    ({"mode": "sliding"}, "task.mode"),
    ({"max_tokens": 0}, "task.max_tokens"),
    ({"limit": -1}, "task.limit"),
])
def test_bad_options_name_the_key(options, key):
    with pytest.raises(ConfigError, match=key):
        build_task("perplexity", **options)


def test_text_file_errors(tmp_path):
    task = build_task("perplexity", dataset="text_file", path=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="no such file"):
        task.check_data()
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        build_task("perplexity", dataset="text_file", path=str(bad)).check_data()
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        build_task("perplexity", dataset="text_file", path=str(empty)).check_data()


def test_prompt_then_streamed_scores_the_same_tokens_as_streaming(stories, data_dir):
    """task.prefill_tokens: with the full cache a prompt of P tokens then streaming gives the
    plain stream's NLL on every token after the prompt (prefill and decode compute the same)."""
    model, tok = stories
    common = dict(dataset="pg19", data_dir=str(data_dir), max_tokens=200, block_tokens=50)
    plain = run_ppl(model, tok, mode="streaming", **common)
    # blocks of 50 scored tokens: the plain stream scores targets 1..199, so its blocks 3 and 4
    # are targets 101..150 and 151..199, exactly the prompted run's two blocks after a 101-token prompt
    prompted = run_ppl(model, tok, mode="streaming", prefill_tokens=101, **common)
    assert prompted.metrics["tokens_scored"] == 200 - 101
    assert prompted.protocol["prefill_tokens"] == 101 and "variant" in prompted.protocol
    assert "variant" not in plain.protocol and plain.protocol["prefill_tokens"] is None
    assert prompted.metrics["nll_per_block"] == pytest.approx(plain.metrics["nll_per_block"][2:],
                                                              abs=2e-4)


def test_prompt_compressor_acts_after_the_prompt(stories, data_dir):
    """A prefill-only method is refused on a plain stream and runs after a prompt: its cache is
    cut to its budget at the prompt's end and the scored tokens differ from the full cache's."""
    from harness.core.engine import Protocol
    from harness.core.hf_adapter import model_info
    from harness.config.runner import protocol_reasons

    model, tok = stories
    info = model_info(model.config)
    snap = build_method("snapkv", budget_ratio=0.25, window_tokens=8)
    plain = build_task("perplexity", mode="streaming")
    assert any("never act" in r for r in protocol_reasons(snap, plain, info, Protocol()))
    prompted = build_task("perplexity", mode="streaming", prefill_tokens=120)
    assert protocol_reasons(snap, prompted, info, Protocol()) == []
    common = dict(dataset="pg19", data_dir=str(data_dir), max_tokens=160, prefill_tokens=120)
    task = build_task("perplexity", mode="streaming", **common)
    engine = make_engine(model, snap, tok, chunk=128)
    res = task.evaluate(engine)
    tokens = engine.ledger.samples[-1]["tokens_per_layer"]
    # 0.25 x 160 (the budget basis: the whole scored text) after the prompt, then 39 streamed
    assert max(tokens) <= 40 + 39
    full = run_ppl(model, tok, mode="streaming", **common)
    assert res.metrics["tokens_scored"] == full.metrics["tokens_scored"] == 40
    assert res.metrics["ppl"] != full.metrics["ppl"]


@pytest.mark.parametrize("options, match", [
    ({"mode": "chunked", "prefill_tokens": 10}, "task.prefill_tokens=10 applies to"),
    ({"prefill_tokens": 0}, "task.prefill_tokens=0 must be"),
])
def test_prefill_tokens_refusals(options, match):
    with pytest.raises(ConfigError, match=match):
        build_task("perplexity", **options)


def test_prefill_tokens_must_leave_tokens_to_stream():
    from methods.model import ModelInfo

    info = ModelInfo(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4, max_positions=512,
                     rope_theta=10000.0)
    task = build_task("perplexity", max_tokens=100, prefill_tokens=99)
    assert "task.prefill_tokens=99 leaves nothing to stream" in task.validate(info, build_method("full"))[0]
