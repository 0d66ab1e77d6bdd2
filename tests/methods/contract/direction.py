"""Whether a scored-eviction method's scores point the right way: KL(full || method) against
KL(full || its mirror, the same method with `score()` negated) on a PG-19 prompt."""

import torch
import torch.nn.functional as F

from methods import build_method
from methods.eviction import EvictionLayer
from tests.conftest import DATA, make_engine, need_shared

PROMPT_TOKENS, STEPS, BUDGET_RATIO = 300, 100, 0.2


def mirrored(layers) -> None:
    """Negate every template layer's score (its protections unchanged); the steady-state
    shortcuts that pick a victim without score() are switched off so the negation applies."""
    for kv in layers:
        if isinstance(kv, EvictionLayer):
            score = kv.score
            kv.score = lambda score=score: -score()
            kv.lowest_slot = lambda budget, kv=kv: kv.guarded_scores(budget).argmin(dim=-1)
            kv.one_token_eviction = lambda: None


def decode_logits(model, tok, method, ids, mirror=False) -> torch.Tensor:
    engine = make_engine(model, method, tok)
    with engine.request() as req:
        if mirror:
            mirrored(req.cache.kv_layers)
        out = [req.prefill(ids[:PROMPT_TOKENS])[0, -1]]
        out += [req.step(ids[t:t + 1])[0, -1] for t in range(PROMPT_TOKENS, PROMPT_TOKENS + STEPS)]
    return torch.stack(out)


def kl_to(full: torch.Tensor, got: torch.Tensor) -> float:
    return F.kl_div(F.log_softmax(got, -1), F.log_softmax(full, -1), log_target=True,
                    reduction="none").sum(-1).mean().item()


def beats_its_mirror(model, tok, name: str, ids) -> tuple[bool, float, float]:
    kwargs = {"budget_ratio": BUDGET_RATIO}
    full = decode_logits(model, tok, build_method("full"), ids)
    own = kl_to(full, decode_logits(model, tok, build_method(name, **kwargs), ids))
    mirror = kl_to(full, decode_logits(model, tok, build_method(name, **kwargs), ids, True))
    return own < mirror, own, mirror


def pg19_ids(tok) -> torch.Tensor:
    need_shared(DATA)
    text = (DATA / "pg19" / "pg19_firstbook.txt").read_text()
    return torch.tensor(tok(text, verbose=False)["input_ids"][:PROMPT_TOKENS + STEPS + 1])
