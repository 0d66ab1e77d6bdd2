"""R-KV: at the prompt's end and every `buffer_tokens` tokens after it, the window plus the top of
lambda x pooled window attention - (1 - lambda) x key redundancy, per KV head."""

import pytest
import torch

from harness.config.runner import decode_interval_reasons
from methods import build_method
from methods.model import ModelInfo
from methods.protocol import Protocol

D, H_Q, H_KV = 8, 4, 2


def no_attention(module, query, keys, values, mask, **kwargs):
    return None, None


def hand_kept(queries, keys, budget, window, kernel, lam, threshold=0.5):
    """The official `R1KV.update_kv` written out with loops over a cache in text order: window
    rows `queries (H_q, w, D)`, `keys (H_kv, n, D)`; returns the kept indices per KV head."""
    g, n = H_Q // H_KV, keys.shape[1]
    kept = []
    for kv in range(H_KV):
        importance = torch.zeros(n - window)
        for i in range(window):
            logits = torch.stack([torch.tensor([
                max(float(queries[h, i] @ keys[kv, j]) for h in range(kv * g, (kv + 1) * g))
                / D ** 0.5 for j in range(n - window)])])[0]
            importance += torch.softmax(logits, -1) / window
        pooled = torch.tensor([importance[max(0, j - kernel // 2): j + kernel // 2 + 1].max()
                               for j in range(n - window)])
        unit = keys[kv] / (keys[kv].norm(dim=-1, keepdim=True) + 1e-8)
        cos = unit @ unit.T
        for i in range(n):
            cos[i, i] = 0.0
        for i in range(n):  # the most recent near-duplicate of row i (slot 0 when none)
            similar = [j for j in range(n) if cos[i, j] > threshold]
            cos[i, max(similar) if similar else 0] = 0.0
        redundancy = torch.softmax(torch.tensor([float(cos[:, j].sum()) / n for j in range(n)]), -1)
        final = lam * pooled - (1 - lam) * redundancy[: n - window]
        top = final.topk(budget - window).indices.tolist()
        kept.append(sorted(top + list(range(n - window, n))))
    return kept


def near_duplicate_keys(n, seed):
    """Random keys, a third of them near copies of earlier ones (so redundancy has work)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(H_KV, n, D, generator=gen)
    for j in range(3, n, 3):
        keys[:, j] = keys[:, j - 3 + j % 2] + 0.1 * torch.randn(H_KV, D, generator=gen)
    return keys


def feed(layer, queries, keys, chunks):
    for start, stop in chunks:
        k, v = layer.update(keys[None, :, start:stop], keys[None, :, start:stop], None)
        layer.attend(None, queries[None, :, start:stop], k, v, None, no_attention,
                     scaling=D ** -0.5)
        layer.after_forward()


@pytest.mark.kept_set
@pytest.mark.parametrize("lam", [0.07, 0.5])
def test_kept_set_equals_a_hand_computation_at_the_prompt_end_and_after_the_buffer(lam):
    n, window, budget, kernel, buffer = 24, 4, 11, 3, 5
    info = ModelInfo(num_layers=1, num_heads=H_Q, num_kv_heads=H_KV, head_dim=D, max_positions=64)
    method = build_method("rkv", budget_tokens=budget, window_tokens=window, kernel_tokens=kernel,
                          mix_lambda=lam, buffer_tokens=buffer)
    layer = method.make_layer(0, info)
    queries = torch.randn(H_Q, n + buffer, D, generator=torch.Generator().manual_seed(3))
    keys = near_duplicate_keys(n + buffer, seed=4)
    layer.prompt_open = True
    feed(layer, queries, keys, [(0, 9), (9, 23), (23, 24)])  # the chunking must not matter
    layer.prompt_open = False
    layer.on_prefill_end()
    kept = [sorted(p.tolist()) for p in layer.positions[0]]
    assert kept == hand_kept(queries[:, n - window:n], keys[:, :n], budget, window, kernel, lam)
    assert kept != hand_kept(queries[:, n - window:n], keys[:, :n], budget, window, kernel, 1.0)

    # decoding appends until `buffer` tokens have come, then compresses the held tokens again
    held = [sorted(p.tolist()) for p in layer.positions[0]]
    feed(layer, queries, keys, [(i, i + 1) for i in range(n, n + buffer - 1)])
    assert layer.kept_tokens() == budget + buffer - 1 == layer.allowed_tokens()
    feed(layer, queries, keys, [(n + buffer - 1, n + buffer)])
    assert layer.kept_tokens() == budget
    for h in range(H_KV):  # the hand computation over the held tokens, in text order
        order = held[h] + list(range(n, n + buffer))
        sub = keys[:, order]
        expected = hand_kept(queries[:, n + buffer - window:n + buffer], sub, budget, window,
                             kernel, lam)[h]
        assert sorted(layer.positions[0, h].tolist()) == [order[j] for j in expected]


def test_compressing_needs_a_full_budget_and_keeps_the_positions():
    info = ModelInfo(num_layers=1, num_heads=H_Q, num_kv_heads=H_KV, head_dim=D, max_positions=64)
    layer = build_method("rkv", budget_tokens=12, window_tokens=4).make_layer(0, info)
    queries, keys = torch.randn(H_Q, 10, D), near_duplicate_keys(10, seed=1)
    layer.prompt_open = True
    feed(layer, queries, keys, [(0, 10)])
    layer.prompt_open = False
    layer.on_prefill_end()  # 10 < 12: nothing to drop
    assert layer.positions[0, 0].tolist() == list(range(10))
    assert torch.equal(layer.keys[0], keys)


def test_bad_knobs_and_the_runner_interval_are_refused():
    for knob, value in (("window_tokens", 0), ("buffer_tokens", -1), ("kernel_tokens", 4),
                        ("mix_lambda", 1.5), ("similarity_threshold", -0.1)):
        with pytest.raises(Exception, match=f"method.{knob}="):
            build_method("rkv", **{knob: value})

    class Task:
        name = "t"

        def phases(self):
            return frozenset({"prefill", "decode"})

    (reason,) = decode_interval_reasons(build_method("rkv"), Task(),
                                        Protocol(decode_interval_tokens=64))
    assert "its own rule" in reason and "runner.decode_interval_tokens=null" in reason
