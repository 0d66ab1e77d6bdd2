"""Every method's layers declare their per-request state (`KVLayer.state_fields`): after a
request, each attribute they do not declare still holds what a fresh layer of the same engine
holds (so `adopt` may keep the adopting layer's own), and a request rewound to a snapshot
(`KVLayer.fork` / `adopt`) continues bit for bit; a layer that cannot be forked says why."""

import pytest
import torch

from harness import hf_adapter
from kvcore.storage import Rows
from methods import build_method, method_class
from methods.protocol import Protocol
from tests.conftest import make_engine
from tests.methods.contract.common import METHODS, get_model, skip_if_refused

PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, Protocol)


def same(a, b, swap: dict[int, object]) -> bool:
    """`a` (a used layer's attribute) equals `b` (a fresh layer's), layers mapped by `swap`."""
    if id(a) in swap:
        return swap[id(a)] is b
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, PLAIN):
        return a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, swap) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], swap) for k in a)
    if isinstance(a, Rows):
        return a.length == b.length == 0
    return False


def undeclared_changes(used, fresh) -> list[str]:
    """`Class.attribute` of every attribute a used layer holds otherwise than a fresh one, but
    its declared state."""
    swap = {id(a): b for a, b in zip(used, fresh)}
    changed = []
    for a, b in zip(used, fresh):
        if type(a).unforkable is not None:  # never forked: nothing is adopted
            continue
        state = set(type(a).state_names())
        for name, value in vars(a).items():
            if name not in state and not (name in vars(b) and same(value, vars(b)[name], swap)):
                changed.append(f"{type(a).__name__}.{name}")
    return sorted(set(changed))


@pytest.mark.parametrize("name", METHODS)
def test_layers_fork_their_declared_state(name, request, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the state, not the kernels: CPU paths
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model = get_model("llama", request, layers=4)
    method = build_method(name, **method_class(name).compressing_hyperparameters(48))
    skip_if_refused(method, model)
    engine = make_engine(model, method)
    ids = torch.randint(3, 250, (48,), generator=torch.Generator().manual_seed(0))
    with engine.request() as req:
        req.prefill(ids[:36])
        for t in ids[36:40]:  # decode steps before the snapshot: state past the prompt
            req.step(t)
        fresh = hf_adapter.MethodCache(method, engine.info, engine.tier,
                                       engine.settings.protocol).kv_layers
        changed = undeclared_changes(req.cache.kv_layers, fresh)
        assert not changed, (f"{name}: per-request state not declared in state_fields: "
                             f"{', '.join(changed)}")
        snap = req.snapshot()
        if snap is None:
            reasons = [kv.fork_refusal() for kv in req.cache.kv_layers]
            assert any(reasons), f"{name}: no snapshot, and no layer says why"
            return
        later = [req.step(t) for t in ids[40:46]]
        req.restore(snap)
        again = [req.step(t) for t in ids[40:46]]
        req.restore(snap, consume=True)
        consumed = [req.step(t) for t in ids[40:46]]
    assert all(torch.equal(a, b) for a, b in zip(later, again)), f"{name}: rewound differently"
    assert all(torch.equal(a, b) for a, b in zip(later, consumed)), f"{name}: consumed differently"
