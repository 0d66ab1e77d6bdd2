"""LagKV: partitions scored against the next one's range; sinks and tail kept."""

import pytest
import torch

from kvcore.errors import ConfigError
from methods import build_method
from methods.lagkv import lag_scores
from methods.model import ModelInfo

INFO = ModelInfo(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, max_positions=64)


def compressed(rows: list[list[float]], budget: int, **knobs) -> list[int]:
    """The positions a LagKV layer keeps of tokens whose keys and values are `rows` (D = 2)."""
    layer = build_method("lagkv", **knobs).make_layer(0, INFO)
    x = torch.tensor(rows)[None, None]  # (1, 1, T, 2)
    layer.final_tokens = x.shape[2]
    layer.update(x, x.clone(), None)
    layer.compress_to(budget)
    return sorted(layer.kept_positions()[0, 0].tolist())


@pytest.mark.kept_set
def test_the_tokens_that_stand_out_from_the_next_partition_are_kept():
    """1 sink, partitions of 2: [1, 2] scored against [3, 4]'s range, [3, 4] against [5, 6]'s;
    [5, 6] (no reference) and 7 are the tail. Spreads (std of the min-max normalised channels):
    token 1 [.5, .625] -> .088, token 2 [0, 1.25] -> .884; token 3 [0, 0] -> 0, token 4
    [.5, .4] -> .071. Softmax per partition, keys plus values: 0.62, 1.38, 0.96, 1.04: with a
    budget of 6 (4 protected) tokens 2 and 4 are kept."""
    rows = [[9, 9], [0.5, 0.5], [0, 1], [0, 0], [1, 0.8], [0, 0], [2, 2], [7, 7]]
    assert compressed(rows, 6, sink_tokens=1, lag_size=2) == [0, 2, 4, 5, 6, 7]
    assert compressed(rows, 5, sink_tokens=1, lag_size=2) == [0, 2, 5, 6, 7]


def test_scores_are_per_partition_softmaxes_of_the_spread():
    x = torch.randn(1, 2, 3 + 4 * 5, 8, generator=torch.Generator().manual_seed(0))
    scores = lag_scores(x, sinks=3, lag=5)
    assert torch.all(scores[..., :3] == 0) and torch.all(scores[..., 3 + 15:] == 0)
    sums = scores[..., 3:18].reshape(1, 2, 3, 5).sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums))  # one softmax per scored partition
    ref = x[0, 1, 8:13]
    normed = (x[0, 1, 3:8] - ref.amin(0)) / (ref.amax(0) - ref.amin(0))
    assert torch.allclose(scores[0, 1, 3:8], normed.std(-1).softmax(-1))


def test_a_prompt_shorter_than_two_partitions_keeps_its_sinks_and_tail():
    layer = build_method("lagkv", sink_tokens=2, lag_size=8).make_layer(0, INFO)
    layer.update(torch.zeros(1, 1, 12, 2), torch.zeros(1, 1, 12, 2), None)
    assert layer.protected(6) == (2, 4) and layer.tail_tokens() == 10


@pytest.mark.parametrize("knob, value", [("lag_size", 0), ("sink_tokens", -1), ("lag_size", 2.5)])
def test_bad_knobs_are_refused(knob, value):
    with pytest.raises(ConfigError, match=f"method.{knob}"):
        build_method("lagkv", **{knob: value})
