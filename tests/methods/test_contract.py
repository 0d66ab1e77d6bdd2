"""Every registered method, over every model family (tests/models.py) and stories260K:

* composes from its YAML, runs prefill + decode on eager and sdpa with chunked prefill, leaves the
  model pristine, and equals the full cache when its budget covers the sequence;
* while it IS compressing (budget well below the sequence, eager attention, chunked prefill +
  decode), at every forward and every layer: K/V shapes, the attention mask's size against what
  `update` returned (`mask_sizes`), kept positions (in range, unique, declared sinks and recent
  tokens kept), and the budget;
* an architecture it cannot serve is refused by `validate` (capabilities, not method names).

One parametrized test per property over all methods: a new method is covered by adding its files.
"""


import pytest
import torch

from harness import hf_adapter
from methods.eviction import EvictionLayer
from methods import available_methods, build_method, method_class
from tests.conftest import PROJECT, make_engine
from tests.models import FAMILIES, family_config

METHODS = available_methods()
MODELS = ["stories", *FAMILIES]  # "llama" is the harness's reference tiny GQA Llama


def get_model(which, request, layers=2):
    if which == "stories":
        return request.getfixturevalue("stories")[0]
    if which == "llama" and layers == 2:
        return request.getfixturevalue("tiny_model")
    return request.getfixturevalue("family_models")(which, layers)


def skip_if_refused(method, model):
    """A method refused for this architecture (by design, see test_refusals_follow_...) is not
    run on it; the skip carries the one-line refusal."""
    reasons = method.validate(hf_adapter.model_info(model.config), {"batch_size": 1})
    if reasons:
        pytest.skip(f"refused: {'; '.join(reasons)}")


def run_logits(model, method, ids, prefill_end, chunk):
    engine = make_engine(model, method, chunk=chunk)
    with engine.request(final_tokens=ids.shape[1]) as req:  # the final length: all of ids
        out = [req.prefill(ids[:, :prefill_end], all_logits=True)]
        out += [req.step(ids[:, i]) for i in range(prefill_end, ids.shape[1])]
    return torch.cat(out, 1), engine


def test_every_method_has_yaml_and_test():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from methods import SHARED_KNOBS

    for name in METHODS:
        with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
            conf = OmegaConf.to_container(compose("config", [f"method={name}"]).method)
        assert conf.pop("name") == name
        fields = method_class(name).hyperparameter_names()
        assert set(fields) <= set(conf) <= set(fields) | set(SHARED_KNOBS), name
        assert (PROJECT / "tests" / "methods" / f"test_{name}.py").is_file(), name
        build_method(name, **conf)  # the defaults are valid


def test_declared_capabilities_match_the_code():
    """Capabilities are read by the runner, so they must be true: a method with its own
    `prepare` declares needs_prepare (the runner skips prepare otherwise), one that keeps the
    full cache as a reference declares compresses=False, every prefill mode is a known one."""
    from methods.base import PREFILL_MODES, PROVENANCES, KVMethod

    for name in METHODS:
        cls = method_class(name)
        caps = cls.capabilities
        assert (cls.prepare is not KVMethod.prepare) == caps.needs_prepare, name
        assert set(caps.prefill_modes) <= set(PREFILL_MODES) and caps.prefill_modes, name
        fields = set(cls.hyperparameter_names())
        assert set(cls.axis_keys) | set(cls.variant_keys) <= fields | {"budget_ratio",
                                                                       "budget_tokens"}, name
        # provenance and operating point are the method's own, declared (not inherited)
        assert "provenance" in vars(cls) and cls.provenance in PROVENANCES, name
        assert "operating_point" in vars(cls) and len(cls.operating_point) > 20, name
        assert build_method(name).provenance_label().startswith(PROVENANCES), name


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("which", MODELS)
@pytest.mark.parametrize("name", METHODS)
def test_budget_covering_the_sequence_equals_full(name, which, attn, request, tmp_path,
                                                  monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))  # prepared artefacts stay in the test
    model = get_model(which, request)
    method = build_method(name, **method_class(name).lossless_hyperparameters(72))
    skip_if_refused(method, model)
    torch.manual_seed(3)
    ids = torch.randint(3, 250, (1, 72))
    hf_adapter.set_attention(model, attn)
    try:
        full, _ = run_logits(model, build_method("full"), ids, 56, chunk=24)
        got, engine = run_logits(model, method, ids, 56, chunk=24)
    finally:
        hf_adapter.set_attention(model, "sdpa")
    assert (got - full).abs().max().item() <= 2e-5, name
    assert not any(hasattr(m, "_kvh_layer") for m in hf_adapter.attention_modules(model))
    assert engine.ledger.samples[-1]["tokens_per_layer"][0] > 0


# --- batches -------------------------------------------------------------------------------------

RAGGED_PROMPT_TOKENS, BATCH_DECODE_STEPS = (40, 64, 23), 6


def alone_and_batched(model, name, prompts, steps):
    """Each prompt greedily continued alone (batch 1) and all together (harness.batch), while the
    method compresses: per sequence (logits (steps+1, V), tokens) for both."""
    settings = method_class(name).compressing_hyperparameters(max(len(p) for p in prompts))
    alone = []
    engine = make_engine(model, build_method(name, **settings), chunk=16)
    for prompt in prompts:
        with engine.request() as req:
            logits = [req.prefill(prompt)[0, -1]]
            for _ in range(steps):
                logits.append(req.step(int(logits[-1].argmax()))[0, -1])
        stacked = torch.stack(logits)
        alone.append((stacked, stacked.argmax(-1).tolist()))
    engine = make_engine(model, build_method(name, **settings), chunk=16)
    with engine.batch(len(prompts)) as batch:
        logits = [batch.prefill(prompts)]
        for _ in range(steps):
            logits.append(batch.step(list(range(len(prompts))), logits[-1].argmax(-1).tolist()))
    stacked = torch.stack(logits, 1)  # (B, steps + 1, V)
    batched = [(stacked[i], stacked[i].argmax(-1).tolist()) for i in range(len(prompts))]
    return alone, batched, engine


@pytest.mark.parametrize("which", ["llama", "mistral"])
@pytest.mark.parametrize("name", METHODS)
def test_batch_of_ragged_requests_equals_each_alone(name, which, request, tmp_path, monkeypatch):
    """B=3 ragged prompts prefilled (chunked) and decoded together while the method compresses:
    every sequence equals its own batch-1 run (same tokens, logits within fp32 tolerance), and
    the engine checked every sequence's budget at every forward (check_budget is on)."""
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = get_model(which, request, layers=3)
    settings = method_class(name).compressing_hyperparameters(64)
    skip_if_refused(build_method(name, **settings), model)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in RAGGED_PROMPT_TOKENS]
    alone, batched, engine = alone_and_batched(model, name, prompts, BATCH_DECODE_STEPS)
    for i, ((ref, ref_tokens), (got, got_tokens)) in enumerate(zip(alone, batched)):
        assert got_tokens == ref_tokens, f"{name}: sequence {i}"
        assert (got - ref).abs().max().item() <= 1e-5, f"{name}: sequence {i}"
    assert len(engine.ledger.samples) == len(prompts)  # one record per sequence
    seen = sorted(s["seen_tokens"] for s in engine.ledger.samples)
    assert seen == sorted(n + BATCH_DECODE_STEPS for n in RAGGED_PROMPT_TOKENS)


# --- while compressing ---------------------------------------------------------------------------

SEQ_TOKENS, PREFILL_TOKENS, CHUNK_TOKENS = 64, 48, 16


def recomputed_keep(positions, scores, sinks, recent, seen, budgets):
    """Independently of the template's code: per KV head, the text positions a method's own
    `score()` and `protected(budget)` imply are kept, as (protected set, chosen set, candidates):
    every protected position held is kept; the rest of the head's budget (`budgets`: one per
    head, or one for all) goes to the highest scores among the unprotected (ties at the
    boundary: any of the tied tokens)."""
    out = []
    rows = positions.reshape(-1, positions.shape[-1]).tolist()
    budgets = budgets if isinstance(budgets, list) else [budgets] * len(rows)
    for pos_row, score_row, budget in zip(rows, scores.reshape(-1, scores.shape[-1]).tolist(),
                                          budgets):
        guard = {p for p in pos_row if p < sinks or p >= seen - recent}
        free = sorted(((s, p) for p, s in zip(pos_row, score_row) if p not in guard), reverse=True)
        out.append((guard, free, max(0, budget - len(guard))))
    return out


def held_rows(positions):
    """Per (batch row, KV head): the positions a layer holds (a ragged head's -1 padding out)."""
    return [[p for p in r if p >= 0] for r in positions.reshape(-1, positions.shape[-1]).tolist()]


class StepChecker:
    """Wraps one request's layers (instances only) and checks the contract at every forward and
    at every compression of a scored-eviction method (its kept set against its own rule)."""

    def __init__(self, method, info, layers):
        self.method, self.info, self.layers = method, info, layers
        self.forwards = 0
        self.compressed = False  # some layer held or attended less than the full cache
        self.choices = 0  # compressions where the scores chose among more tokens than slots
        self.prompt_budget: dict[int, int] = {}  # layer -> its budget at the prompt's end
        for layer in layers:
            layer.update = self._update(layer, layer.update)
            layer.attend = self._attend(layer, layer.attend)
            layer.after_forward = self._after_forward(layer, layer.after_forward)
            layer.on_prefill_end = self._on_prefill_end(layer, layer.on_prefill_end)
            if scored_eviction(layer):
                layer.compress_to = self._compress_to(layer, layer.compress_to)

    def _compress_to(self, layer, compress_to):
        def checked(budget):
            kept_before, seen = layer.kept_tokens(), layer.seen_tokens
            where = f"layer {layer.layer_idx} after {seen} tokens, budget {budget}"
            assert budget == self.rule(layer), (
                f"{where}: compressed to {budget}, the rule says {self.rule(layer)}")
            if kept_before <= budget:
                return compress_to(budget)
            positions, scores = layer.positions.clone(), layer.score().float().clone()
            sinks, recent = layer.protected(budget)
            compress_to(budget)
            kept = held_rows(layer.kept_positions())
            counts = [len(row) for row in kept]
            h_kv = layer.kept_positions().shape[1]
            if layer.method.allocates_per_head():  # head-wise: the split must hold the rule's total
                for b in range(len(counts) // h_kv):
                    assert sum(counts[b * h_kv:(b + 1) * h_kv]) == h_kv * budget, (
                        f"{where}: heads keep {counts[b * h_kv:(b + 1) * h_kv]}, the rule says "
                        f"{h_kv} x {budget}")
            else:
                assert counts == [budget] * len(counts), f"{where}: heads keep {counts}"
            expected = recomputed_keep(positions, scores, sinks, recent, seen, counts)
            for head, ((guard, free, slots), row) in enumerate(zip(expected, kept)):
                row = set(row)
                assert len(row) == counts[head], f"{where}, head {head}: repeated positions"
                budget = counts[head]
                assert guard <= row or len(guard) > budget, (
                    f"{where}, head {head}: declared protections (protected={sinks, recent}) "
                    f"evicted: {sorted(guard - row)}")
                chosen = [s for s, p in free if p in row]
                dropped = [s for s, p in free if p not in row]
                assert len(chosen) == min(slots, len(free)), f"{where}, head {head}"
                if chosen and dropped:
                    assert min(chosen) >= max(dropped), (
                        f"{where}, head {head}: kept a score {min(chosen):.4g} below an evicted "
                        f"{max(dropped):.4g} (the kept set is not the top of score())")
                    self.choices += 1
        return checked

    def rule(self, layer) -> int:
        """A template layer's budget now, from the method's rule and the protocol's basis (a
        layer with a budget() of its own, SqueezeAttention's, is held to it; under the final-
        length basis it may never change after the prompt: the basis does not)."""
        if type(layer).budget is EvictionLayer.budget:
            rule = layer.method.layer_budget(layer.layer_idx, self.info.num_layers,
                                             layer.basis_tokens())
        else:
            rule = layer.budget()
        if layer.protocol.budget_basis == "final":
            first = self.prompt_budget.setdefault(layer.layer_idx, rule)
            assert rule == first, (f"layer {layer.layer_idx}: the budget moved from {first} to "
                                   f"{rule} under the final-length basis")
        return rule

    def _on_prefill_end(self, layer, on_prefill_end):
        def checked():
            on_prefill_end()
            if isinstance(layer, EvictionLayer):  # the allowance is the rule's, never self-granted
                assert layer.allowed_tokens() == self.rule(layer), (
                    f"layer {layer.layer_idx} at the prompt's end: allowed "
                    f"{layer.allowed_tokens()}, the rule says {self.rule(layer)}")
            self.check_budget_and_positions(layer)
        return checked

    def _update(self, layer, update):
        def checked(keys, values, position_ids):
            q_len, seen = keys.shape[-2], layer.seen_tokens
            length, offset = layer.mask_sizes(q_len)  # what the mask will be built for
            out_k, out_v = update(keys, values, position_ids)
            b, h_kv, d = keys.shape[0], self.info.num_kv_heads, self.info.head_dim
            where = f"layer {layer.layer_idx} after {seen} tokens"
            assert out_k.shape[:2] == (b, h_kv) and out_k.shape[-1] == d, where
            assert out_v.shape == out_k.shape, where
            assert out_k.shape[-2] == length, (
                f"{where}: mask_sizes says {length} keys, update returned {out_k.shape[-2]}")
            assert offset + length == seen + q_len, f"{where}: mask offset {offset} + {length}"
            return out_k, out_v
        return checked

    def _attend(self, layer, attend):
        def checked(module, query, keys, values, attention_mask, base, **kwargs):
            if attention_mask is not None:  # eager: the mask built from mask_sizes
                assert tuple(attention_mask.shape[-2:]) == (query.shape[2], keys.shape[-2]), (
                    f"layer {layer.layer_idx}: mask {tuple(attention_mask.shape)} for "
                    f"{query.shape[2]} queries over {keys.shape[-2]} keys")
            out = attend(module, query, keys, values, attention_mask, base, **kwargs)
            b, h_q, q_len, d = query.shape
            assert out[0].shape == (b, q_len, h_q, d), f"layer {layer.layer_idx}: output shape"
            return out
        return checked

    def _after_forward(self, layer, after_forward):
        def checked():
            after_forward()
            self.check_budget_and_positions(layer)
            if layer.layer_idx == 0:
                self.forwards += 1
        return checked

    def check_budget_and_positions(self, layer):
        seen, stats, budget = layer.seen_tokens, layer.stats(), layer.allowed_tokens()
        used = stats.get("selected_tokens", stats["kv_tokens"])
        where = f"layer {layer.layer_idx} after {seen} tokens"
        if budget is not None:
            assert used <= budget, f"{where}: uses {used} tokens, budget {budget}"
        full_bytes = 2 * seen * self.info.num_kv_heads * self.info.head_dim * 4  # fp32 K and V
        self.compressed |= used < seen or stats["kv_bytes"] < full_bytes
        positions = layer.kept_positions()
        assert not positions.is_floating_point(), where
        lengths = layer.kept_lengths() if hasattr(layer, "kept_lengths") else None
        if lengths is not None:  # ragged heads: padded with -1 past each head's own length
            self.check_ragged(layer, positions, lengths, stats)
        held = held_rows(positions)
        assert all(0 <= p < seen for r in held for p in r), f"{where}: positions out of range"
        assert all(len(set(r)) == len(r) for r in held), f"{where}: repeated positions"
        if "selected_tokens" not in stats and lengths is None:
            assert positions.shape[-1] == stats["kv_tokens"], where
        rows = positions.reshape(-1, positions.shape[-1]).cpu()
        self.check_declared_keeps(layer, rows, budget, stats["kv_tokens"])

    def check_ragged(self, layer, positions, lengths, stats):
        """Ragged heads: exactly `lengths` held positions per head, the padding -1; the token
        figure is the mean over heads (rounded up) and the bytes count only what heads hold
        (with the slots that stand for no position, `virtual_slots()`: RazorAttention's
        compensation token); a layer with a per-head rule (`head_allowed_tokens()`) holds at
        most that in every head."""
        where = f"layer {layer.layer_idx} after {layer.seen_tokens} tokens"
        counts = (positions >= 0).sum(-1)
        assert torch.equal(counts.cpu(), lengths.cpu()), f"{where}: padding is not -1"
        slots = torch.arange(positions.shape[-1], device=positions.device)
        assert bool(((slots < lengths[..., None]) == (positions >= 0)).all()), where
        held = lengths + (layer.virtual_slots() if hasattr(layer, "virtual_slots") else 0)
        assert stats["kv_tokens"] == -(-int(held.sum()) // held.numel()), (
            f"{where}: kv_tokens {stats['kv_tokens']} for heads holding {held.tolist()}")
        token_bytes = 2 * self.info.head_dim * layer.keys.element_size()  # K and V, one head
        assert stats["kv_bytes"] == int(held.sum()) * token_bytes, (
            f"{where}: kv_bytes {stats['kv_bytes']} for heads holding {held.tolist()}")
        allowed = layer.head_allowed_tokens() if hasattr(layer, "head_allowed_tokens") else None
        if allowed is not None:
            assert bool((held <= allowed).all()), (
                f"{where}: heads hold {held.tolist()}, the rule allows {allowed.tolist()}")

    def check_declared_keeps(self, layer, rows, budget, kept):
        """Sinks a method without the scored-eviction template declares (`sink_tokens`) are kept
        once it evicts (template methods: every compression is checked against their own
        `protected(budget)`, above)."""
        seen, where = layer.seen_tokens, f"layer {layer.layer_idx} after {layer.seen_tokens} tokens"
        if kept >= seen or budget is None or scored_eviction(layer):
            return
        sinks, recent = getattr(self.method, "sink_tokens", 0) or 0, 0
        for row in rows.tolist():
            assert set(range(min(sinks, seen))) <= set(row), f"{where}: sinks evicted"
            assert set(range(seen - recent, seen)) <= set(row), f"{where}: recent tokens evicted"


def scored_eviction(layer) -> bool:
    """A layer on the scored-eviction template that keeps the top of its own scores, whatever
    code of its own does it (`selects_top_scores`; KVMerger merges instead, by its own test)."""
    return isinstance(layer, EvictionLayer) and layer.selects_top_scores


# (method, mode or None) -> (strict, reason): the known contract exceptions, each explained.
KNOWN_EXCEPTIONS = {
    ("kivi", None): (False, "KIVI's fused decode path: update() returns only the full-precision "
                            "tails and attend() reads the packed cache itself (layer.step_cache); "
                            "outputs equal dequantize-then-attend (tests/methods/test_kivi.py)"),
    ("kvquant", None): (False, "KVQuant's decode path, as KIVI's: update() returns the new tokens "
                               "and attend() reads the codes itself (layer.step_cache); outputs "
                               "equal dequantize-then-attend (tests/methods/test_kvquant.py)"),
    ("turboquant", None): (False, "TurboQuant's decode path, as KVQuant's: update() returns the new "
                                  "tokens and attend() reads the codes itself "
                                  "(layer.step_cache); outputs equal dequantize-then-attend "
                                  "(tests/methods/test_turboquant.py)"),
    ("tailorkv", None): (False, "TailorKV's quantized layers are KIVI's layers (see kivi); its "
                                "sparse layers alone pass strictly "
                                "(tests/methods/test_tailorkv.py)"),
}


def _with_modes():
    """(method, mode) for every method and each mode it declares (None: no mode knob)."""
    cases = []
    for name in METHODS:
        cls = method_class(name)
        modes = cls.capabilities.modes if "mode" in cls.hyperparameter_names() else (None,)
        for mode in modes:
            known = KNOWN_EXCEPTIONS.get((name, mode))
            marks = pytest.mark.xfail(strict=known[0], reason=known[1]) if known else ()
            cases.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}" if mode else name))
    return cases


@pytest.mark.parametrize("which", MODELS)
@pytest.mark.parametrize("name, mode", _with_modes())
def test_contract_holds_at_every_step_while_compressing(name, mode, which, request, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    # The cache contract, not the kernels (they have their own tests): torch paths on CPU.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = get_model(which, request, layers=3)  # InfiniGen leaves layers 0 and 1 dense
    settings = method_class(name).compressing_hyperparameters(SEQ_TOKENS)
    method = build_method(name, **settings, **({"mode": mode} if mode else {}))
    skip_if_refused(method, model)
    check_compressing_contract(model, method)


def check_compressing_contract(model, method):
    """The contract while `method` compresses SEQ_TOKENS random tokens (eager attention, a
    chunked prompt, then decode steps); raises AssertionError / BudgetViolation on a breach."""
    name, settings = method.name, method.hyperparameters()
    info = hf_adapter.model_info(model.config)
    ids = torch.randint(3, 250, (1, SEQ_TOKENS), generator=torch.Generator().manual_seed(7))
    hf_adapter.set_attention(model, "eager")
    try:
        engine = make_engine(model, method, chunk=CHUNK_TOKENS)
        with engine.request() as req:
            checker = StepChecker(method, info, req.cache.kv_layers)
            logits = req.prefill(ids[:, :PREFILL_TOKENS])
            for i in range(PREFILL_TOKENS, SEQ_TOKENS):
                logits = req.step(ids[:, i])
    finally:
        hf_adapter.set_attention(model, "sdpa")
    assert torch.isfinite(logits).all()
    assert checker.forwards == PREFILL_TOKENS // CHUNK_TOKENS + SEQ_TOKENS - PREFILL_TOKENS
    assert checker.compressed == method.capabilities.compresses, (
        f"{name} {settings}: held or attended less than the full cache: {checker.compressed}")
    if any(scored_eviction(layer) for layer in req.cache.kv_layers):
        assert checker.choices > 0, (
            f"{name} {settings}: its scores never chose a token (every slot protected): the "
            "compressing case must leave slots to the scores (compressing_hyperparameters)")


# --- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_refusals_follow_capabilities(family):
    """Only sliding-window layers (the tiny Mistral) refuse, and exactly the token-selecting
    methods; every other family serves every method."""
    info = hf_adapter.model_info(family_config(family))
    for name in METHODS:
        method = build_method(name)
        reasons = method.validate(info, {"batch_size": 1})
        expect = family == "mistral" and method.capabilities.selects_tokens
        assert bool(reasons) == expect, (name, family, reasons)
        if expect:
            assert len(reasons) == 1 and "sliding-window attention (24 tokens" in reasons[0]
