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
    """models-and-data.md: PG-19 first book, first 512 tokens (BOS included) -> 48.61."""
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
    assert abs(expected - 14.09) < 0.05  # models-and-data.md reference value


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
