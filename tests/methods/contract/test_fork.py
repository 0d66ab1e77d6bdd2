"""Every method's layers declare their per-request state (`KVLayer.state_fields`): after a
request, each attribute they do not declare still holds what a fresh layer of the same engine
holds (so `adopt` may keep the adopting layer's own), and a request rewound to a snapshot
(`KVLayer.fork` / `adopt`) continues bit for bit; a layer that cannot be forked says why.

A sweep hands one prompt state to settings differing only in prompt-end knobs when their fresh
layers' `prompt_state_key`s agree; the key reads the declared state, so every other attribute of
those layers (built from the method) must agree too: checked for each prompt-end knob."""

import pytest
import torch

from harness.core import hf_adapter
from kvcore.storage import Rows
from kvcore.errors import ConfigError
from methods import build_method, method_class
from methods.model import ModelInfo
from methods.protocol import Protocol
from tests.conftest import make_engine
from tests.methods.contract.common import METHODS, get_model, skip_if_refused
from tests.methods.contract.knobs import alternatives

# immutable values compared by value (ModelInfo: each fresh set of layers may get its own)
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, Protocol, ModelInfo)


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


def undeclared_changes(used, fresh, swap: dict[int, object] | None = None) -> list[str]:
    """`Class.attribute` of every attribute a used layer holds otherwise than a fresh one, but
    its declared state (`swap`: objects of `used`'s side standing for others of `fresh`'s)."""
    swap = {**(swap or {}), **{id(a): b for a, b in zip(used, fresh)}}
    changed = []
    for a, b in zip(used, fresh):
        if type(a).unforkable is not None:  # never forked: nothing is adopted
            continue
        state = set(type(a).state_names())
        for name, value in vars(a).items():
            if name not in state and not (name in vars(b) and same(value, vars(b)[name], swap)):
                changed.append(f"{type(a).__name__}.{name}")
    return sorted(set(changed))


def compressing_engine(name, request, monkeypatch, tmp_path, seed: int):
    """An engine of the method compressing 48 tokens on a 4-layer llama, and 48 token ids."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the state, not the kernels: CPU paths
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model = get_model("llama", request, layers=4)
    method = build_method(name, **method_class(name).compressing_hyperparameters(48))
    skip_if_refused(method, model)
    ids = torch.randint(3, 250, (48,), generator=torch.Generator().manual_seed(seed))
    return make_engine(model, method), method, ids


@pytest.mark.parametrize("name", METHODS)
def test_layers_fork_their_declared_state(name, request, monkeypatch, tmp_path):
    engine, method, ids = compressing_engine(name, request, monkeypatch, tmp_path, seed=0)
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


@pytest.mark.parametrize("name", METHODS)
def test_a_prompt_state_forked_before_its_end_compresses_as_its_own(name, request, monkeypatch,
                                                                  tmp_path):
    """A sweep forks the state a layer holds while the prompt is fed, and each setting adopts a
    copy and compresses it (`close_prompt`): that copy must compress and decode as the original
    does. Catches state that aliases other state (a view of the rows) and loses it in the copy."""
    engine, _, ids = compressing_engine(name, request, monkeypatch, tmp_path, seed=1)
    with engine.request() as req:
        req.feed_prompt(ids[:40])
        snap = req.snapshot()
        if snap is None:
            pytest.skip(f"{name}: its prompt state is not forked (a sweep replays it)")
        req.close_prompt()
        own = [req.step(t) for t in ids[40:46]]
    for consume in (False, True):
        with engine.request() as req:
            req.restore(snap, consume=consume)
            req.close_prompt()
            adopted = [req.step(t) for t in ids[40:46]]
        assert all(torch.equal(a, b) for a, b in zip(own, adopted)), \
            f"{name}: an adopted prompt state (consume={consume}) compressed differently"


PROMPT_END = [pytest.param(name, knob, id=f"{name}.{knob}") for name in METHODS
              for knob in method_class(name).prompt_end_knobs]


def fresh_layers(model, method):
    info = hf_adapter.model_info(model.config)
    if method.needs_prepare():
        hf_adapter.prepare(method, model, None, info)
    return hf_adapter.MethodCache(method, info, None, Protocol()).kv_layers


@pytest.mark.parametrize("name, knob", PROMPT_END)
def test_equal_prompt_state_keys_mean_equal_layers(name, knob, request, monkeypatch, tmp_path):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model = get_model("llama", request, layers=4)
    lead = build_method(name)
    mine = fresh_layers(model, lead)
    value = getattr(lead, knob)
    unset_size = {"_ratio": [0.2, 0.5], "_tokens": [16, 64]}  # a budget left unset by default
    extra = next((v for end, v in unset_size.items() if value is None and knob.endswith(end)), [])
    compared = 0
    for value in [*alternatives(name, knob, value, {}), *extra]:
        try:
            other = build_method(name, **{knob: value})
        except (ConfigError, TypeError, ValueError):
            continue
        try:
            theirs = fresh_layers(model, other)
        except ConfigError:  # refused once prepared (a budget below the realised head share)
            continue
        keys = [kv.prompt_state_key() for kv in mine], [kv.prompt_state_key() for kv in theirs]
        if None in keys[0] or keys[0] != keys[1]:
            continue  # never shared
        compared += 1
        changed = undeclared_changes(mine, theirs, {id(lead): other})
        assert not changed, (f"method.{knob}={value!r}: {name}'s fresh layers agree in their "
                             f"prompt-state keys but differ in {', '.join(changed)}")
    if not compared:
        pytest.skip(f"{name}: no other value of method.{knob} shares its prompt state")
