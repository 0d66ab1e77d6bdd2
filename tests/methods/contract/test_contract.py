"""Every registered method, over every model family (tests/models.py) and stories260K:

* composes from its YAML, runs prefill + decode on eager and sdpa with chunked prefill, leaves the
  model pristine, and equals the full cache when its budget covers the sequence;
* while it IS compressing (budget well below the sequence, eager attention and, on the tiny
  Llama, sdpa too: the fused decode kernels' case; chunked prefill + decode), at every forward and every layer: K/V shapes, the attention mask's size against what
  `update` returned (`mask_sizes`), kept positions (in range, unique), and against the method's
  declared rule, never its layer's own hooks (tests/methods/contract/rules.py): the budget from
  `layer_budget` (a per-layer split spending no more than the uniform total), the protections its
  knobs name (sinks, windows) kept at every step, a scored-eviction layer's kept set the top of
  its scores, a declared per-head split uneven somewhere, a selecting layer's attended set at
  every step the protected tokens plus the top units of its own scores (methods/selection.py),
  per query head or per KV head as it selects, with every query head's output exact attention
  over its own set (so its KV head served their union), a selecting layer's attended tokens
  carrying more than their share of the exact attention; a layer declaring that its scores
  accumulate attention (`accumulates_attention`: H2O) held to the sums the contract computes
  itself from the attention it observes; each of a method's `path_variants` (settings served by
  other code, e.g. InfiniGen's C speculation kernel) run too;
* every method has a hand-computed kept-set test (`@pytest.mark.kept_set`);
* an architecture it cannot serve is refused by `validate` (capabilities, not method names).

One parametrized test per property over all methods: a new method is covered by adding its files.
"""

import pytest
import torch

from harness.core import hf_adapter
from methods import build_method, method_class
from methods.eviction import EvictionLayer
from tests.conftest import PROJECT, make_engine
from tests.methods.contract import rules
from tests.methods.contract.common import (HEADS, METHODS, MODELS, get_model, run_logits,
                                           skip_if_refused)
from tests.methods.contract.step_checker import SEQ_TOKENS, check_compressing_contract
from tests.models import FAMILIES, family_config


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


# Methods that keep every token (nothing to choose), each with the reason.
NO_KEPT_SET = {"full": "the reference: keeps and attends every token",
               "full_offload": "the reference on the host tier: keeps and attends every token",
               "kivi": "quantizes every token (its hand tests pin the codes)",
               "kvquant": "quantizes every token (its hand tests pin the codes)",
               "turboquant": "quantizes every token (its hand tests pin the codebooks and codes)"}


def hand_kept_set_tests(path) -> list[str]:
    """Test functions in `path` marked `@pytest.mark.kept_set` (parsed, not imported)."""
    import ast

    tree = ast.parse(path.read_text())
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any("kept_set" in ast.unparse(d) for d in node.decorator_list)]


def test_every_method_has_a_hand_computed_kept_set_test():
    """The shared net recomputes a method's kept set from its own scores; only a hand-computed
    example pins the scores themselves: every method's test file marks one
    (`@pytest.mark.kept_set`: the kept, or for a selecting method the attended, positions written
    out by hand; `pytest -m kept_set tests/methods` runs them all)."""
    missing = [name for name in METHODS if name not in NO_KEPT_SET and not hand_kept_set_tests(
        PROJECT / "tests" / "methods" / f"test_{name}.py")]
    assert not missing, f"no @pytest.mark.kept_set test in tests/methods/test_<name>.py: {missing}"
    assert set(NO_KEPT_SET) <= set(METHODS)
    for name in NO_KEPT_SET:
        assert not method_class(name).capabilities.selects_tokens, name


def test_declared_capabilities_match_the_code():
    """Capabilities are read by the runner, so they must be true: every prefill mode is a
    known one; knobs and provenance are declared."""
    from methods.base import PROVENANCES
    from methods.protocol import PREFILL_MODES

    for name in METHODS:
        cls = method_class(name)
        caps = cls.capabilities
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
    """Each prompt greedily continued alone (batch 1) and all together (harness.core.batch), while the
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

def _with_modes():
    """(method, settings) for every method: each mode it declares, then each of its
    `path_variants` (settings taking another code path, e.g. a fused kernel)."""
    cases = []
    for name in METHODS:
        cls = method_class(name)
        modes = cls.capabilities.modes if "mode" in cls.hyperparameter_names() else (None,)
        for mode in modes:
            cases.append(pytest.param(name, {"mode": mode} if mode else {},
                                      id=f"{name}-{mode}" if mode else name))
        for variant in cls.path_variants:
            label = ",".join(f"{k}={v}" for k, v in variant.items())
            cases.append(pytest.param(name, variant, id=f"{name}-{label}"))
    return cases


# every model under eager attention (the heads model too), and the tiny Llama under sdpa too
# (see the checker)
ATTENTIONS = [*((which, "eager") for which in [*MODELS, HEADS]), ("llama", "sdpa")]


@pytest.mark.parametrize("which, attn", ATTENTIONS,
                         ids=[w if a == "eager" else f"{w}-{a}" for w, a in ATTENTIONS])
@pytest.mark.parametrize("name, variant", _with_modes())
def test_contract_holds_at_every_step_while_compressing(name, variant, which, attn, request,
                                                         tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    # The cache contract, not the kernels (they have their own tests): torch paths on CPU.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = get_model(which, request, layers=3)  # InfiniGen leaves layers 0 and 1 dense
    settings = method_class(name).compressing_hyperparameters(SEQ_TOKENS)
    method = build_method(name, **{**settings, **variant})
    skip_if_refused(method, model)
    check_compressing_contract(model, method, trained=which == "stories", attn=attn)


@pytest.mark.parametrize("name", METHODS)
def test_declared_protections_hold_against_adverse_scores(name, request, tmp_path, monkeypatch):
    """The compressing contract with every scored-eviction layer's score negated: what its knobs
    protect (a sink, a recent window) is then what its scores would evict first."""
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    method = build_method(name, **method_class(name).compressing_hyperparameters(SEQ_TOKENS))
    model = get_model("llama", request, layers=3)
    skip_if_refused(method, model)
    try:
        layer = method.make_layer(0, hf_adapter.model_info(model.config))
    except RuntimeError:  # needs its prepared artefacts: not a plain template layer
        layer = None
    if not (isinstance(layer, EvictionLayer) and layer.selects_top_scores):
        pytest.skip("no scored-eviction layer: no score to turn against its protections")
    if not any(rules.declared_protections(method, SEQ_TOKENS)):
        pytest.skip("its knobs declare no protection")
    check_compressing_contract(model, method, adverse=True)


# --- refusals ------------------------------------------------------------------------------------

def layers_beyond(method, num_layers: int) -> list[str]:
    """The knobs of `method` that name layers (a list of layer indices) naming one the model
    does not have: refusing them is a refusal of the knob's value on a small model (TidalDecode's
    selection layers 2 and 13 on 2 layers), not of the family."""
    return [knob for knob, value in method.hyperparameters().items()
            if isinstance(value, (list, tuple)) and value
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            and max(value) >= num_layers]


@pytest.mark.parametrize("family", FAMILIES)
def test_refusals_follow_capabilities(family):
    """Only sliding-window layers (the tiny Mistral) refuse, and exactly the token-selecting
    methods; every other family serves every method (a knob naming a layer the tiny model
    lacks may be refused, by a reason naming that knob)."""
    info = hf_adapter.model_info(family_config(family))
    for name in METHODS:
        # ShadowKV's default threshold (official: prompts above 4096 tokens) is beyond the tiny
        # models' positions, a refusal of the knob's value, not of the family
        method = build_method(name, **({"compress_above_tokens": 0} if name == "shadowkv" else {}))
        reasons = method.validate(info, {"batch_size": 1})
        beyond = layers_beyond(method, info.num_layers)
        if beyond:  # refused for its layer knobs: only by reasons naming them
            knob_reasons = [r for r in reasons if any(f"method.{k}=" in r for k in beyond)]
            assert knob_reasons, (name, family, f"{beyond} name layers it lacks, unrefused")
            reasons = [r for r in reasons if r not in knob_reasons]
        expect = family == "mistral" and method.capabilities.selects_tokens
        assert bool(reasons) == expect, (name, family, reasons)
        if expect:
            assert len(reasons) == 1 and "sliding-window attention (24 tokens" in reasons[0]
