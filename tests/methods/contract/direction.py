"""Whether a method's scores chose well: KL(full || method) against KL(full || its mirror, the
same method keeping its lowest scores) and KL(full || a random choice, the same method with
seeded random scores) on a PG-19 prompt. Protections, budgets and everything else stay the
method's own: only the scores the template ranks (`score()` of a scored-eviction layer,
`selection_scores()` of a selecting layer) are turned."""

import torch
import torch.nn.functional as F

from methods import build_method, method_class
from methods.eviction import EvictionLayer
from methods.selection import SelectionLayer
from tests.conftest import DATA, make_engine, need_shared

PROMPT_TOKENS, STEPS, BUDGET_RATIO = 300, 100, 0.2
TURNS = ("mirror", "random")


def mirrored(layers) -> None:
    """Negate every template layer's score (its protections unchanged); the steady-state
    shortcuts that pick a victim without score() are switched off so the negation applies."""
    turned(layers, "mirror", selecting=False)


def _turn(how: str, gen: torch.Generator):
    def turn(scores: torch.Tensor) -> torch.Tensor:
        if how == "mirror":
            return torch.where(torch.isfinite(scores), -scores, scores)
        noise = torch.rand(scores.shape, generator=gen).to(scores.device)
        return torch.where(torch.isfinite(scores), noise, scores)
    return turn


def turned(layers, how: str, selecting: bool = True) -> None:
    """`how` = "mirror": every ranked score negated; "random": replaced by seeded uniform noise
    (a score of -inf, never chosen, stays so). `selecting`: selecting layers too."""
    turn = _turn(how, torch.Generator().manual_seed(0))
    for kv in layers:
        if isinstance(kv, EvictionLayer):
            score = kv.score
            kv.score = (lambda score=score: -score()) if how == "mirror" else (
                lambda score=score: turn(score()))
            kv.lowest_slot = lambda budget, kv=kv: kv.guarded_scores(budget).argmin(dim=-1)
            kv.one_token_eviction = lambda: None
        elif selecting and isinstance(kv, SelectionLayer):
            scores = kv.selection_scores
            kv.selection_scores = lambda *a, scores=scores: turn(scores(*a))


def decode_logits(model, tok, method, ids, how=None) -> torch.Tensor:
    engine = make_engine(model, method, tok)
    with engine.request() as req:
        if how is not None:
            turned(req.cache.kv_layers, how)
        out = [req.prefill(ids[:PROMPT_TOKENS])[0, -1]]
        out += [req.step(ids[t:t + 1])[0, -1] for t in range(PROMPT_TOKENS, PROMPT_TOKENS + STEPS)]
    return torch.stack(out)


def kl_to(full: torch.Tensor, got: torch.Tensor) -> float:
    return F.kl_div(F.log_softmax(got, -1), F.log_softmax(full, -1), log_target=True,
                    reduction="none").sum(-1).mean().item()


def direction_settings(name: str) -> dict:
    """The budget ratio, and what the method declares for this test
    (`direction_hyperparameters`: settings under which its scores choose part of the kept set
    on this prompt, e.g. LagKV's shorter partitions, or which fit stories260K's 5 layers)."""
    cls = method_class(name)
    ratio = {"budget_ratio": BUDGET_RATIO} if "budget_ratio" in cls.hyperparameter_names() else {}
    return {**ratio, **LEGACY_DIRECTION_SETTINGS.get(name, {}),
            **getattr(cls, "direction_hyperparameters", {})}


# Settings for methods written before `direction_hyperparameters` (a new method declares its own)
LEGACY_DIRECTION_SETTINGS = {
    "shadowkv": {"compress_above_tokens": 0},  # official: prompts above 4096 tokens only
    "tailorkv": {"sink_tokens": 4, "recent_tokens": 16},  # 8 + 56 fill most of the 80 tokens
}


def direction_kls(model, tok, name: str, ids, turns=TURNS) -> dict[str, float]:
    """KL(full || method) for the method ("own") and for each turn of its scores."""
    kwargs = direction_settings(name)
    full = decode_logits(model, tok, build_method("full"), ids)
    out = {"own": kl_to(full, decode_logits(model, tok, build_method(name, **kwargs), ids))}
    for how in turns:
        out[how] = kl_to(full, decode_logits(model, tok, build_method(name, **kwargs), ids, how))
    return out


def beats_its_mirror(model, tok, name: str, ids) -> tuple[bool, float, float]:
    kls = direction_kls(model, tok, name, ids, turns=("mirror",))
    return kls["own"] < kls["mirror"], kls["own"], kls["mirror"]


def pg19_ids(tok) -> torch.Tensor:
    need_shared(DATA)
    text = (DATA / "pg19" / "pg19_firstbook.txt").read_text()
    return torch.tensor(tok(text, verbose=False)["input_ids"][:PROMPT_TOKENS + STEPS + 1])
