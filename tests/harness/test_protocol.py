"""The run protocol and the one accounting: the same dense layers, prefill mode and figures for
every method; combinations that cannot act are refused, runs that did not act are flagged."""

from dataclasses import dataclass

import json

import pytest
import torch

from harness.core.accounting import activity
from harness.run import run
from kvcore.errors import BudgetViolation, ConfigError
from methods import build_method
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.layer import FullLayer, KVLayer
from methods.protocol import Protocol
from tests.conftest import STORIES, make_engine, need_shared
from tests.helpers.runs import cfg_for


def _ids(n, seed=0):
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def test_dense_layers_apply_to_every_selecting_method(tiny_model):
    """runner.dense_layers makes the same layers full for H2O and the oracle, and the accounting
    separates them: sparse-layer fraction near the budget, the dense layer at 1.0."""
    ids = _ids(60)
    for name in ("h2o", "oracle_topk"):
        engine = make_engine(tiny_model, build_method(name, budget_tokens=8),
                             protocol=Protocol(dense_layers=(0,)))
        with engine.request() as req:
            req.prefill(ids[:, :40])
            for t in range(40, 60):
                req.step(ids[:, t])
            assert type(req.cache.kv_layers[0]) is FullLayer  # the full cache
            assert req.cache.kv_layers[0].kept_tokens() == 60
        summary = engine.attended.summary()
        assert summary["attended_fraction_per_layer"][0] == 1.0
        expected = sum(min(9, t) for t in range(41, 61)) / sum(range(41, 61))
        assert abs(summary["attended_fraction_sparse_layers"] - expected) < 0.03, name
        assert summary["attended_fraction_all_layers"] > summary["attended_fraction_sparse_layers"]
        assert engine.dense_layers == (0,)


def test_infinigen_own_dense_layers_join_the_protocol(tiny_model):
    method = build_method("infinigen", dense_layers=[1])
    engine = make_engine(tiny_model, method, protocol=Protocol(dense_layers=()))
    assert engine.dense_layers == (0, 1)  # layer 0 is structural, 1 its own knob


def test_sparse_prefill_equals_feeding_the_prompt_as_decode_steps(tiny_model):
    """prefill=sparse: every prompt row attends under the budget, exactly as decode steps would;
    prefill=dense: the last prompt row attends the whole prompt (equals the full cache)."""
    ids = _ids(40)
    method = build_method("h2o", budget_tokens=8)
    sparse = make_engine(tiny_model, method, protocol=Protocol(prefill="sparse"))
    stepped = make_engine(tiny_model, method)
    dense = make_engine(tiny_model, method)
    full = make_engine(tiny_model, build_method("full"))
    with sparse.request() as a, stepped.request() as b, dense.request() as c, full.request() as d:
        la = a.prefill(ids)
        for t in range(40):
            lb = b.step(ids[:, t])
        lc, ld = c.prefill(ids), d.prefill(ids)
    assert torch.allclose(la, lb, atol=1e-5)
    assert torch.allclose(lc, ld, atol=1e-5)  # dense prefill: the last row saw every token
    assert not torch.allclose(la, ld, atol=1e-3)  # sparse prefill: it did not
    assert sparse.attended.steps == 0  # prompt rows are not decode steps in the accounting


class _PrefillOnlyLayer(KVLayer):
    pass


@dataclass(kw_only=True)
class _PrefillOnly(KVMethod):
    name = "prefill_only_for_test"
    capabilities = Capabilities(acts_during_decode=False, prefill_modes=("dense",))


def test_refusals_name_the_knob_before_weights(monkeypatch, no_weight_loading, tmp_path):  # noqa: F811
    import methods

    need_shared(STORIES)
    real = methods.build_method
    monkeypatch.setattr(methods, "build_method", lambda name, **kw: (
        _PrefillOnly() if name == "full" else real(name, **kw)))
    base = ["model=stories260k", "task.max_tokens=100", f"runner.results_root={tmp_path}"]
    with pytest.raises(ConfigError, match="compresses only over a prefilled prompt, but task=perplexity"):
        run(cfg_for(*base))
    with pytest.raises(ConfigError, match="scores only prompt tokens"):
        run(cfg_for(*base, "task.mode=chunked"))
    with pytest.raises(ConfigError, match=r"runner.prefill=sparse but method=prefill_only_for_test"):
        run(cfg_for(*base, "task.mode=chunked", "runner.prefill=sparse"))
    with pytest.raises(ConfigError, match=r"names layer\(s\) \[7\] but the model has 5 layers"):
        run(cfg_for(*base, "method=h2o", "runner.dense_layers=[0,7]"))
    with pytest.raises(ConfigError, match="runner.dense_layers=3 must be a list"):
        run(cfg_for(*base, "method=h2o", "runner.dense_layers=3"))
    with pytest.raises(ConfigError, match="runner.prefill='half'; allowed: dense, chunked, sparse"):
        run(cfg_for(*base, "method=h2o", "runner.prefill=half"))
    with pytest.raises(ConfigError, match="runner.budget_basis='end'; allowed: final, seen"):
        run(cfg_for(*base, "method=h2o", "runner.budget_basis=end"))
    # dense prefill compresses a prompt once it is over: a task scoring only prompt tokens would
    # never see any method act (chunked / sparse prefill make it act inside the prompt)
    with pytest.raises(ConfigError, match="runner.prefill=dense: every method .* method=h2o "
                                          "would never act"):
        run(cfg_for(*base, "method=h2o", "task.mode=chunked"))
    with pytest.raises(ConfigError, match="runner.prefill=chunked but method=snapkv can only run "
                                          "with runner.prefill=dense"):
        run(cfg_for(*base, "method=snapkv", "task.prefill_tokens=50", "runner.prefill=chunked"))
    assert not any(tmp_path.iterdir())


def test_a_method_that_did_not_act_is_flagged(tmp_path):
    """KIVI on a text shorter than its full-precision residual quantizes nothing: recorded as
    inactive with the reason, never as a plain result."""
    need_shared(STORIES)
    out = run(cfg_for("model=stories260k", "method=kivi", "task.max_tokens=100",
                      f"runner.results_root={tmp_path}"))
    kv = json.loads((out / "metrics.json").read_text())["kv"]
    assert kv["method_active"] is False and "too short" in kv["inactive_reason"]
    out = run(cfg_for("model=stories260k", "method=h2o", "task.max_tokens=100",
                      f"runner.results_root={tmp_path}"))
    kv = json.loads((out / "metrics.json").read_text())["kv"]
    assert kv["method_active"] is True and kv["held_ratio"] < 0.3
    assert activity(False, {"held_ratio": 1.0})["method_active"] is None  # references


def test_a_layer_holding_less_than_its_full_cache_is_activity():
    """TailorKV at a budget covering the text: its sparse layers keep a full host copy (held
    1.03 of the full bytes in total) and attend every token, but its quantized layers hold a
    quarter of theirs: the method acted. Every layer at its full bytes: it did not."""
    full = 4_000.0
    tailor = {"held_ratio": 1.03, "attended_fraction_sparse_layers": 1.0, "full_cache_bytes": full,
              "bytes_per_layer": [1_000.0, 250.0, 1_560.0, 1_310.0], "decode_steps_accounted": 9}
    assert activity(True, tailor) == {"method_active": True, "inactive_reason": None}
    idle = {**tailor, "held_ratio": 1.0, "bytes_per_layer": [1_000.0] * 4}
    got = activity(True, idle)
    assert got["method_active"] is False and "every layer" in got["inactive_reason"]


class _OverBudgetMidway(KVLayer):
    """Within budget when the request ends, over it for a few steps in between."""

    def allowed_tokens(self):
        return 12

    def after_forward(self):
        if self.seen_tokens >= 20 and self.kept_tokens() > 10:  # evicts late
            self.keys, self.values = self.keys[:, :, -10:], self.values[:, :, -10:]


@dataclass(kw_only=True)
class _Late(KVMethod):
    name = "late_for_test"

    def make_layer(self, layer_idx, info):
        return _OverBudgetMidway(layer_idx, info)


def test_budgets_are_checked_at_every_step(tiny_model):
    engine = make_engine(tiny_model, _Late(), chunk=4)
    with pytest.raises(BudgetViolation, match="holds 16 KV tokens but its budget is 12 after 16"):
        with engine.request() as req:
            req.prefill(_ids(30))


@pytest.mark.parametrize("basis", ["final", "seen"])
def test_a_ratio_budget_is_a_fraction_of_the_protocols_basis(basis, tiny_model):
    """budget_ratio 0.2 over a 100-token stream: "final" = 20 tokens from the first token (dense
    until 20 are held, then 20: InfiniGen's mask simulation), "seen" = int(0.2 x seen)."""
    method = build_method("h2o", budget_ratio=0.2)
    engine = make_engine(tiny_model, method, protocol=Protocol(budget_basis=basis))
    kept = []
    with engine.request(final_tokens=100) as req:
        for t in range(100):
            req.step(_ids(100)[:, t])
            kept.append(req.cache.kv_layers[0].kept_tokens())
    expected = [min(t + 1, 20) if basis == "final" else min(t + 1, max(2, int(0.2 * (t + 1))))
                for t in range(100)]
    assert kept == expected


def test_a_prompt_sets_the_basis_and_a_stream_must_declare_one(tiny_model):
    """A prompt of 50 sets the basis to 50 (budget 10, then constant while decoding); a stream of
    decode steps with no declared length cannot size a ratio budget: one clear error."""
    engine = make_engine(tiny_model, build_method("h2o", budget_ratio=0.2))
    with engine.request() as req:
        req.prefill(_ids(50))
        for t in range(10):
            req.step(_ids(10)[:, t])
            assert [kv.allowed_tokens() for kv in req.cache.kv_layers] == [10, 10]
    with pytest.raises(RuntimeError, match="needs the sequence's final length"):
        with engine.request() as req:
            req.step(_ids(1))
