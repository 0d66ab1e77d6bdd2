"""One forward over a method's cache: the steps every path shares, written once.

Every forward the harness makes over a method's layers goes through here: a request's prefill
chunks and decode steps (harness.core.engine.Request), a batch's (harness.core.batch.BatchRequest),
independent requests stepped together (harness.core.batch.Lockstep: a sweep's decode, streams), the
cache handed to transformers' own `generate` (harness.api, around the model's forward) and a
recorded prompt replayed into a setting's layers (harness.sweep.replay). A forward is:

1. `begin_step`, once per prefill (all its chunks) or decode step: each engine's transfer ledger
   opens the step (host-to-device bytes are counted per decode step);
2. `start`: a stop asked by a signal is raised here, between forwards (kvcore.guards);
3. computing the layers: the model's forward (`hf_adapter.forward`), or the replay of a recorded
   one, given by the caller;
4. `finish`, for every sequence the forward fed: a decode step enters the attended-fraction
   accounting, the method evicts (`KVLayer.after_forward`: attention has used the tokens), every
   layer's budget is checked (`check_budget`), the sequence's position advances.

`run` is 2 to 4, timed as the engine's "prefill" or "decode" region. transformers' `generate`
calls the model itself, so the API cache runs `start` and `finish` from hooks around that call
(hf_adapter.watch_forwards) instead of `run`; so does a replay, whose layer calls may come from a
recording being made by another forward (harness.sweep.replay `_PromptReplay`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch

from kvcore.guards import check_stop

if TYPE_CHECKING:
    from harness.core.profiling import Timer


class Fed(Protocol):
    """A sequence a forward feeds: a request (harness.core.engine.Request), a batch's sequence
    (`BatchSequence`) or the API cache (harness.api.MethodKVCache)."""

    engine: Any  # harness.core.engine.Engine: whose accounting the sequence enters
    pos: int  # tokens fed so far

    @property
    def kv_layers(self) -> list:  # its KVLayer per decoder layer
        ...


@dataclass
class BatchSequence:
    """One sequence of a batch (harness.core.batch.BatchRequest): its own layers and position."""

    engine: Any
    kv_layers: list
    pos: int = 0


def begin_step(engines: Iterable[Any], decode: bool) -> None:
    """A prefill or a decode step starts on each of `engines`: their transfer ledgers open it."""
    for engine in engines:
        engine.transfers.begin_step(decode=decode)


def start() -> None:
    """Before a forward: a signal whose KeyboardInterrupt a finalizer swallowed stops here."""
    check_stop()


def check_budget(engine, layers) -> None:
    """Every layer within its budget now, when the run checks budgets (runner.check_budget)."""
    if engine.settings.check_budget:
        engine.ledger.check_step(layers)


def finish(fed: list[Fed], tokens: list[int], decode: bool) -> None:
    """After a forward that fed `tokens[i]` tokens to sequence `fed[i]` (0: none this forward,
    e.g. a batch row whose prompt is over): only `decode` steps enter the attended-fraction
    accounting; then the method evicts, the budget is checked and the position advances."""
    for seq, n in zip(fed, tokens):
        if not n:
            continue
        layers = seq.kv_layers
        if decode:
            seq.engine.attended.add_step(layers)
        for kv in layers:  # eviction happens after attention has used the tokens
            kv.after_forward()
        check_budget(seq.engine, layers)
        seq.pos += n


def run(compute: Callable[[], torch.Tensor | None], fed: list[Fed], tokens: list[int],
        decode: bool, timer: "Timer | None" = None, sample: bool = False
        ) -> tuple[torch.Tensor | None, list[list[torch.Tensor]] | None]:
    """One forward: `compute()` runs the layers (returns logits `(B, T_keep, V)`, or None for a
    replay), then `finish`, all inside `timer`'s "decode" or "prefill" region. Returns the logits
    in fp32 and, with `sample`, the positions each layer of each sequence attended, read before
    eviction (diagnostics)."""
    start()
    region = (timer.region("decode" if decode else "prefill") if timer is not None
              else contextlib.nullcontext())
    with region:
        logits = compute()
        attended = ([[kv.kept_positions().clone() for kv in seq.kv_layers] for seq in fed]
                    if sample else None)
        finish(fed, tokens, decode)
        logits = None if logits is None else logits.float()
    return logits, attended
