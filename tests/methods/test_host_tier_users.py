"""Every layer that keeps K/V on the host tier keeps it in its host store (KVLayer.host_kv,
kvcore.offload.HostKVStore), never in tensors of its own: checked on the source (no method file
pins memory, allocates tier buffers, copies between tiers or touches the transfer ledger itself)
and on runs (every tier copy and ledger entry of an offloading method comes from kvcore, and the
bytes a layer reports held off the device are its host store's)."""

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from harness.core.engine import Engine
from kvcore.offload import Tier, TransferLedger
from methods import available_methods, build_method, method_class
from methods.kivi import KIVILayer
from tests.conftest import make_engine

ROOT = Path(__file__).resolve().parents[2]

# What only the host tier does: make a store, allocate its (pinned) buffers, copy host->device,
# count bytes moved.
STORE_CLASSES = {"HostKVStore", "PagedHostKVStore", "host_store"}
TIER_ATTRIBUTES = {"host_tensor", "to_device", "pin_memory", "ledger"}

# The only places in methods/ allowed to do so, each with why. KVLayer.host_kv is the door every
# layer goes through. KIVI's offloaded quantized codes are not K/V rows (packed keys grow along
# their last axis in blocks of R tokens, values per token in three parts) and keep a copy path of
# their own; moving them onto the host store is work still to do, and this list must then shrink.
ALLOWED = {
    ("methods/layer.py", "KVLayer.host_kv", "host_store"),
    ("methods/kivi.py", "KIVILayer._fetch", "to_device"),
    ("methods/kivi.py", "KIVILayer._to_host", "ledger"),
    ("methods/kivi.py", "KIVILayer._store_keys", "pin_memory"),
    ("methods/kivi.py", "KIVILayer._store_values", "TokenMajorRows(pinned)"),
}
ALLOWED_CALLERS = {(path, qualname.split(".")[-1]) for path, qualname, _ in ALLOWED}


class _TierUse(ast.NodeVisitor):
    """(qualified name of the enclosing function, what) for each host-tier operation."""

    def __init__(self):
        self.scope: list[str] = []
        self.found: list[tuple[str, str]] = []

    def _enter(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def _note(self, what: str) -> None:
        self.found.append((".".join(self.scope) or "<module>", what))

    def visit_Attribute(self, node):
        if node.attr in TIER_ATTRIBUTES:
            self._note(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in STORE_CLASSES:
            self._note(name)
        if name == "TokenMajorRows" and (node.args or node.keywords):  # its pinned host rows
            self._note("TokenMajorRows(pinned)")
        if any(k.arg == "pin_memory" for k in node.keywords):
            self._note("pin_memory")
        self.generic_visit(node)


def tier_uses(source: str) -> list[tuple[str, str]]:
    visitor = _TierUse()
    visitor.visit(ast.parse(source))
    return visitor.found


def test_the_scan_finds_a_layer_keeping_host_kv_of_its_own():
    """What a private host copy needs (pinned buffers, tier copies, ledger counts, a store of its
    own) is each found, in its function."""
    source = '''
class PrivateLayer:
    def update(self, keys):
        self.host_k = torch.empty(keys.shape, pin_memory=True)
        self.host_v = keys.to("cpu").pin_memory()
        self.tier.ledger.d2h(keys.nbytes)
        self.store = HostKVStore(self.tier, 0)
        return self.tier.to_device(0, self.host_k).wait()

    def grow(self, new):
        self.tier_rows = kvcore.offload.host_store(self.tier, 0)
        self.buf = self.tier.host_tensor((4, 1, 1, 8), torch.float32)
'''
    assert sorted(tier_uses(source)) == sorted([
        ("PrivateLayer.update", "pin_memory"), ("PrivateLayer.update", "pin_memory"),
        ("PrivateLayer.update", "ledger"), ("PrivateLayer.update", "HostKVStore"),
        ("PrivateLayer.update", "to_device"), ("PrivateLayer.grow", "host_store"),
        ("PrivateLayer.grow", "host_tensor")])


def test_no_method_keeps_host_kv_outside_the_host_tier():
    found = set()
    for path in sorted((ROOT / "methods").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found |= {(rel, scope, what) for scope, what in tier_uses(path.read_text())}
    assert found - ALLOWED == set(), "host-resident K/V outside KVLayer.host_kv (kvcore.offload)"
    assert ALLOWED - found == set(), "an allowed use is gone: drop it from ALLOWED"


# --- on runs --------------------------------------------------------------------------------------
OFFLOADING = [n for n in available_methods() if method_class(n).capabilities.offloads_kv]
PROMPT_TOKENS, DECODE_STEPS = 44, 8


def cases():
    """(method, mode, layout): every offloading method in each of its modes and layouts."""
    out = []
    for name in OFFLOADING:
        cls = method_class(name)
        modes = cls.capabilities.modes if "mode" in cls.hyperparameter_names() else (None,)
        out += [(name, mode, layout) for mode in modes for layout in cls.capabilities.kv_layouts]
    return out


def record_callers(monkeypatch) -> list[tuple[str, str, str]]:
    """Spy on the tier's allocations, copies and counts: (what, caller's file, caller's function)."""
    calls = []

    def spy(cls, name):
        real = getattr(cls, name)

        def wrapped(*args, **kwargs):
            frame = sys._getframe(1)
            while frame.f_code.co_name.startswith("<") and frame.f_code.co_name != "<module>":
                frame = frame.f_back  # a comprehension: the function it runs in
            path = Path(frame.f_code.co_filename).resolve()
            where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            calls.append((name, where, frame.f_code.co_name))
            return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)

    for name in ("host_tensor", "to_device"):
        spy(Tier, name)
    for name in ("d2h", "h2d"):
        spy(TransferLedger, name)
    return calls


def host_held_bytes(layer) -> int:
    """Bytes a layer reports held off the compute device."""
    stats = layer.stats()
    return stats.get("kv_bytes", 0) - stats.get("kv_bytes_device", stats.get("kv_bytes", 0))


@pytest.fixture
def model(family_models, monkeypatch, tmp_path):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))  # prepared artefacts stay in the test
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return family_models("llama", 3)


@pytest.mark.parametrize("name, mode, layout", cases())
def test_offloading_runs_move_and_hold_host_kv_only_through_the_host_tier(name, mode, layout,
                                                                          model, monkeypatch):
    method = build_method(name, **method_class(name).compressing_hyperparameters(
        PROMPT_TOKENS + DECODE_STEPS), **({"mode": mode} if mode else {}))
    built = make_engine(model, method, chunk=16)
    offload = "none" if mode == "system" else "cpu"  # InfiniGen's system mode is on the host
    settings = dataclasses.replace(built.settings, kv_layout=layout, kv_offload=offload,
                                   kv_block_tokens=8)
    engine = Engine(model, None, method, built.info, settings)
    calls = record_callers(monkeypatch)
    prompt = torch.randint(3, 250, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(4))
    held_on_host = 0
    with engine.request() as req:
        token = int(req.prefill(prompt.tolist())[0, -1].argmax())
        for _ in range(DECODE_STEPS):
            token = int(req.step(token)[0, -1].argmax())
            for layer in req.cache.kv_layers:
                if isinstance(layer, KIVILayer):  # its quantized codes: see ALLOWED
                    continue
                store = 0 if layer.host is None else layer.host.nbytes()
                assert host_held_bytes(layer) == store, (name, layer.layer_idx)
                held_on_host += store
    outside = {(what, path, fn) for what, path, fn in calls
               if not path.startswith("kvcore/") and (path, fn) not in ALLOWED_CALLERS}
    assert outside == set(), f"{name}: tier operations outside kvcore"
    if mode == "simulate":  # InfiniGen's simulation keeps every token on the device
        assert held_on_host == 0 and not calls
    elif not all(isinstance(layer, KIVILayer) for layer in req.cache.kv_layers):
        assert held_on_host > 0, f"{name} held nothing on the host tier"
        assert any(what == "to_device" for what, _, _ in calls), f"{name} moved nothing"
