"""Contract test of the transformers seams we rely on (upgrading transformers breaks this first)."""

import dataclasses
import inspect

import pytest
import torch
import transformers

from harness.core import hf_adapter
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.layer import KVLayer
from tests.conftest import make_engine
from methods.rope import rotate
from tests.models import FAMILIES, tiny_family_model


def test_pinned_transformers_version():
    assert transformers.__version__ == "5.24.0"


class _Recorder(KVLayer):
    events: list = []

    def mask_sizes(self, q_len):
        self.events.append(("mask", self.layer_idx, q_len))
        return super().mask_sizes(q_len)

    def update(self, keys, values, position_ids):
        self.events.append(("update", self.layer_idx, keys.shape, None if position_ids is None
                            else position_ids.tolist()))
        return super().update(keys, values, position_ids)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        self.events.append(("attend", module.layer_idx, query.shape, keys.shape, sorted(kwargs)))
        assert module.layer_idx == self.layer_idx
        assert hasattr(module, "num_key_value_groups") and hasattr(module, "scaling")
        return super().attend(module, query, keys, values, attention_mask, base, **kwargs)


class _RecorderMethod(KVMethod):
    name = "recorder"

    def make_layer(self, layer_idx, info):
        return _Recorder(layer_idx, info)


def test_update_precedes_attention_with_positions_and_kwargs(tiny_model):
    _Recorder.events = []
    engine = make_engine(tiny_model, _RecorderMethod(), chunk=4)
    with engine.request() as req:
        req.prefill(torch.arange(3, 9))  # chunks of 4 + 2
        req.step(9)
    ev = [e for e in _Recorder.events if e[1] == 0]
    kinds = [e[0] for e in ev]
    # every forward: mask sizes are asked before update (by the model for layer 0, and by the
    # bridge for every layer's own mask), update before attention
    assert kinds[:4] == ["mask", "mask", "update", "attend"]
    updates = [e for e in ev if e[0] == "update"]
    assert [u[3] for u in updates] == [[[0, 1, 2, 3]], [[4, 5]], [[6]]]
    attends = [e for e in ev if e[0] == "attend"]
    assert attends[0][2] == (1, 4, 4, 16) and attends[0][3] == (1, 2, 4, 16)  # (B,H_q,q,D)/(B,H_kv,T,D)
    assert "scaling" in attends[0][4] and "position_ids" in attends[0][4]


def test_cache_kwarg_and_no_cache_position():
    sig = inspect.signature(transformers.LlamaModel.forward)
    assert "cache" in sig.parameters and "cache_position" not in sig.parameters


def test_mask_registered_for_our_names():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hf_adapter.register_attention()
    for name in hf_adapter.ATTN_IMPLEMENTATIONS.values():
        assert name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS


def test_unbound_model_is_pristine(tiny_model):
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        before = tiny_model(input_ids=ids).logits
    engine = make_engine(tiny_model, _RecorderMethod())
    with engine.request() as req:
        req.prefill(ids)
    with torch.no_grad():
        after = tiny_model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_model_info_gqa(tiny_model):
    info = hf_adapter.model_info(tiny_model.config)
    assert (info.num_heads, info.num_kv_heads, info.head_dim, info.group_size) == (4, 2, 16, 2)
    assert info.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


class _BlockObserver(KVLayer):
    def __init__(self, layer_idx, info):
        super().__init__(layer_idx, info)
        self.seen = []

    def observe_attention_block(self, residual, attention_output):
        self.seen.append((residual.clone(), attention_output.clone()))


@dataclasses.dataclass(kw_only=True)
class _BlockObserverMethod(KVMethod):
    name = "block_observer"
    capabilities = Capabilities(observes_attention_block=True)

    def make_layer(self, layer_idx, info):
        return _BlockObserver(layer_idx, info)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_block_seam_gives_layer_input_and_attention_output(family, family_models):
    """`observes_attention_block`: each layer sees its decoder layer's input (the model's
    hidden_states[l]) and an attention output of the same shape, at every forward; the hooks
    exist only while bound, and only for methods declaring the capability."""
    model = family_models(family, 2)
    ids = torch.arange(3, 13)[None]
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    def hooks():  # transformers may hold its own (output recording)
        return (sum(len(m._forward_hooks) for m in hf_adapter.attention_modules(model))
                + sum(len(d._forward_pre_hooks) for d in hf_adapter.decoder_layers(model)))

    before = hooks()
    for method in (_RecorderMethod(), _BlockObserverMethod()):
        engine = make_engine(model, method, chunk=6)
        with engine.request() as req:
            req.prefill(ids[0])
            observes = method.capabilities.observes_attention_block
            assert hooks() == before + (2 * len(hidden[1:]) if observes else 0)
            layers = req.cache.kv_layers
        assert hooks() == before
    for i, layer in enumerate(layers):  # the observer's
        assert len(layer.seen) == 2  # chunks of 6 + 4
        residual = torch.cat([r for r, _ in layer.seen], dim=1)
        assert torch.allclose(residual, hidden[i], atol=1e-5), (family, i)
        assert all(a.shape == r.shape for r, a in layer.seen)


class _IdObserver(KVLayer):
    def __init__(self, layer_idx, info):
        super().__init__(layer_idx, info)
        self.events = []

    def observe_token_ids(self, ids):
        self.events.append(ids.tolist())

    def update(self, keys, values, position_ids):
        self.events.append(keys.shape[2])
        return super().update(keys, values, position_ids)


@dataclasses.dataclass(kw_only=True)
class _IdMethod(KVMethod):
    name = "id_observer"
    capabilities = Capabilities(needs_token_ids=True)

    def make_layer(self, layer_idx, info):
        return _IdObserver(layer_idx, info)


class _BlindIdMethod(_IdMethod):
    name = "blind_id_observer"
    capabilities = Capabilities()


def test_token_id_seam_hands_each_forwards_ids_before_its_update(tiny_model):
    """`needs_token_ids`: before each forward every layer gets that forward's ids (B, q), then
    the update of those q tokens: chunked prefill, decode steps, prepare's capture; a method not
    declaring it gets nothing."""
    ids = torch.arange(3, 13)
    with make_engine(tiny_model, _IdMethod(), chunk=4).request() as req:
        req.prefill(ids)  # chunks of 4 + 4 + 2
        req.step(20)
        layers = req.cache.kv_layers
    chunks = [ids[:4], ids[4:8], ids[8:]]
    want = [e for c in chunks for e in ([c.tolist()], len(c))] + [[[20]], 1]
    assert all(kv.events == want for kv in layers), layers[0].events
    captured = hf_adapter.capture_forward(tiny_model, hf_adapter.model_info(tiny_model.config))
    assert all(kv.events == [[ids.tolist()], 10] for kv in captured(_IdMethod(), ids))
    with make_engine(tiny_model, _BlindIdMethod(), chunk=4).request() as req:
        req.prefill(ids)
        req.step(20)
        assert all(kv.events == [4, 4, 2, 1] for kv in req.cache.kv_layers)


def test_token_id_seam_in_a_batch_routes_real_ids_per_sequence(tiny_model):
    """Batched steps: each sequence's layers get only their own row's real ids (padding never
    seen, an empty chunk never called), then the update of as many tokens."""
    prompts = [list(range(3, 9)), [40, 41, 42]]  # chunks of 4: (4 + 2) and (3, then nothing)
    with make_engine(tiny_model, _IdMethod(), chunk=4).batch(2) as req:
        req.prefill(prompts)
        req.step([0, 1], [50, 51])
        req.step([1], [52])  # sequence 0 has left the batch
        caches = req.caches
    want = [[[[3, 4, 5, 6]], 4, [[7, 8]], 2, [[50]], 1],
            [[[40, 41, 42]], 3, [[51]], 1, [[52]], 1]]
    for cache, events in zip(caches, want):
        assert all(kv.events == events for kv in cache.kv_layers), cache.kv_layers[0].events


class _Prefetcher(KVLayer):
    calls: list = []

    def prefetch(self, hidden_states, position_ids, ahead):
        self.calls.append((id(self), self.layer_idx, ahead))


    def observe_attention_block(self, residual, attention_output):
        self.calls.append((id(self), self.layer_idx, "block"))


class _PrefetchMethod(KVMethod):
    name = "prefetcher"
    capabilities = Capabilities(lookahead=True, observes_attention_block=True)

    def make_layer(self, layer_idx, info):
        return _Prefetcher(layer_idx, info)


def test_requests_side_by_side_share_one_set_of_hooks(tiny_model):
    """Two requests with lookahead and attention-block hooks open at once (lockstep
    benchmarks, a sweep replaying into settings while it records): each forward's bound layer
    is called once per hook, never twice, and the hooks go when the last request closes."""
    engines = [make_engine(tiny_model, _PrefetchMethod()) for _ in range(2)]
    with engines[0].request() as a, engines[1].request() as b:
        a.prefill(torch.arange(3, 9))
        _Prefetcher.calls = []
        b.step(4)
        own = {id(kv) for kv in b.cache.kv_layers}
        assert {c[0] for c in _Prefetcher.calls} <= own
        layers = len(b.cache.kv_layers)
        # layer i: once for itself, once ahead from layer i-1, once its attention block
        assert len(_Prefetcher.calls) == 3 * layers - 1, _Prefetcher.calls
    modules = hf_adapter.attention_modules(tiny_model)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in modules)
    assert not any(hasattr(tiny_model, a) for a in ("_kvh_lookahead", "_kvh_block_hooks"))
    decoders = hf_adapter.decoder_layers(tiny_model)
    assert all(not d._forward_pre_hooks for d in decoders)



class _QueryKeeper(KVLayer):
    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        self.query = query
        return super().attend(module, query, keys, values, attention_mask, base, **kwargs)


class _QueryKeeperMethod(KVMethod):
    name = "query_keeper"

    def make_layer(self, layer_idx, info):
        return _QueryKeeper(layer_idx, info)


@pytest.mark.parametrize("family", [*FAMILIES, "olmo2"])
def test_query_projector_gives_the_query_attention_uses(family):
    """`query_projector` (InfiniGen's and TailorKV's speculation) rebuilds a layer's pre-RoPE
    query from its input with the model's own weights: bias, fused qkv, head_dim and the query
    norm (per head in Qwen3, across heads in OLMo-2). Rotated, it is the query the layer's
    attention receives."""
    model = tiny_family_model(family, 2)
    seen = {}

    def grab_input(module, args, kwargs):
        seen["x"] = kwargs["hidden_states"]

    engine = make_engine(model, _QueryKeeperMethod())
    handle = hf_adapter.attention_modules(model)[1].register_forward_pre_hook(grab_input,
                                                                              with_kwargs=True)
    ids = torch.arange(3, 15)
    try:
        with engine.request() as req:
            req.prefill(ids)
            used = req.cache.kv_layers[1].query  # (1, H_q, T, D)
    finally:
        handle.remove()
    with torch.inference_mode():
        query = hf_adapter.query_projector(model)(1, seen["x"])
    query = rotate(query, torch.arange(ids.numel())[None, None], hf_adapter.rope_inv_freq(model))
    assert query.shape == used.shape
    assert torch.allclose(query, used, atol=1e-5), family


def test_random_probe_ids_stay_inside_the_tokenizer(tiny_model):
    """Embedding rows past the tokenizer (padding, as in Qwen2) are never drawn by probes."""
    class Tokenizer:
        def __len__(self):
            return 200

    rows = tiny_model.config.vocab_size
    assert rows > 200
    assert hf_adapter.prepare_context(tiny_model, Tokenizer()).vocab_size == 200
    assert hf_adapter.prepare_context(tiny_model, None).vocab_size == rows
