"""InfiniGen's basic correctness over the model families (tests/models.py): its speculation
reads each family's own query projection (Qwen2's biases, Phi-3's fused qkv_proj, Gemma's
head_dim != hidden / heads) and RoPE frequencies (Qwen2's theta 1e6) through hf_adapter.

Mistral is refused (sliding-window layers; see tests/harness/test_architecture_refusals.py)."""

import pytest
import torch

from harness.core import hf_adapter
from methods import build_method
from methods.scoring import expand_kv
from tests.conftest import make_engine
from tests.models import FAMILIES

SERVED = [f for f in FAMILIES if f != "mistral"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    return tmp_path


def run(model, method, ids, prefill, chunk=16):
    engine = make_engine(model, method, chunk=chunk)
    with engine.request(final_tokens=ids.shape[1]) as req:  # the budget basis: all of ids
        out = [req.prefill(ids[:, :prefill], all_logits=True)]
        out += [req.step(ids[:, t]) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, 1), engine


def decode_and_capture(model, method, ids, inspect):
    """Prefill ids[:, :-1] and decode the last token, capturing layer 2's attention input
    (`x`, `pos`) and the query its attention used (`q`); then `inspect(layer, seen)` inside the
    request (layer 2's state is live), whose result is returned."""
    engine = make_engine(model, method)
    seen = {}

    def grab_input(module, args, kwargs):
        seen["x"], seen["pos"] = kwargs["hidden_states"], kwargs["position_ids"]

    handle = hf_adapter.attention_modules(model)[2].register_forward_pre_hook(grab_input,
                                                                              with_kwargs=True)
    try:
        with engine.request() as req:
            req.prefill(ids[:, :-1])
            layer = req.cache.kv_layers[2]
            attend = layer.attend

            def grab_query(module, query, *args, **kwargs):
                seen["q"] = query
                return attend(module, query, *args, **kwargs)

            layer.attend = grab_query
            req.step(ids[:, -1])
            return inspect(layer, seen)
    finally:
        handle.remove()


@pytest.mark.parametrize("family", SERVED)
def test_system_equals_simulate(family, family_models, cache_dir):
    model = family_models(family, 3)  # layers 0 and 1 dense, layer 2 speculated
    ids = torch.randint(3, 250, (1, 64), generator=torch.Generator().manual_seed(1))
    sim, _ = run(model, build_method("infinigen", mode="simulate"), ids, 40)
    sys_, engine = run(model, build_method("infinigen", mode="system"), ids, 40)
    assert (sim - sys_).abs().max().item() < 1e-4
    assert engine.transfers.bytes_h2d > 0


@pytest.mark.parametrize("family", SERVED)
def test_large_alpha_full_budget_equals_full_in_system_mode(family, family_models, cache_dir):
    model = family_models(family, 3)
    ids = torch.randint(3, 250, (1, 56), generator=torch.Generator().manual_seed(2))
    full, _ = run(model, build_method("full"), ids, 40)
    got, _ = run(model, build_method("infinigen", alpha=1e9, budget_ratio=1.0), ids, 40)
    assert (got - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("select_per", ["query_head", "kv_head"])
@pytest.mark.parametrize("family", SERVED)
def test_speculation_from_own_input_with_all_columns_selects_the_true_top_tokens(
        family, select_per, family_models, cache_dir):
    """partial_ratio=1: the skewed partial score is q . k exactly (A is orthogonal). Fed layer
    2's own input, speculation must pick the top tokens of the query the model itself used
    (captured at attention: bias, fused projection, RoPE theta and head_dim all the model's)."""
    model = family_models(family, 3)
    info = hf_adapter.model_info(model.config)
    method = build_method("infinigen", partial_ratio=1.0, alpha=1e9, budget_ratio=0.25,
                          mode="simulate", select_per=select_per)
    ids = torch.randint(3, 250, (1, 41), generator=torch.Generator().manual_seed(3))

    def inspect(layer, seen):
        slots, counts = layer.speculate(seen["x"], seen["pos"])  # best first, how many
        # simulate mode keeps the keys (1, H_kv, 41, D) on the device
        return slots[..., : int(counts.max())].sort(-1).values, layer.keys, seen["q"]

    chosen, keys, query = decode_and_capture(model, method, ids, inspect)
    logits = (query.float() @ expand_kv(keys, info.group_size).float().transpose(2, 3))[:, :, 0]
    per_head = (logits if select_per == "query_head"
                else logits.view(1, info.num_kv_heads, info.group_size, 41).amax(2))
    expected = per_head.topk(int(0.25 * 41), dim=-1).indices.sort(-1).values
    assert torch.equal(chosen, expected)


@pytest.mark.parametrize("select_per", ["query_head", "kv_head"])
@pytest.mark.parametrize("family", ["llama", "granite"])
def test_speculated_count_is_in_the_models_own_logits(family, select_per, family_models,
                                                      cache_dir):
    """alpha is a margin in the logits the model's attention uses: q.k times ITS scaling
    (Granite: attention_multiplier, not head_dim ** -0.5). With exact scores (partial_ratio=1),
    the count above max - alpha per selecting head (a query head, or a KV head by the group's
    max), floor-averaged over heads, is the speculated count (our per-head threshold over the
    stored tokens, so that the count is read at speculation)."""
    model = family_models(family, 3)
    info = hf_adapter.model_info(model.config)
    method = build_method("infinigen", partial_ratio=1.0, budget_ratio=1.0, mode="simulate",
                          select_per=select_per, head0_threshold=False, current_token="added")
    ids = torch.randint(3, 250, (1, 41), generator=torch.Generator().manual_seed(4))
    scaling = hf_adapter.attention_modules(model)[2].scaling

    def inspect(layer, seen):
        logits = (seen["q"].float() @ expand_kv(layer.keys, info.group_size).float()
                  .transpose(2, 3))[:, :, 0] * scaling  # (1, H_q, 41)
        per_kv = (logits[0] if select_per == "query_head"
                  else logits.view(info.num_kv_heads, info.group_size, 41).amax(1))
        ranked = per_kv[0].sort(descending=True).values  # head 0 counts exactly 14
        method.alpha = float(ranked[0] - (ranked[13] + ranked[14]) / 2)
        return per_kv, layer.speculate(seen["x"], seen["pos"])[1]

    per_kv, counts = decode_and_capture(model, method, ids, inspect)
    per_head = (per_kv > per_kv.amax(-1, keepdim=True) - method.alpha).sum(-1)  # (H_kv,)
    assert per_head[0] == 14
    expected = int(per_head.float().mean().floor().clamp(1, 41))
    heads = info.num_heads if select_per == "query_head" else info.num_kv_heads
    assert counts.flatten().tolist() == [expected] * heads
